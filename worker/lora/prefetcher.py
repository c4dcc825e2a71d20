"""Queue-driven prefetch (S-LoRA): adapters of waiting requests move from disk to the host cache and
from there to a GPU slot ahead of admission, in queue order.

The k-th distinct adapter in the queue may evict only what neither a running request (slot reference
counts) nor any of the first k - 1 queued adapters needs; among what it may evict, it takes the adapter
needed latest, or never. Once one adapter finds no room in a tier, later ones do not try that tier.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.lora.host_cache import HostCache
from worker.lora.slot_table import SlotTable
from worker.request import AdapterRef, Request

if TYPE_CHECKING:   # AdapterReader reads files on threads; the scheduler's imports stay bookkeeping alone
    from worker.lora.reader import AdapterReader


@dataclass
class Prefetch:
    loads: list[tuple[AdapterRef, int]] = field(default_factory=list)  # (adapter, slot) to copy now; loading
    starved: set[AdapterRef] = field(default_factory=set)   # on the host, but no GPU slot could be had


class Prefetcher:
    """Looks at the first `window` distinct adapters of the queue; keeps at most `max_reads` disk
    reads in flight."""

    def __init__(self, slots: SlotTable, host: HostCache, reader: AdapterReader, window: int, max_reads: int):
        self.slots, self.host, self.reader = slots, host, reader
        self.window, self.max_reads = window, max_reads

    def prefetch(self, waiting: Iterable[Request]) -> Prefetch:
        """Start the reads and reserve the slots the queue calls for; the caller issues the loads."""
        order = self._queued_adapters(waiting)
        next_use = {ref: i for i, ref in enumerate(order)}
        result, protected = Prefetch(), set()
        gpu_open = host_open = True
        for ref in order:
            protected.add(ref)
            if self.slots.slot_of(ref) is not None:
                continue                      # loaded or loading
            if self.host.is_filled(ref):
                slot = self.slots.reserve(ref, protected, next_use) if gpu_open else None
                if slot is None:
                    gpu_open = False
                    result.starved.add(ref)
                else:
                    result.loads.append((ref, slot))
            elif ref not in self.host and host_open and self.reader.num_in_flight < self.max_reads:
                host_open = self.host.reserve(ref, protected, next_use, self.reader.entry_bytes(ref))
                if host_open:
                    self.reader.start(ref)
        return result

    def _queued_adapters(self, waiting: Iterable[Request]) -> list[AdapterRef]:
        """Distinct adapters of `waiting`, in its order, at most `window` of them."""
        order: dict[AdapterRef, None] = {}
        for request in waiting:
            if request.adapter is not None:
                order[request.adapter] = None
                if len(order) == self.window:
                    break
        return list(order)
