"""Which adapter sits in which GPU LoRA slot, and how many running requests use each slot.

Bookkeeping only: the runner's GPU pool holds the weights and fills a slot when the scheduler
reports a new assignment. A slot with a nonzero reference count is never evicted or reassigned.
"""
from __future__ import annotations

from worker.request import AdapterRef

POLICIES = ("lru", "fifo")


class SlotTable:
    """Maps AdapterRef -> slot in 0..num_slots-1 with a reference count per slot.

    Eviction takes an empty slot first, else the unreferenced slot that is first in policy order:
    "lru" evicts the adapter released longest ago, "fifo" the adapter loaded longest ago.
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
        self._stamps = [0] * num_slots          # eviction order: the smallest stamp goes first
        self._slots: dict[AdapterRef, int] = {}
        self._clock = 0

    def acquire(self, ref: AdapterRef) -> tuple[int, bool] | None:
        """Reference `ref`'s slot: (slot, needs_load). None when every slot is referenced."""
        slot = self._slots.get(ref)
        needs_load = slot is None
        if needs_load:
            slot = self._victim()
            if slot is None:
                return None
            self._install(ref, slot)
        self._refcounts[slot] += 1
        return slot, needs_load

    def release(self, ref: AdapterRef) -> None:
        """Drop one reference; the adapter stays resident for reuse."""
        slot = self._slots.get(ref)
        assert slot is not None and self._refcounts[slot] > 0, f"release of unreferenced adapter {ref}"
        self._refcounts[slot] -= 1
        if self.policy == "lru":
            self._stamps[slot] = self._tick()

    def slot_of(self, ref: AdapterRef) -> int | None:
        return self._slots.get(ref)

    def refcount(self, ref: AdapterRef) -> int:
        slot = self._slots.get(ref)
        return 0 if slot is None else self._refcounts[slot]

    def can_acquire(self, ref: AdapterRef) -> bool:
        return ref in self._slots or self._victim() is not None

    def drop(self, ref: AdapterRef) -> bool:
        """Forget a resident, unreferenced adapter (after an unload). False when it was not resident."""
        slot = self._slots.pop(ref, None)
        if slot is None:
            return False
        assert self._refcounts[slot] == 0, f"drop of adapter {ref} still used by running requests"
        self._adapters[slot] = None
        return True

    def _victim(self) -> int | None:
        for slot, adapter in enumerate(self._adapters):
            if adapter is None:
                return slot
        unreferenced = [slot for slot in range(self.num_slots) if self._refcounts[slot] == 0]
        return min(unreferenced, key=self._stamps.__getitem__, default=None)

    def _install(self, ref: AdapterRef, slot: int) -> None:
        evicted = self._adapters[slot]
        if evicted is not None:
            del self._slots[evicted]
        self._adapters[slot] = ref
        self._slots[ref] = slot
        self._stamps[slot] = self._tick()

    def _tick(self) -> int:
        self._clock += 1
        return self._clock
