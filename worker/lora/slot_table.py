"""Which adapter sits in which GPU LoRA slot, whether its weights have arrived, and how many running
requests use each slot.

Bookkeeping only: the runner's GPU pool holds the weights and fills a slot when the engine hands it a
load the scheduler decided. A slot is evicted or reassigned only when no running request uses it, its
load has finished, and its adapter is not pinned.
"""
from __future__ import annotations

import math
from collections.abc import Container, Mapping

from worker.request import AdapterRef

POLICIES = ("lru", "fifo")


class SlotTable:
    """Maps AdapterRef -> slot in 0..num_slots-1 with a reference count and a load state per slot.

    Eviction takes an empty slot first, else an evictable slot: the adapter not needed again soonest
    (by `next_use`, a queue position; absent = never), then first in policy order: "lru" evicts the
    adapter released longest ago, "fifo" the adapter loaded longest ago.
    """

    def __init__(self, num_slots: int, policy: str = "lru"):
        if num_slots < 1:
            raise ValueError(f"need num_slots >= 1, got {num_slots}")
        if policy not in POLICIES:
            raise ValueError(f"unknown slot eviction policy {policy!r}; expected one of {POLICIES}")
        self.num_slots = num_slots
        self.policy = policy
        self._adapters: list[AdapterRef | None] = [None] * num_slots  # resident adapter per slot
        self._refcounts = [0] * num_slots       # running requests using each slot
        self._loading = [False] * num_slots     # a copy into the slot has not finished yet
        self._stamps = [0] * num_slots          # eviction order: the smallest stamp goes first
        self._slots: dict[AdapterRef, int] = {}
        self._pinned: set[AdapterRef] = set()
        self._clock = 0
        self.evictions = 0                      # resident adapters displaced by another
        self.changes = 0                        # counts changes of who is resident and loaded

    def acquire(self, ref: AdapterRef) -> tuple[int, bool] | None:
        """Reference `ref`'s slot: (slot, needs_load). None when every slot is in use.

        A newly assigned slot counts as loaded: the caller loads it before the step runs (blocking loads).
        A slot still loading may be referenced: its copy has been issued, and the step that uses it waits
        for the copy on the device (overlap loading); it stays loading until `mark_loaded`.
        """
        slot = self._slots.get(ref)
        needs_load = slot is None
        if needs_load:
            slot = self._victim()
            if slot is None:
                return None
            self._install(ref, slot)
        self._refcounts[slot] += 1
        return slot, needs_load

    def reserve(self, ref: AdapterRef, protected: Container[AdapterRef] = (),
                next_use: Mapping[AdapterRef, int] | None = None) -> int | None:
        """Assign a slot to non-resident `ref` and mark it loading, never evicting an adapter in
        `protected`; None when no slot can be had. The caller issues the copy before the step runs;
        `acquire` may follow at once."""
        assert ref not in self._slots, f"reserve of resident adapter {ref}"
        slot = self._victim(protected, next_use or {})
        if slot is not None:
            self._install(ref, slot)
            self._loading[slot] = True
        return slot

    def mark_loaded(self, ref: AdapterRef) -> bool:
        """The copy into `ref`'s slot finished; False when `ref` lost its slot meanwhile."""
        slot = self._slots.get(ref)
        if slot is None:
            return False
        self._loading[slot] = False
        self.changes += 1
        return True

    def release(self, ref: AdapterRef) -> None:
        """Drop one reference; the adapter stays resident for reuse."""
        slot = self._slots.get(ref)
        assert slot is not None and self._refcounts[slot] > 0, f"release of unreferenced adapter {ref}"
        self._refcounts[slot] -= 1
        if self.policy == "lru":
            self._stamps[slot] = self._tick()

    def pin(self, ref: AdapterRef) -> None:
        """Never evict `ref` once resident."""
        self._pinned.add(ref)

    def unpin(self, ref: AdapterRef) -> None:
        self._pinned.discard(ref)

    @property
    def pinned(self) -> frozenset[AdapterRef]:
        return frozenset(self._pinned)

    def residents(self) -> list[AdapterRef]:
        """The adapters holding a slot, loaded or loading (at most num_slots)."""
        return list(self._slots)

    def slot_of(self, ref: AdapterRef) -> int | None:
        return self._slots.get(ref)

    def is_loaded(self, ref: AdapterRef) -> bool:
        """Resident with its weights in place: requests using it may run."""
        slot = self._slots.get(ref)
        return slot is not None and not self._loading[slot]

    def is_loading(self, ref: AdapterRef) -> bool:
        slot = self._slots.get(ref)
        return slot is not None and self._loading[slot]

    @property
    def num_used(self) -> int:
        return len(self._slots)

    def can_acquire(self, ref: AdapterRef) -> bool:
        return ref in self._slots or self._victim() is not None

    def drop(self, ref: AdapterRef) -> bool:
        """Forget a resident, unreferenced adapter (after an unload). False when it was not resident."""
        slot = self._slots.pop(ref, None)
        if slot is None:
            return False
        assert self._refcounts[slot] == 0, f"drop of adapter {ref} still used by running requests"
        self._adapters[slot] = None
        self._loading[slot] = False
        self.changes += 1
        return True

    def _victim(self, protected: Container[AdapterRef] = (),
                next_use: Mapping[AdapterRef, int] | None = None) -> int | None:
        for slot, adapter in enumerate(self._adapters):
            if adapter is None:
                return slot
        next_use = next_use or {}
        evictable = [slot for slot, adapter in enumerate(self._adapters)
                     if self._refcounts[slot] == 0 and not self._loading[slot]
                     and adapter not in self._pinned and adapter not in protected]
        return min(evictable, default=None,
                   key=lambda s: (-next_use.get(self._adapters[s], math.inf), self._stamps[s]))

    def _install(self, ref: AdapterRef, slot: int) -> None:
        evicted = self._adapters[slot]
        if evicted is not None:
            del self._slots[evicted]
            self.evictions += 1
        self._adapters[slot] = ref
        self._slots[ref] = slot
        self._stamps[slot] = self._tick()
        self.changes += 1

    def _tick(self) -> int:
        self._clock += 1
        return self._clock
