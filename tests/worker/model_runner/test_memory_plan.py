"""The memory plan's arithmetic: what is left for the KV pool, and the error that names the flags."""
from __future__ import annotations

import pytest

from worker.model_runner.memory_plan import (HOST_CACHE_FRACTION, NON_TORCH_CAP_BYTES, GiB, MemoryLimits, MemoryPlanError,
                                             MiB, available_host_bytes, host_cache_capacity, plan_memory)
from worker.model_runner.runner import profile_lengths

LIMITS = MemoryLimits(gpu_memory_utilization=0.9, max_model_len=8192, max_num_seqs=256,
                      max_num_batched_tokens=2048, max_loras=4)
PER_TOKEN = 128 << 10        # an 8B model's K/V bytes per token (bf16)


def plan(**changes):
    args = dict(total=80 * GiB, free_at_start=79 * GiB, free_now=61 * GiB, torch_reserved=17 * GiB,
                weights=16 * GiB, lora_slots=GiB // 2, moe_buffers=GiB // 2, activations=2 * GiB, graphs=GiB,
                kv_bytes_per_token=PER_TOKEN, limits=LIMITS)
    return plan_memory(**(args | changes))


def test_kv_gets_the_budget_left_after_everything_this_process_needs():
    p = plan()
    # budget 72 GiB; the process took 18 GiB since the start (17 in torch, 1 outside), then 2 + 1 GiB reserved
    assert p.budget == int(80 * GiB * 0.9)
    assert p.non_torch == GiB
    assert p.kv == p.budget - 18 * GiB - 2 * GiB - GiB
    assert p.used == p.weights + p.lora_slots + p.moe_buffers + p.activations + p.graphs + p.non_torch + p.kv
    assert "KV cache 51.00" in p.summary()


def test_memory_held_by_other_processes_is_not_charged_to_this_one():
    # another server holds 32 GiB: free at the start is 47 GiB; at 0.4 this one still gets 0.4 of the device
    limits = MemoryLimits(0.4, 8192, 256, 2048, 4)
    p = plan(free_at_start=47 * GiB, free_now=29 * GiB, limits=limits)
    assert p.kv == int(80 * GiB * 0.4) - 18 * GiB - 3 * GiB


def test_another_process_allocating_during_startup_is_not_counted_as_ours():
    # the free memory drops by 30 GiB while this process's allocator took 17: past the cap, not ours
    p = plan(free_now=49 * GiB, limits=MemoryLimits(0.4, 8192, 256, 2048, 4))
    assert p.non_torch == NON_TORCH_CAP_BYTES
    assert p.kv == int(80 * GiB * 0.4) - 17 * GiB - NON_TORCH_CAP_BYTES - 3 * GiB


def test_kv_never_exceeds_what_the_device_has_free():
    # a budget larger than what is free (another process holds memory): the free memory bounds the pool
    p = plan(free_at_start=40 * GiB, free_now=22 * GiB)
    assert p.kv == 22 * GiB - 2 * GiB - GiB


@pytest.mark.parametrize("changes, named", [
    ({"activations": 53 * GiB}, "--max-num-batched-tokens (2048"),
    ({"graphs": 53 * GiB}, "--max-num-seqs (256"),
    ({"free_now": 3 * GiB}, "--gpu-memory-utilization (now 0.9)"),
])
def test_flags_that_cannot_fit_fail_naming_the_flags(changes, named):
    with pytest.raises(MemoryPlanError) as e:
        plan(**changes)
    assert named in str(e.value) and "--max-model-len 8192" in str(e.value)


def test_one_max_length_sequence_is_the_least_the_pool_may_hold():
    need = PER_TOKEN * LIMITS.max_model_len
    left = 72 * GiB - 18 * GiB - GiB          # with no activations reserved
    assert plan(activations=left - need).kv == need
    with pytest.raises(MemoryPlanError):
        plan(activations=left - need + 1)


@pytest.mark.parametrize("tokens, max_seqs, max_model_len, lens", [
    (10, 4, 5, [5, 3, 1, 1]),            # the running example
    (2048, 256, 4096, [1793] + [1] * 255),
    (4096, 8, 1024, [1024] * 3 + [1020] + [1] * 4),   # none past max_model_len (the block tables' width)
    (3, 8, 100, [1, 1, 1]),
])
def test_the_profiling_step_fills_the_token_budget_within_max_model_len(tokens, max_seqs, max_model_len, lens):
    assert profile_lengths(tokens, max_seqs, max_model_len) == lens


SLOT = 80 * MiB            # an 8B slot: rank 16 on all seven projections


def test_host_cache_holds_the_adapters_asked_for_when_they_fit():
    assert host_cache_capacity(100, SLOT, 1, 100 * GiB, 16) == 100       # 7.8 GiB of the 50 allowed


@pytest.mark.parametrize("max_cpu_loras", [None, 3])
def test_host_cache_is_taken_as_asked_where_the_host_memory_is_unknown(max_cpu_loras):
    assert host_cache_capacity(max_cpu_loras, SLOT, 1, None, 16) == max_cpu_loras


def test_host_cache_without_a_bound_holds_what_half_the_available_memory_fits_on_every_rank():
    assert HOST_CACHE_FRACTION == 0.5
    assert host_cache_capacity(None, SLOT, 1, 100 * GiB, 16) == 640            # 50 GiB / 80 MiB
    assert host_cache_capacity(None, SLOT, 2, 100 * GiB, 16) == 320            # each rank keeps its shard
    assert host_cache_capacity(None, SLOT, 1, 100 * GiB + SLOT, 16) == 640     # whole entries only


def test_host_cache_that_cannot_fit_fails_naming_the_flags_with_the_figures():
    # a 1,000-adapter H100 server with 80 MiB slots on a 128 GiB host: killed by the host before this check
    with pytest.raises(MemoryPlanError) as e:
        host_cache_capacity(1000, SLOT, 1, 120 * GiB, 16)
    message = str(e.value)
    for part in ("--max-cpu-loras 1000", "80.0 MiB", "--max-lora-rank 16", "78.12 GiB", "120.00 GiB",
                 "60.00 GiB", "(768 adapters)", "Lower --max-cpu-loras or --max-lora-rank"):
        assert part in message, (part, message)
    assert host_cache_capacity(768, SLOT, 1, 120 * GiB, 16) == 768             # the most that fits is accepted
    with pytest.raises(MemoryPlanError, match="on 2 ranks"):
        host_cache_capacity(768, SLOT, 2, 120 * GiB, 16)


def test_host_cache_that_cannot_hold_one_adapter_fails_without_a_bound_too():
    with pytest.raises(MemoryPlanError, match="cannot hold 1 adapter: each takes 2048.0 MiB"):
        host_cache_capacity(None, 2 * GiB, 1, 3 * GiB, 64)


def test_available_host_bytes_reads_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:  1000 kB\nMemAvailable:   120000000 kB\n")
    assert available_host_bytes(str(meminfo)) == 120000000 * 1024
    meminfo.write_text("MemTotal:       131072000 kB\n")
    assert available_host_bytes(str(meminfo)) is None
    assert available_host_bytes(str(tmp_path / "missing")) is None
