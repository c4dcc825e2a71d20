"""Host cache sizing: entries of a slot's bytes against half the host's available memory, on every rank."""
from __future__ import annotations

import pytest

from worker.lora.host_cache_plan import (HOST_CACHE_FRACTION, GiB, HostCachePlanError, MiB, available_host_bytes,
                                         host_cache_capacity)

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
    # 1,000 adapters in 80 MiB slots on a host with 120 GiB available: killed by the host, were it not refused
    with pytest.raises(HostCachePlanError) as e:
        host_cache_capacity(1000, SLOT, 1, 120 * GiB, 16)
    message = str(e.value)
    for part in ("--max-cpu-loras 1000", "80.0 MiB", "--max-lora-rank 16", "78.12 GiB", "120.00 GiB",
                 "60.00 GiB", "(768 adapters)", "Lower --max-cpu-loras or --max-lora-rank"):
        assert part in message, (part, message)
    assert host_cache_capacity(768, SLOT, 1, 120 * GiB, 16) == 768             # the most that fits is accepted
    with pytest.raises(HostCachePlanError, match="on 2 ranks"):
        host_cache_capacity(768, SLOT, 2, 120 * GiB, 16)


def test_host_cache_that_cannot_hold_one_adapter_fails_without_a_bound_too():
    with pytest.raises(HostCachePlanError, match="cannot hold 1 adapter: each takes 2048.0 MiB"):
        host_cache_capacity(None, 2 * GiB, 1, 3 * GiB, 64)


def test_available_host_bytes_reads_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:  1000 kB\nMemAvailable:   120000000 kB\n")
    assert available_host_bytes(str(meminfo)) == 120000000 * 1024
    meminfo.write_text("MemTotal:       131072000 kB\n")
    assert available_host_bytes(str(meminfo)) is None
    assert available_host_bytes(str(tmp_path / "missing")) is None
