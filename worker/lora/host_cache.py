"""The host tier: adapters at their own size, in page-locked host memory (lora/host_buffers.py), evicted LRU.

An entry is one contiguous buffer in its adapter's entry layout (lora/slot_layout.SlotLayout.entry_layout: the slot
layout cut to the adapter's rank and the projections it adapts); loading it into a GPU slot is one host-to-device
copy and a few strided copies on the device that write it in the slot's layout (lora/expansion.py). An entry is
reserved, with its size, when its disk read starts, so reads in flight count against the capacity, and filled when
the read completes. The capacity is a number of bytes (the memory plan's, lora/host_cache_plan.py) and, with
--max-cpu-loras, a number of entries.
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

    from worker.lora.slot_layout import SlotLayout


@dataclass(frozen=True, eq=False)
class HostAdapter:
    packed: torch.Tensor     # [layout.num_bytes] uint8, page-locked on CUDA
    rank: int
    layout: SlotLayout | None = None    # the entry's layout (SlotLayout.entry_layout); None: the slot's own

    @property
    def num_bytes(self) -> int:
        return self.packed.numel()


class HostCache:
    """At most `capacity` entries and `capacity_bytes` bytes (None: no bound). Eviction takes filled, unpinned
    entries outside the caller's `protected` set: the one not needed again soonest (by `next_use`), then least
    recently used."""

    def __init__(self, capacity: int | None, capacity_bytes: int | None = None):
        if capacity is not None and capacity < 1:
            raise ValueError(f"--max-cpu-loras must be at least 1, got {capacity}")
        self.capacity, self.capacity_bytes = capacity, capacity_bytes
        self._entries: OrderedDict[AdapterRef, HostAdapter | None] = OrderedDict()  # None: read in flight
        self._sizes: dict[AdapterRef, int] = {}      # each entry's bytes, as reserved
        self._bytes = 0
        self._pinned: set[AdapterRef] = set()
        self.evictions = 0
        self.changes = 0           # counts changes of which entries are held and filled

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

    def has_room(self, num_bytes: int = 0) -> bool:
        """Whether an entry of `num_bytes` can be added without evicting one."""
        return self._fits(len(self._entries) + 1, self._bytes + num_bytes)

    def reserve(self, ref: AdapterRef, protected: Container[AdapterRef] = (),
                next_use: Mapping[AdapterRef, int] | None = None, num_bytes: int = 0) -> bool:
        """Make room for an entry of `num_bytes` for `ref` (evicting while full) and hold it as being read; False,
        evicting nothing, when what may go would not make room."""
        assert ref not in self._entries, f"reserve of cached adapter {ref}"
        if self.capacity_bytes is not None and num_bytes > self.capacity_bytes:
            return False
        victims, count, size = [], len(self._entries) + 1, self._bytes + num_bytes
        if not self._fits(count, size):          # eviction order is sorted only when something must go
            for victim in self._victims(protected, next_use or {}):
                victims.append(victim)
                count, size = count - 1, size - self._sizes[victim]
                if self._fits(count, size):
                    break
            if not self._fits(count, size):
                return False
        for victim in victims:
            self._forget(victim)
            self.evictions += 1
        self._entries[ref] = None
        self._sizes[ref] = num_bytes
        self._bytes += num_bytes
        self.changes += 1
        return True

    def fill(self, ref: AdapterRef, entry: HostAdapter) -> bool:
        """Complete the read of a reserved entry; False when it was dropped meanwhile."""
        if ref not in self._entries:
            return False
        self._entries[ref] = entry
        self._entries.move_to_end(ref)
        self._bytes += entry.num_bytes - self._sizes[ref]     # another size if its directory changed meanwhile
        self._sizes[ref] = entry.num_bytes
        self.changes += 1
        return True

    def drop(self, ref: AdapterRef) -> None:
        """Forget the entry of `ref` (an unload, or a read that failed)."""
        if ref in self._entries:
            self._forget(ref)

    def pin(self, ref: AdapterRef) -> None:
        """Never evict `ref`."""
        self._pinned.add(ref)

    def unpin(self, ref: AdapterRef) -> None:
        self._pinned.discard(ref)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        """The entries' bytes, reads in flight included."""
        return self._bytes

    def _fits(self, count: int, num_bytes: int) -> bool:
        return ((self.capacity is None or count <= self.capacity)
                and (self.capacity_bytes is None or num_bytes <= self.capacity_bytes))

    def _forget(self, ref: AdapterRef) -> None:
        del self._entries[ref]
        self._bytes -= self._sizes.pop(ref)
        self.changes += 1

    def _victims(self, protected: Container[AdapterRef], next_use: Mapping[AdapterRef, int]) -> list[AdapterRef]:
        """What may be evicted, in eviction order."""
        evictable = [(i, ref) for i, (ref, entry) in enumerate(self._entries.items())
                     if entry is not None and ref not in self._pinned and ref not in protected]
        return [ref for _, ref in sorted(evictable, key=lambda e: (-next_use.get(e[1], math.inf), e[0]))]
