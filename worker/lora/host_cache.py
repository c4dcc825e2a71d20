"""The host tier: adapters packed in their GPU slot's layout, in pinned host memory, evicted LRU.

An entry is reserved when its disk read starts, so reads in flight count against the capacity, and
filled when the read completes. A filled entry is one contiguous buffer: loading it into a GPU slot
is a single host-to-device copy.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker.request import AdapterRef

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class HostAdapter:
    packed: torch.Tensor     # [slot_bytes] uint8, pinned on CUDA: one GPU slot's bytes (lora/slot_layout.py)
    rank: int

    @property
    def num_bytes(self) -> int:
        return self.packed.numel()


class HostCache:
    """At most `capacity` entries (None: no bound). Eviction takes filled, unpinned entries outside the
    caller's `protected` set: the one not needed again soonest (by `next_use`), then least recently used."""

    def __init__(self, capacity: int | None):
        if capacity is not None and capacity < 1:
            raise ValueError(f"--max-cpu-loras must be at least 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[AdapterRef, HostAdapter | None] = OrderedDict()  # None: read in flight
        self._pinned: set[AdapterRef] = set()
        self.evictions = 0

    def get(self, ref: AdapterRef) -> HostAdapter | None:
        """The filled entry of `ref`, now the most recently used; None if absent or still being read."""
        entry = self._entries.get(ref)
        if entry is not None:
            self._entries.move_to_end(ref)
        return entry

    def __contains__(self, ref: AdapterRef) -> bool:
        """Filled or being read."""
        return ref in self._entries

    def is_filled(self, ref: AdapterRef) -> bool:
        return self._entries.get(ref) is not None

    def filled(self) -> list[AdapterRef]:
        """The adapters whose read has completed, least recently used first."""
        return [ref for ref, entry in self._entries.items() if entry is not None]

    def has_room(self) -> bool:
        """Whether an entry can be added without evicting one."""
        return self.capacity is None or len(self._entries) < self.capacity

    def reserve(self, ref: AdapterRef, protected: Container[AdapterRef] = (),
                next_use: Mapping[AdapterRef, int] | None = None) -> bool:
        """Make room for `ref` (evicting if full) and hold it as being read; False when nothing may go."""
        assert ref not in self._entries, f"reserve of cached adapter {ref}"
        if self.capacity is not None and len(self._entries) >= self.capacity:
            victim = self._victim(protected, next_use or {})
            if victim is None:
                return False
            del self._entries[victim]
            self.evictions += 1
        self._entries[ref] = None
        return True

    def fill(self, ref: AdapterRef, entry: HostAdapter) -> bool:
        """Complete the read of a reserved entry; False when it was dropped meanwhile."""
        if ref not in self._entries:
            return False
        self._entries[ref] = entry
        self._entries.move_to_end(ref)
        return True

    def drop(self, ref: AdapterRef) -> None:
        """Forget the entry of `ref` (an unload, or a read that failed)."""
        self._entries.pop(ref, None)

    def pin(self, ref: AdapterRef) -> None:
        """Never evict `ref`."""
        self._pinned.add(ref)

    def unpin(self, ref: AdapterRef) -> None:
        self._pinned.discard(ref)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return sum(e.num_bytes for e in self._entries.values() if e is not None)

    def _victim(self, protected: Container[AdapterRef], next_use: Mapping[AdapterRef, int]) -> AdapterRef | None:
        evictable = [(i, ref) for i, (ref, entry) in enumerate(self._entries.items())
                     if entry is not None and ref not in self._pinned and ref not in protected]
        best = min(evictable, default=None, key=lambda e: (-next_use.get(e[1], math.inf), e[0]))
        return None if best is None else best[1]
