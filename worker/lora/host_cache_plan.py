"""How much the host cache (lora/host_cache.py) may hold, planned at startup on every rank.

Entries are adapters at their own size (their rank, the projections they adapt; SlotLayout.entry_layout), so the
host cache is bounded in bytes: up to HOST_CACHE_FRACTION of the host's available memory, shared by the
tensor-parallel ranks of the host, and, with --max-cpu-loras, in entries too. The largest entry an adapter can
need is one GPU slot (--max-lora-rank on every projection that takes LoRA); a host that cannot hold one is refused
at startup. Pure Python: the scheduler's bookkeeping may import it.
"""
from __future__ import annotations

import logging

from worker.config import LoRAConfig

logger = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20
# the most of the host's available memory (MemAvailable at startup) the adapters in host memory may take, on all
# ranks together: page-locked pages cannot be swapped or reclaimed, and the process, its readers and the page cache
# (adapter files, the checkpoint) need the rest
HOST_CACHE_FRACTION = 0.5


class HostCachePlanError(ValueError):
    """The host cannot hold the adapters the flags ask for; the message names what to change."""


def available_host_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The host's available memory (Linux's MemAvailable), or None where it cannot be read."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def plan_host_cache(lora: LoRAConfig, slot_bytes: int, ranks: int) -> tuple[int | None, int | None]:
    """host_cache_capacity for `lora`'s flags against the host's available memory now (every rank calls it)."""
    return host_cache_capacity(lora.max_cpu_loras, slot_bytes, ranks, available_host_bytes(), lora.max_lora_rank)


def host_cache_capacity(max_cpu_loras: int | None, slot_bytes: int, ranks: int, available: int | None,
                        max_lora_rank: int) -> tuple[int | None, int | None]:
    """(entries, bytes) the host cache of one rank may hold: `max_cpu_loras` entries (None: no count) within
    HOST_CACHE_FRACTION of `available` (the host's available memory; None: unknown, no byte bound) shared by the
    `ranks` ranks of the host; `slot_bytes` is one rank's slot, the largest entry.

    Raises HostCachePlanError, naming --max-lora-rank, when a single slot-sized entry does not fit: a server that
    page-locked more than the host has would be killed by the host, not refused."""
    if available is None:
        return max_cpu_loras, None
    budget = int(available * HOST_CACHE_FRACTION) // ranks
    if slot_bytes > budget:
        raise HostCachePlanError(
            f"The host cache cannot hold 1 adapter: the largest takes {slot_bytes / MiB:.1f} MiB of host memory "
            f"(its GPU slot's layout: every projection that takes LoRA at --max-lora-rank {max_lora_rank}"
            f"{f', on each of {ranks} ranks' if ranks > 1 else ''}), and {HOST_CACHE_FRACTION:.0%} of the host's "
            f"{available / GiB:.2f} GiB available is {budget * ranks / GiB:.2f} GiB. Lower --max-lora-rank.")
    logger.info("host cache: %s within %.2f GiB (%.0f%% of the %.2f GiB of host memory available%s); an adapter "
                "takes its own size, at most %.1f MiB", f"up to {max_cpu_loras} adapters" if max_cpu_loras
                else "adapters", budget / GiB, 100 * HOST_CACHE_FRACTION, available / GiB,
                f", over {ranks} ranks" if ranks > 1 else "", slot_bytes / MiB)
    return max_cpu_loras, budget
