"""The vLLM command line: flags generated from GatewayConfig's and WorkerConfig's fields, and the configuration
they build."""
import argparse
import json
import subprocess
import sys

import pytest

from gateway.__main__ import build_parser
from gateway.config import GatewayConfig, LoRAModulePath, parse_lora_module
from worker.config import CacheConfig, KernelConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig


@pytest.mark.parametrize("text, expected", [
    ("sql=/a/sql", LoRAModulePath("sql", "/a/sql")),
    ('{"name": "sql", "path": "/a/sql", "base_model_name": "base", "pinned": true}',
     LoRAModulePath("sql", "/a/sql", "base", True)),
    ('{"name": "sql", "path": "/a/sql"}', LoRAModulePath("sql", "/a/sql")),
])
def test_lora_modules_forms(text, expected):
    assert parse_lora_module(text) == expected


@pytest.mark.parametrize("text", ["sql", "=/a", '{"name": "x"}', "{bad json"])
def test_bad_lora_module_is_rejected(text):
    with pytest.raises(argparse.ArgumentTypeError, match="--lora-modules"):
        parse_lora_module(text)


def test_serve_accepts_vllm_flags():
    args = build_parser().parse_args([
        "serve", "--model", "/m", "--served-model-name", "a", "b", "--lora-modules", "x=/x", "y=/y",
        "--max-loras", "8", "--max-cpu-loras", "32", "--max-lora-rank", "64", "--max-model-len", "4096",
        "--max-num-seqs", "128", "--max-num-batched-tokens", "8192", "--host", "0.0.0.0", "--port", "9000",
        "--api-key", "k", "--device", "cpu", "--dtype", "bfloat16", "--load-format", "dummy", "--enforce-eager",
        "--seed", "3", "--lora-dir", "/l1", "--lora-dir", "/l2", "--uvicorn-log-level", "warning",
        "--block-size", "32", "--gpu-memory-utilization", "0.8", "--enable-lora", "--no-async-scheduling",
        "--shutdown-timeout", "7"])
    config = GatewayConfig.from_args(args)
    assert config == GatewayConfig(
        WorkerConfig(ModelConfig("/m", dtype="bfloat16", load_format="dummy", max_model_len=4096, seed=3),
                     cache=CacheConfig(block_size=32, gpu_memory_utilization=0.8),
                     lora=LoRAConfig(max_loras=8, max_cpu_loras=32, max_lora_rank=64, lora_dirs=("/l1", "/l2")),
                     scheduler=SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=8192),
                     device="cpu", enforce_eager=True, async_scheduling=False),
        served_model_names=("a", "b"), lora_modules=(LoRAModulePath("x", "/x"), LoRAModulePath("y", "/y")),
        host="0.0.0.0", port=9000, api_key="k", uvicorn_log_level="warning", shutdown_timeout=7)
    worker = config.worker
    assert (worker.model.path, worker.model.dtype, worker.model.load_format, worker.model.max_model_len) == \
        ("/m", "bfloat16", "dummy", 4096)
    assert (worker.lora.max_loras, worker.lora.max_cpu_loras, worker.lora.max_lora_rank) == (8, 32, 64)
    assert (worker.scheduler.max_num_seqs, worker.scheduler.max_num_batched_tokens) == (128, 8192)
    assert (worker.cache.block_size, worker.cache.gpu_memory_utilization, worker.device) == (32, 0.8, "cpu")
    assert (worker.enforce_eager, worker.async_scheduling) == (True, False)


def test_serve_defaults_name_the_model_by_its_path(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    args = build_parser().parse_args(["serve", "--model", "/m"])
    config = GatewayConfig.from_args(args)
    assert config.served_names == ("/m",) and config.tokenizer_path == "/m" and config.api_key is None
    worker = config.worker
    assert (worker.lora, worker.scheduler, worker.cache) == (LoRAConfig(), SchedulerConfig(), CacheConfig())
    assert worker.async_scheduling and not worker.enforce_eager


@pytest.mark.parametrize("flags, late_launch", [([], True), (["--late-launch"], True), (["--no-late-launch"], False)])
def test_late_launch_flag_reaches_the_worker(flags, late_launch):
    config = GatewayConfig.from_args(build_parser().parse_args(["serve", "--model", "/m", *flags]))
    assert config.worker.late_launch is late_launch


def test_kernel_config_flag_sets_the_named_fields_and_keeps_the_rest():
    config = GatewayConfig.from_args(build_parser().parse_args(
        ["serve", "--model", "/m", "--kernel-config", '{"lora_side_stream": false, "skinny_row_limit": 16}']))
    kernels = config.worker.kernels
    assert kernels.lora_side_stream is False and kernels.skinny_row_limit == 16
    assert kernels.programmatic_launch == KernelConfig().programmatic_launch
    assert GatewayConfig.from_args(build_parser().parse_args(["serve", "--model", "/m"])).worker.kernels \
        == KernelConfig()


@pytest.mark.parametrize("value, message", [
    ("{nope", "Invalid JSON for --kernel-config"),
    ('{"lora_side_streams": false}', "Unknown --kernel-config field(s) lora_side_streams"),
    ('{"skinny_row_limit": "16"}', "skinny_row_limit takes a int"),
    ('{"lora_side_stream": 1}', "lora_side_stream takes a bool"),
    ('{"one_shot_all_reduce_bytes": -1}', "Invalid --kernel-config: one_shot_all_reduce_bytes must be >= 0"),
    ("[]", "non-empty JSON object")])
def test_kernel_config_flag_refuses_bad_json_with_the_reason(capsys, value, message):
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["serve", "--model", "/m", "--kernel-config", value])
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_flag_value_exits_with_usage_error():
    with pytest.raises(SystemExit) as caught:
        build_parser().parse_args(["serve", "--model", "/m", "--lora-modules", "nonsense"])
    assert caught.value.code == 2


def test_python_m_gateway_has_the_serve_command():
    done = subprocess.run([sys.executable, "-m", "gateway", "serve", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--lora-modules" in done.stdout and "--served-model-name" in done.stdout


def test_demo_serves_the_assets_worker_demo_reports(monkeypatch):
    import gateway.__main__ as cli
    assets = {"model_dir": "/c/model", "served_model_name": "loraplex-demo",
              "adapters": {"a": "/c/adapters/a", "b": "/c/adapters/b"}}
    commands, served = [], []

    def run(command, **kwargs):
        commands.append(command)
        return subprocess.CompletedProcess(command, 0, stdout="building...\n" + json.dumps(assets) + "\n")

    monkeypatch.setattr(cli.subprocess, "run", run)
    monkeypatch.setattr(cli, "serve", served.append)
    cli.main(["demo", "--cache-dir", "/c", "--port", "9001", "--lora-modules", "extra=/x"])
    assert commands == [[sys.executable, "-m", "worker.demo", "--cache-dir", "/c"]]
    config = served[0]
    assert (config.worker.model.path, config.served_names, config.port) == ("/c/model", ("loraplex-demo",), 9001)
    assert config.lora_modules == (LoRAModulePath("a", "/c/adapters/a"), LoRAModulePath("b", "/c/adapters/b"),
                                   LoRAModulePath("extra", "/x"))


SERVE_FLAGS = {
    "--model", "--tokenizer", "--served-model-name", "--lora-modules", "--lora-dir", "--allow-runtime-lora-updating",
    "--no-allow-runtime-lora-updating", "--enable-lora", "--max-loras", "--max-cpu-loras", "--max-lora-rank",
    "--enable-lora-overlap-loading", "--no-enable-lora-overlap-loading", "--lora-eviction-policy",
    "--fully-sharded-loras", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens", "--max-logprobs",
    "--block-size", "--gpu-memory-utilization", "--num-gpu-blocks-override", "--enable-prefix-caching", "--no-enable-prefix-caching",
    "--enable-prompt-tokens-details", "--enable-auto-tool-choice", "--tool-call-parser", "--device",
    "--tensor-parallel-size", "-tp", "--dtype", "--load-format", "--quantization", "-q", "--kv-cache-dtype",
    "--structured-outputs-config", "--enforce-eager", "--async-scheduling",
    "--no-async-scheduling", "--late-launch", "--no-late-launch", "--kernel-config", "--kv-events-config", "--seed",
    "--host", "--port",
    "--api-key", "--max-request-body-bytes", "--shutdown-timeout", "--uvicorn-log-level", "-h", "--help"}


def _options(command: str) -> set[str]:
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {option for action in subparsers.choices[command]._actions for option in action.option_strings}


def test_serve_and_demo_take_vllm_flags_generated_from_the_config_fields():
    assert _options("serve") == SERVE_FLAGS
    assert _options("demo") == SERVE_FLAGS - {"--model"} | {"--cache-dir"}     # the demo builds its own model


def test_the_gateway_and_worker_flags_not_set_above_reach_their_fields():
    config = GatewayConfig.from_args(build_parser().parse_args([
        "serve", "--model", "/m", "--tokenizer", "/t", "-tp", "2", "--fully-sharded-loras",
        "--max-request-body-bytes", "4096", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--max-logprobs", "5", "--enable-prompt-tokens-details", "--no-allow-runtime-lora-updating"]))
    assert (config.worker.model.tokenizer, config.tokenizer_path, config.worker.tensor_parallel_size) == ("/t", "/t", 2)
    assert config.worker.lora.fully_sharded_loras and config.max_request_body_bytes == 4096
    assert (config.enable_auto_tool_choice, config.tool_call_parser, config.max_logprobs) == (True, "hermes", 5)
    assert config.enable_prompt_tokens_details and not config.allow_runtime_lora_updating


@pytest.mark.parametrize("value", ["0", "-1"])
def test_tensor_parallel_size_must_be_positive(capsys, value):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "/m", "-tp", value])
    assert f"must be at least 1, got {value}" in capsys.readouterr().err


def test_num_gpu_blocks_override_fixes_the_kv_pool_as_vllm_s_flag_does():
    args = build_parser().parse_args(["serve", "--model", "/m", "--num-gpu-blocks-override", "64"])
    assert GatewayConfig.from_args(args).worker.cache.num_gpu_blocks_override == 64
    assert GatewayConfig.from_args(build_parser().parse_args(["serve", "--model", "/m"])).worker.cache \
        .num_gpu_blocks_override is None
