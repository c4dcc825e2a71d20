"""What a test reads of the adapter tiers beyond their public interface: how many running requests hold an adapter,
and a host-cache entry as it lands in a slot."""
from __future__ import annotations

import torch

from worker.lora.expansion import Expansion
from worker.lora.host_cache import HostAdapter
from worker.lora.slot_layout import SlotLayout
from worker.lora.slot_table import SlotTable
from worker.request import AdapterRef


def refcount(table: SlotTable, ref: AdapterRef) -> int:
    """The references the scheduler holds on `ref`'s slot (0 when it holds no slot)."""
    slot = table.slot_of(ref)
    return 0 if slot is None else table._refcounts[slot]


def laid_out(layout: SlotLayout, entry: HostAdapter) -> torch.Tensor:
    """`entry` written into one slot of `layout` as the GPU pool writes it (lora/expansion.py), on the CPU, over a
    slot full of stale bytes: every byte of the slot must be written."""
    slot = torch.full((layout.num_bytes,), 0xAB, dtype=torch.uint8)
    Expansion(entry.layout or layout, layout).apply(entry.packed, slot)
    return slot
