"""Frozen configuration of the gateway: the worker's configuration it holds, and its own fields and flags."""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field

from gateway.served_models import adapter_name_problem
from worker.config import WorkerConfig
from worker.config_flags import config_from_flags, flag


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry: an adapter loaded at startup."""
    name: str
    path: str
    base_model_name: str | None = None
    pinned: bool = False        # never evicted from the host cache or its GPU slot


def parse_lora_module(text: str) -> LoRAModulePath:
    """`name=path`, or vLLM's JSON form `{"name": .., "path": .., "base_model_name": .., "pinned": ..}`."""
    if text.lstrip().startswith("{"):
        try:
            data = json.loads(text)
            module = LoRAModulePath(str(data["name"]), str(data["path"]), data.get("base_model_name"),
                                    bool(data.get("pinned", False)))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise argparse.ArgumentTypeError(
                f"Invalid JSON format for --lora-modules: {text} ({e}); expected "
                '{"name": "...", "path": "...", "base_model_name": "...", "pinned": false}') from None
        return _checked(module)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(
            f"Invalid format for --lora-modules: {text}; expected 'name=path' or a JSON object.")
    return _checked(LoRAModulePath(name, path))


def _checked(module: LoRAModulePath) -> LoRAModulePath:
    problem = adapter_name_problem(module.name)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"Invalid --lora-modules name: {problem}")
    return module


def runtime_lora_updating_from_env() -> bool:
    """vLLM's switch for runtime adapter loading: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (or 1)."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class GatewayConfig:
    """The server's configuration: the worker's, held whole and handed to it, and the gateway's own fields. Each
    field a user sets declares its vLLM flag (worker/config_flags.py), so `loraplex serve` takes the flags of both."""
    worker: WorkerConfig
    # names clients use for the base model; empty: the model path is the name
    served_model_names: tuple[str, ...] = field(default=(), metadata=flag(
        "--served-model-name", nargs="+", help="names clients use for the base model; default: --model"))
    lora_modules: tuple[LoRAModulePath, ...] = field(default=(), metadata=flag(
        "--lora-modules", nargs="+", action="extend", type=parse_lora_module, metavar="MODULE",
        help="adapters loaded at startup: name=path, or JSON "
             '\'{"name": "..", "path": "..", "base_model_name": "..", "pinned": true}\''))
    # the load/unload routes, and auto-load from the worker's lora_dirs
    allow_runtime_lora_updating: bool = field(default=False, metadata=flag(
        "--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction,
        default_from=runtime_lora_updating_from_env,
        help="serve /v1/load_lora_adapter and /v1/unload_lora_adapter, and load an unknown model name found "
             "under --lora-dir on first use (default: $VLLM_ALLOW_RUNTIME_LORA_UPDATING, else off)"))
    # None: request_body.default_max_body_bytes
    max_request_body_bytes: int | None = field(default=None, metadata=flag(
        "--max-request-body-bytes", type=int,
        help="refuse larger request bodies with 413 (default: --max-model-len x 128 bytes, at least 1 MiB)"))
    # usage.prompt_tokens_details.cached_tokens, as vLLM's flag
    enable_prompt_tokens_details: bool = field(default=False, metadata=flag(
        "--enable-prompt-tokens-details", action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens, the prompt tokens found in the prefix cache"))
    # tool_choice "auto": the parser reads calls from the output
    enable_auto_tool_choice: bool = field(default=False, metadata=flag(
        "--enable-auto-tool-choice", action="store_true",
        help='let the model call tools by itself (tool_choice "auto"); needs --tool-call-parser'))
    # "hermes" (gateway/tool_calls.py)
    tool_call_parser: str | None = field(default=None, metadata=flag(
        "--tool-call-parser", choices=("hermes",),
        help="how tool calls are read from the model's output: hermes, the <tool_call>{json}</tool_call> blocks "
             "of Hermes and Qwen models"))
    max_logprobs: int = field(default=20, metadata=flag("--max-logprobs", type=int))
    host: str | None = field(default=None, metadata=flag("--host", help="default: all interfaces"))
    port: int = field(default=8000, metadata=flag("--port", type=int))
    api_key: str | None = field(default=None, metadata=flag(
        "--api-key", default_from=lambda: os.environ.get("VLLM_API_KEY"),
        help="require `Authorization: Bearer <key>` on /v1 (default: $VLLM_API_KEY)"))
    uvicorn_log_level: str = field(default="info", metadata=flag(
        "--uvicorn-log-level", choices=("critical", "error", "warning", "info", "debug", "trace")))
    # seconds requests in flight get after SIGTERM/SIGINT
    shutdown_timeout: int = field(default=30, metadata=flag(
        "--shutdown-timeout", type=int,
        help="seconds requests in flight may take to finish after SIGTERM or SIGINT; the rest then end "
             "with a 503 error (default 30; 0 ends them at once)"))

    @property
    def served_names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.worker.model.path,)

    @property
    def tokenizer_path(self) -> str:
        return self.worker.model.tokenizer or self.worker.model.path

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        """The configuration `add_flags(parser, GatewayConfig)` flags describe."""
        return config_from_flags(cls, args)
