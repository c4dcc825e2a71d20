"""--max-num-seqs and --max-num-batched-tokens left unset take vLLM 0.33.0's defaults for its OpenAI server
(vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults), by the device's facts."""
from __future__ import annotations

import argparse

import pytest

from worker.batch_defaults import GiB, DeviceFacts, batch_defaults, resolve_batch_limits
from worker.config import SchedulerConfig, WorkerConfig
from worker.config_flags import add_flags, config_from_flags

H200 = DeviceFacts("cuda", int(139.8 * GiB), "NVIDIA H200", (9, 0))
H100 = DeviceFacts("cuda", int(79.2 * GiB), "NVIDIA H100 80GB HBM3", (9, 0))
A100_80 = DeviceFacts("cuda", int(79.2 * GiB), "NVIDIA A100-SXM4-80GB", (8, 0))
GB10 = DeviceFacts("cuda", 119 * GiB, "NVIDIA GB10", (12, 1))
B200 = DeviceFacts("cuda", int(178.4 * GiB), "NVIDIA B200", (10, 0))
L4 = DeviceFacts("cuda", int(22.0 * GiB), "NVIDIA L4", (8, 9))
CPU = DeviceFacts("cpu")


@pytest.mark.parametrize("device, world_size, expected", [
    (B200, 1, (1024, 16384)), (H200, 1, (1024, 8192)), (H100, 1, (1024, 8192)), (A100_80, 1, (256, 2048)),
    (GB10, 1, (256, 2048)), (L4, 1, (256, 2048)), (H200, 2, (1024, 8192)), (CPU, 1, (128, 2048)),
    (CPU, 2, (256, 4096))])
def test_defaults_are_vllms_for_the_device(device, world_size, expected):
    assert batch_defaults(device, world_size) == expected


def test_only_unset_limits_take_the_default():
    assert resolve_batch_limits(SchedulerConfig(max_num_seqs=32), H200, 1, 4096) == SchedulerConfig(32, 8192)
    assert resolve_batch_limits(SchedulerConfig(max_num_batched_tokens=2048), H200, 1, 4096) == SchedulerConfig(1024, 2048)
    assert resolve_batch_limits(SchedulerConfig(8, 64), H200, 1, 4096) == SchedulerConfig(8, 64)


def test_a_defaulted_token_budget_is_capped_at_seqs_times_max_model_len():
    assert resolve_batch_limits(SchedulerConfig(max_num_seqs=2), H200, 1, 1024) == SchedulerConfig(2, 2048)
    assert resolve_batch_limits(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=4096), H200, 1, 1024) \
        == SchedulerConfig(2, 4096)


def test_a_defaulted_max_num_seqs_is_capped_at_the_token_budget():
    assert resolve_batch_limits(SchedulerConfig(max_num_batched_tokens=64), H200, 1, 4096) == SchedulerConfig(64, 64)
    assert resolve_batch_limits(SchedulerConfig(max_num_batched_tokens=24), CPU, 1, 256) == SchedulerConfig(24, 24)


def test_a_token_budget_below_the_sequences_given_is_refused_in_vllms_words():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) must be greater than or equal to "
                                         r"max_num_seqs \(128\)"):
        resolve_batch_limits(SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=64), H200, 1, 4096)


def parse(*argv: str) -> SchedulerConfig:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, WorkerConfig)
    return config_from_flags(WorkerConfig, parser.parse_args(["--model", "m", *argv])).scheduler


def test_flags_left_out_leave_the_limits_to_the_engine():
    assert parse() == SchedulerConfig(None, None)
    assert parse("--max-num-seqs", "48", "--max-num-batched-tokens", "1024") == SchedulerConfig(48, 1024)


@pytest.mark.parametrize("flag", ["--max-num-seqs", "--max-num-batched-tokens"])
def test_a_limit_below_one_is_refused(flag, capsys):
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        parse(flag, "0")


def test_the_engine_runs_with_the_cpu_defaults(hf_models):
    from tests.worker.test_engine import make_engine
    engine = make_engine(hf_models["llama"], max_model_len=64)
    assert (engine.config.scheduler.max_num_seqs, engine.config.scheduler.max_num_batched_tokens) == (128, 2048)
