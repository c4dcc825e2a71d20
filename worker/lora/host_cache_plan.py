"""How many adapters the host cache (lora/host_cache.py) may hold, planned at startup on every rank.

Every entry is one adapter in its GPU slot's layout (padded to --max-lora-rank and to every projection that takes
LoRA), so `host_cache_capacity` counts entries of the slot's size against the host's available memory, on every
tensor-parallel rank of the host. Pure Python: the scheduler's bookkeeping may import it.
"""
from __future__ import annotations

import logging

from worker.config import LoRAConfig

logger = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20
# the most of the host's available memory (MemAvailable at startup) the adapters in host memory may take, on all
# ranks together: pinned pages cannot be swapped or reclaimed, and the process, its readers and the page cache
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


def plan_host_cache(lora: LoRAConfig, entry_bytes: int, ranks: int) -> int | None:
    """host_cache_capacity for `lora`'s flags against the host's available memory now (every rank calls it)."""
    return host_cache_capacity(lora.max_cpu_loras, entry_bytes, ranks, available_host_bytes(), lora.max_lora_rank)


def host_cache_capacity(max_cpu_loras: int | None, entry_bytes: int, ranks: int, available: int | None,
                        max_lora_rank: int) -> int | None:
    """How many adapters the host cache holds: `max_cpu_loras` when given, else as many as fit; `entry_bytes`
    is one rank's slot (an entry of each of `ranks` ranks on this host), `available` the host's available memory
    (None: unknown, `max_cpu_loras` taken as given). Up to HOST_CACHE_FRACTION of `available` may hold entries.

    Raises HostCachePlanError, naming --max-cpu-loras and --max-lora-rank, when `max_cpu_loras` entries, or a single
    one, do not fit: a server that pinned more than the host has would be killed by the host, not refused."""
    if available is None:
        return max_cpu_loras
    per_entry = entry_bytes * ranks
    budget = int(available * HOST_CACHE_FRACTION)
    fits = budget // per_entry if per_entry else max_cpu_loras
    wanted = max_cpu_loras if max_cpu_loras is not None else 1
    if per_entry and wanted > fits:
        raise HostCachePlanError(
            f"The host cache cannot hold {'--max-cpu-loras ' if max_cpu_loras is not None else ''}{wanted} "
            f"adapter{'s' if wanted > 1 else ''}: each takes {per_entry / MiB:.1f} MiB of host memory (its GPU "
            f"slot's layout: every projection that takes LoRA at --max-lora-rank {max_lora_rank}"
            f"{f', on {ranks} ranks' if ranks > 1 else ''}), {wanted * per_entry / GiB:.2f} GiB in all, and "
            f"{HOST_CACHE_FRACTION:.0%} of the host's {available / GiB:.2f} GiB available is {budget / GiB:.2f} GiB "
            f"({fits} adapters). Lower --max-cpu-loras or --max-lora-rank.")
    capacity = max_cpu_loras if max_cpu_loras is not None else fits
    if per_entry:
        logger.info("host cache: up to %d adapters of %.1f MiB (%.2f GiB; %.2f GiB of host memory available%s)",
                    capacity, per_entry / MiB, capacity * per_entry / GiB, available / GiB,
                    "" if max_cpu_loras is not None else ", --max-cpu-loras not set")
    return capacity
