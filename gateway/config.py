"""Frozen configuration of the gateway, and its translation into the worker's configuration."""
from __future__ import annotations

import argparse
import json
import os
import dataclasses
from dataclasses import dataclass, field

from gateway.served_models import adapter_name_problem
from worker.config import CacheConfig, KernelConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig


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


def parse_kernel_config(text: str) -> KernelConfig:
    """`--kernel-config`: a JSON object of KernelConfig fields (worker/config.py), the rest at their defaults, as
    vLLM takes `--compilation-config`: which kernels the GPU path uses, for A/B runs of a live server."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"Invalid JSON for --kernel-config: {text} ({e})") from None
    names = [f.name for f in dataclasses.fields(KernelConfig)]
    if not isinstance(data, dict) or not data:
        raise argparse.ArgumentTypeError(f"--kernel-config takes a non-empty JSON object of fields, got {text}")
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise argparse.ArgumentTypeError(f"Unknown --kernel-config field(s) {', '.join(unknown)}; the fields are "
                                         f"{', '.join(names)}")
    defaults = KernelConfig()
    for key, value in data.items():
        kind = type(getattr(defaults, key))
        if type(value) is not kind:
            raise argparse.ArgumentTypeError(f"--kernel-config field {key} takes a {kind.__name__}, got {value!r}")
    try:
        return KernelConfig(**data)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"Invalid --kernel-config: {e}") from None


def runtime_lora_updating_from_env() -> bool:
    """vLLM's switch for runtime adapter loading: VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (or 1)."""
    return os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class GatewayConfig:
    model: str                                     # model directory (config.json, weights, tokenizer)
    tokenizer: str | None = None                   # tokenizer directory; None: the model directory
    served_model_names: tuple[str, ...] = ()       # empty: the model path is the name
    lora_modules: tuple[LoRAModulePath, ...] = ()
    lora_dirs: tuple[str, ...] = ()                # where runtime loads may read; empty: anywhere
    allow_runtime_lora_updating: bool = False      # load/unload routes and auto-load from lora_dirs
    max_request_body_bytes: int | None = None      # None: request_body.default_max_body_bytes
    max_loras: int = LoRAConfig.max_loras
    max_cpu_loras: int | None = LoRAConfig.max_cpu_loras
    max_lora_rank: int = LoRAConfig.max_lora_rank
    enable_lora_overlap_loading: bool = LoRAConfig.enable_lora_overlap_loading
    lora_eviction_policy: str = LoRAConfig.lora_eviction_policy
    fully_sharded_loras: bool = LoRAConfig.fully_sharded_loras
    max_model_len: int | None = ModelConfig.max_model_len
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    block_size: int = CacheConfig.block_size
    gpu_memory_utilization: float = CacheConfig.gpu_memory_utilization
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    enable_prompt_tokens_details: bool = False     # usage.prompt_tokens_details.cached_tokens, as vLLM's flag
    enable_auto_tool_choice: bool = False          # tool_choice "auto": the parser reads calls from the output
    tool_call_parser: str | None = None            # "hermes" (gateway/tool_calls.py)
    max_logprobs: int = 20
    device: str = "auto"
    tensor_parallel_size: int = 1
    dtype: str = ModelConfig.dtype
    load_format: str = ModelConfig.load_format
    enforce_eager: bool = False
    async_scheduling: bool = True
    late_launch: bool = True                       # WorkerConfig.late_launch
    kernels: KernelConfig = field(default_factory=KernelConfig)   # --kernel-config
    seed: int = ModelConfig.seed
    host: str | None = None
    port: int = 8000
    api_key: str | None = None
    uvicorn_log_level: str = "info"
    shutdown_timeout: int = 30                     # seconds requests in flight get after SIGTERM/SIGINT

    @property
    def served_names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model,)

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(
            model=ModelConfig(path=self.model, dtype=self.dtype, load_format=self.load_format,
                              max_model_len=self.max_model_len, seed=self.seed, tokenizer=self.tokenizer_path),
            cache=CacheConfig(block_size=self.block_size, gpu_memory_utilization=self.gpu_memory_utilization,
                              enable_prefix_caching=self.enable_prefix_caching),
            lora=LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                            max_cpu_loras=self.max_cpu_loras,
                            enable_lora_overlap_loading=self.enable_lora_overlap_loading,
                            lora_eviction_policy=self.lora_eviction_policy, lora_dirs=self.lora_dirs,
                            fully_sharded_loras=self.fully_sharded_loras),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens),
            device=self.device, tensor_parallel_size=self.tensor_parallel_size,
            enforce_eager=self.enforce_eager, async_scheduling=self.async_scheduling, late_launch=self.late_launch,
            kernels=self.kernels,
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> GatewayConfig:
        return cls(
            model=args.model, tokenizer=args.tokenizer,
            served_model_names=tuple(args.served_model_name or ()),
            lora_modules=tuple(args.lora_modules or ()), lora_dirs=tuple(args.lora_dir or ()),
            allow_runtime_lora_updating=args.allow_runtime_lora_updating,
            max_request_body_bytes=args.max_request_body_bytes,
            max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras, max_lora_rank=args.max_lora_rank,
            enable_lora_overlap_loading=args.enable_lora_overlap_loading,
            lora_eviction_policy=args.lora_eviction_policy, fully_sharded_loras=args.fully_sharded_loras,
            max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
            gpu_memory_utilization=args.gpu_memory_utilization, max_logprobs=args.max_logprobs,
            enable_prefix_caching=args.enable_prefix_caching,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            enable_auto_tool_choice=args.enable_auto_tool_choice, tool_call_parser=args.tool_call_parser,
            device=args.device, tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype, load_format=args.load_format,
            enforce_eager=args.enforce_eager, async_scheduling=args.async_scheduling, late_launch=args.late_launch,
            kernels=args.kernel_config or KernelConfig(), seed=args.seed,
            host=args.host, port=args.port,
            api_key=args.api_key, uvicorn_log_level=args.uvicorn_log_level,
            shutdown_timeout=args.shutdown_timeout,
        )
