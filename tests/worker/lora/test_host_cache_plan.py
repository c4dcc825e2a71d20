"""Host cache sizing: entries of a slot's bytes against half the host's available memory, on every rank."""
from __future__ import annotations

import pytest

from worker.lora.host_cache_plan import (HOST_CACHE_FRACTION, GiB, HostCachePlanError, MiB, available_host_bytes,
                                         host_cache_capacity)

SLOT = 80 * MiB            # an 8B slot: rank 16 on all seven projections, the largest entry there


def test_host_cache_is_bounded_by_half_the_available_memory_in_bytes_and_by_max_cpu_loras_in_entries():
    assert HOST_CACHE_FRACTION == 0.5
    assert host_cache_capacity(100, SLOT, 1, 100 * GiB, 16) == (100, 50 * GiB)
    assert host_cache_capacity(None, SLOT, 1, 100 * GiB, 16) == (None, 50 * GiB)
    assert host_cache_capacity(None, SLOT, 2, 100 * GiB, 16) == (None, 25 * GiB)     # each rank keeps its shard
    # more entries than slot-sized ones fit: entries take their own size, the byte bound evicts
    assert host_cache_capacity(1000, SLOT, 1, 120 * GiB, 16) == (1000, 60 * GiB)


@pytest.mark.parametrize("max_cpu_loras", [None, 3])
def test_host_cache_is_taken_as_asked_where_the_host_memory_is_unknown(max_cpu_loras):
    assert host_cache_capacity(max_cpu_loras, SLOT, 1, None, 16) == (max_cpu_loras, None)


def test_host_cache_that_cannot_hold_the_largest_adapter_fails_naming_the_flag_with_the_figures():
    with pytest.raises(HostCachePlanError) as e:
        host_cache_capacity(None, 2 * GiB, 1, 3 * GiB, 64)
    message = str(e.value)
    for part in ("cannot hold 1 adapter", "2048.0 MiB", "--max-lora-rank 64", "3.00 GiB", "1.50 GiB",
                 "Lower --max-lora-rank"):
        assert part in message, (part, message)
    with pytest.raises(HostCachePlanError, match="on each of 2 ranks"):
        host_cache_capacity(None, 2 * GiB, 2, 5 * GiB, 64)
    assert host_cache_capacity(None, 2 * GiB, 1, 4 * GiB, 64) == (None, 2 * GiB)       # exactly one fits


def test_available_host_bytes_reads_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemFree:  1000 kB\nMemAvailable:   120000000 kB\n")
    assert available_host_bytes(str(meminfo)) == 120000000 * 1024
    meminfo.write_text("MemTotal:       131072000 kB\n")
    assert available_host_bytes(str(meminfo)) is None
    assert available_host_bytes(str(tmp_path / "missing")) is None
