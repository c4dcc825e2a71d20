"""What a test reads of a SlotTable beyond its public interface: how many running requests hold an adapter."""
from __future__ import annotations

from worker.lora.slot_table import SlotTable
from worker.request import AdapterRef


def refcount(table: SlotTable, ref: AdapterRef) -> int:
    """The references the scheduler holds on `ref`'s slot (0 when it holds no slot)."""
    slot = table.slot_of(ref)
    return 0 if slot is None else table._refcounts[slot]
