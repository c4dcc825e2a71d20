"""Request decoding and validation, the error envelope, and the vLLM command line."""
import argparse
import json
import subprocess
import sys

import pytest

from gateway.__main__ import build_parser
from gateway.config import GatewayConfig, LoRAModulePath, parse_lora_module
from gateway.protocol import (APIError, ChatCompletionRequest, CompletionRequest, check_token_ids, decode_body,
                              resolve_max_tokens)
from worker.config import CacheConfig, KernelConfig, LoRAConfig, SchedulerConfig
from worker.ipc.messages import SamplingParams


def completion(**fields) -> CompletionRequest:
    return decode_body(json.dumps({"prompt": "hi", **fields}).encode(), CompletionRequest)


def test_error_envelope_has_vllm_shape():
    error = APIError("The model `x` does not exist.", 404, param="model")
    assert error.body() == {"error": {"message": "The model `x` does not exist.", "type": "NotFoundError",
                                      "param": "model", "code": 404}}


@pytest.mark.parametrize("prompt, expected", [
    ("hi", ["hi"]),
    (["a", "b"], ["a", "b"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompt_inputs() == expected


@pytest.mark.parametrize("prompt", [[1, [2]], [True], [["a"]], [1.5]])
def test_mixed_prompt_is_400(prompt):
    with pytest.raises(APIError, match="prompt must be a string") as caught:
        completion(prompt=prompt).prompt_inputs()
    assert caught.value.param == "prompt"


def test_defaults_map_to_vllm_sampling_params():
    params = completion().sampling_params(16, None, None, 0)
    assert params == SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
                                    repetition_penalty=1.0, seed=None, stop_token_ids=[])


def test_explicit_fields_map_through():
    request = completion(temperature=0.5, top_p=0.9, top_k=-1, min_p=0.1, seed=5, presence_penalty=0.3,
                         frequency_penalty=-0.2, repetition_penalty=1.1, stop_token_ids=[4, 4, 9],
                         ignore_eos=True, min_tokens=2)
    params = request.sampling_params(8, 3, 1, 2)
    assert params == SamplingParams(max_tokens=8, min_tokens=2, temperature=0.5, top_p=0.9, top_k=0, min_p=0.1,
                                    seed=7, presence_penalty=0.3, frequency_penalty=-0.2, repetition_penalty=1.1,
                                    stop_token_ids=[4, 9], ignore_eos=True, logprobs=3, prompt_logprobs=1)


@pytest.mark.parametrize("fields, param, message", [
    ({"n": 0}, "n", "n must be at least 1, got 0."),
    ({"presence_penalty": 3}, "presence_penalty", "presence_penalty must be in [-2, 2], got 3.0."),
    ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in [-2, 2], got -3.0."),
    ({"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be greater than zero, got 0.0."),
    ({"temperature": 2.5}, "temperature", "temperature must be in [0, 2], got 2.5."),
    ({"top_k": -2}, "top_k", "top_k must be 0 (disable), or at least 1, got -2."),
    ({"min_p": 1.5}, "min_p", "min_p must be in [0, 1], got 1.5."),
    ({"min_tokens": -1}, "min_tokens", "min_tokens must be greater than or equal to 0, got -1."),
    ({"seed": 2 ** 63}, "seed", f"seed must be a 64-bit integer, got {2 ** 63}."),
    ({"prompt_logprobs": 21}, "prompt_logprobs",
     "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
])
def test_sampling_checks_use_vllm_messages(fields, param, message):
    with pytest.raises(APIError) as caught:
        request = completion(**fields)
        request.validate_sampling(20, request.logprobs)
    assert (caught.value.message, caught.value.param, caught.value.status) == (message, param, 400)


@pytest.mark.parametrize("fields, param, message", [
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt_logprobs": -2}, "prompt_logprobs", "`prompt_logprobs` must be a positive value or -1."),
    ({"stream_options": {}, "stream": False, "n": "x"}, "n", "Expected `int | null`, got `str`"),
])
def test_raw_checks_run_before_field_validation(fields, param, message):
    with pytest.raises(APIError) as caught:
        completion(**fields)
    assert caught.value.message.startswith(message) and caught.value.param == param


def test_chat_output_budget_prefers_max_completion_tokens():
    request = decode_body(b'{"messages": [], "max_tokens": 5, "max_completion_tokens": 7}', ChatCompletionRequest)
    assert request.max_output_tokens == (7, "max_completion_tokens")
    assert decode_body(b'{"messages": [], "max_tokens": 5}', ChatCompletionRequest).max_output_tokens == \
        (5, "max_tokens")


@pytest.mark.parametrize("requested, prompt_len, expected", [(None, 10, 90), (90, 10, 90), (1, 99, 1)])
def test_output_budget_fits_the_context(requested, prompt_len, expected):
    assert resolve_max_tokens(requested, prompt_len, 100) == expected


@pytest.mark.parametrize("requested, prompt_len, message", [
    (None, 100, "This model's maximum context length is 100 tokens. However, your request has 100 input tokens. "
                "Please reduce the length of the input messages."),
    (91, 10, "'max_tokens' or 'max_completion_tokens' is too large: 91. This model's maximum context length is "
             "100 tokens and your request has 10 input tokens (91 > 100 - 10)."),
    (0, 10, "max_tokens must be at least 1, got 0."),
])
def test_output_budget_errors(requested, prompt_len, message):
    with pytest.raises(APIError) as caught:
        resolve_max_tokens(requested, prompt_len, 100)
    assert caught.value.message == message


@pytest.mark.parametrize("ids, message", [([], "The decoder prompt cannot be empty"),
                                          ([0, 50], "Token id 50 is out of vocabulary"),
                                          ([-3], "Token id -3 is out of vocabulary")])
def test_token_ids_are_checked(ids, message):
    with pytest.raises(APIError, match=message):
        check_token_ids(ids, 50)


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
        model="/m", served_model_names=("a", "b"), lora_modules=(LoRAModulePath("x", "/x"), LoRAModulePath("y", "/y")),
        lora_dirs=("/l1", "/l2"), max_loras=8, max_cpu_loras=32, max_lora_rank=64, max_model_len=4096,
        max_num_seqs=128, max_num_batched_tokens=8192, block_size=32, gpu_memory_utilization=0.8, device="cpu",
        dtype="bfloat16", load_format="dummy", enforce_eager=True, async_scheduling=False, seed=3, host="0.0.0.0",
        port=9000, api_key="k", uvicorn_log_level="warning", shutdown_timeout=7)
    worker = config.worker_config()
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
    worker = config.worker_config()
    assert (worker.lora, worker.scheduler, worker.cache) == (LoRAConfig(), SchedulerConfig(), CacheConfig())
    assert worker.async_scheduling and not worker.enforce_eager


@pytest.mark.parametrize("flags, late_launch", [([], True), (["--late-launch"], True), (["--no-late-launch"], False)])
def test_late_launch_flag_reaches_the_worker(flags, late_launch):
    config = GatewayConfig.from_args(build_parser().parse_args(["serve", "--model", "/m", *flags]))
    assert config.late_launch is late_launch and config.worker_config().late_launch is late_launch


def test_kernel_config_flag_sets_the_named_fields_and_keeps_the_rest():
    config = GatewayConfig.from_args(build_parser().parse_args(
        ["serve", "--model", "/m", "--kernel-config", '{"lora_backend": "reference", "skinny_row_limit": 16}']))
    kernels = config.worker_config().kernels
    assert kernels.lora_backend == "reference" and kernels.skinny_row_limit == 16
    assert kernels.lora_side_stream == KernelConfig().lora_side_stream
    assert GatewayConfig.from_args(build_parser().parse_args(["serve", "--model", "/m"])).worker_config().kernels \
        == KernelConfig()


@pytest.mark.parametrize("value, message", [
    ("{nope", "Invalid JSON for --kernel-config"),
    ('{"lora_side_streams": false}', "Unknown --kernel-config field(s) lora_side_streams"),
    ('{"skinny_row_limit": "16"}', "skinny_row_limit takes a int"),
    ('{"lora_side_stream": 1}', "lora_side_stream takes a bool"),
    ('{"all_reduce_kernel": "nccl"}', "all_reduce_kernel must be 'symm_mem' or 'triton'"),
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
    assert (config.model, config.served_names, config.port) == ("/c/model", ("loraplex-demo",), 9001)
    assert config.lora_modules == (LoRAModulePath("a", "/c/adapters/a"), LoRAModulePath("b", "/c/adapters/b"),
                                   LoRAModulePath("extra", "/x"))
