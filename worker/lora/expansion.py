"""An adapter's host-cache entry written into a GPU slot: the entry's layout (its own rank r and projections,
SlotLayout.entry_layout) into the slot's (rank R, every projection), by strided copies on the slot's device.

The slot is zeroed, then each region's fields are copied into place: lora_A's r rows of each fused slice into
the first r of its R rows, lora_B's r columns into the first r of R, the scalings as they are; an expert region
field by field (gate_up_a [E, 2, r, H] into [E, 2, R, H], the B's columns and down_a's rows likewise). The same
field of every layer whose regions lie at a constant stride in both layouts (all layers of a dense model) is one
copy with a layer dimension, so an entry lands in a few dozen copies whatever the number of layers.

    entry  [ L0.qkv: A(3 x r rows) | B(r cols) | s ][ L1.qkv ... ]            (only what the adapter adapts)
    slot   [ L0.qkv: A(3 x R rows) | B(R cols) | s ][ L0.o_proj ... ][ L1.qkv ... ] ...
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from worker.lora.expert_layout import ExpertRegion
from worker.lora.slot_layout import SlotLayout, _Region


@dataclass(frozen=True)
class _Copy:
    """Elements of `shape` from the entry (byte offset, strides in elements) to the slot (the same)."""
    dtype: torch.dtype
    shape: tuple[int, ...]
    src_offset: int
    src_strides: tuple[int, ...]
    dst_offset: int
    dst_strides: tuple[int, ...]


class Expansion:
    """How `entry` (a layout from `slot.entry_layout`, or `slot` itself) is written into a slot of `slot`."""

    def __init__(self, entry: SlotLayout, slot: SlotLayout):
        assert entry.dtype == slot.dtype and entry.max_rank <= slot.max_rank
        self.entry_bytes, self.slot_bytes = entry.num_bytes, slot.num_bytes
        self.whole = entry is slot          # one copy of the whole slot
        copies = []
        for key, region in entry.regions.items():
            copies += _region_copies(region, slot.regions[key], slot.dtype)
        for layer, region in entry.expert_regions.items():
            copies += _expert_copies(region, slot.expert_regions[layer])
        self.copies = _merge(copies)

    @torch.no_grad()
    def apply(self, entry: torch.Tensor, slot: torch.Tensor) -> None:
        """Write `entry` ([entry_bytes] uint8) into `slot` ([slot_bytes] uint8), on the current stream."""
        assert entry.shape == (self.entry_bytes,) and slot.shape == (self.slot_bytes,)
        if self.whole:
            slot.copy_(entry, non_blocking=True)
            return
        slot.zero_()
        for c in self.copies:
            src, dst = entry.view(c.dtype), slot.view(c.dtype)
            item = c.dtype.itemsize
            dst.as_strided(c.shape, c.dst_strides, dst.storage_offset() + c.dst_offset // item).copy_(
                src.as_strided(c.shape, c.src_strides, src.storage_offset() + c.src_offset // item))


def _region_copies(src: _Region, dst: _Region, dtype: torch.dtype) -> list[_Copy]:
    """A fused projection's lora_A rows per slice, lora_B columns and scalings."""
    n = len(src.slice_offsets) - 1
    assert src.slice_offsets == dst.slice_offsets and src.a_shape[1] == dst.a_shape[1]
    ra, ra_slot, width = src.a_shape[0] // n, dst.a_shape[0] // n, src.a_shape[1]
    (out, rb), rb_slot = src.b_shape, dst.b_shape[1]
    return [_Copy(dtype, (n, ra, width), src.a_offset, (ra * width, width, 1),
                  dst.a_offset, (ra_slot * width, width, 1)),
            _Copy(dtype, (out, rb), src.b_offset, (rb, 1), dst.b_offset, (rb_slot, 1)),
            _Copy(torch.float32, (n,), src.scalings_offset, (1,), dst.scalings_offset, (1,))]


def _expert_copies(src: ExpertRegion, dst: ExpertRegion) -> list[_Copy]:
    """One sparse layer's expert LoRA field by field: [E, 2r, H] gate/up A as [E, 2, r, H], the rest as stored,
    each into the first r rows (A) or columns (B) of the slot's R."""
    copies = []
    for name, (offset, shape, dtype) in src.fields.items():
        slot_offset, slot_shape, _ = dst.fields[name]
        if name == "gate_up_a":
            (e, two_r, h), r_slot = shape, slot_shape[1] // 2
            shape, slot_shape = (e, 2, two_r // 2, h), (e, 2, r_slot, h)
        shape = shape or (1,)
        slot_shape = slot_shape or (1,)
        copies.append(_Copy(dtype, shape, offset, _strides(shape), slot_offset, _strides(slot_shape)))
    return copies


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A row-major array's strides, in elements."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _merge(copies: list[_Copy]) -> list[_Copy]:
    """Copies of one kind (dtype, shape, strides) whose offsets advance by a constant step in both layouts, made
    one with a leading dimension over them; order kept within a kind."""
    kinds: dict[tuple, list[_Copy]] = defaultdict(list)
    for c in copies:
        kinds[(c.dtype, c.shape, c.src_strides, c.dst_strides)].append(c)
    merged = []
    for group in kinds.values():
        i = 0
        while i < len(group):
            j = i + 1
            if j < len(group):
                step = (group[j].src_offset - group[i].src_offset, group[j].dst_offset - group[i].dst_offset)
                while (j + 1 < len(group) and (group[j + 1].src_offset - group[j].src_offset,
                                               group[j + 1].dst_offset - group[j].dst_offset) == step):
                    j += 1
                j += 1
            run, first = group[i:j], group[i]
            if len(run) == 1:
                merged.append(first)
            else:
                item = first.dtype.itemsize
                src_step, dst_step = run[1].src_offset - first.src_offset, run[1].dst_offset - first.dst_offset
                merged.append(_Copy(first.dtype, (len(run), *first.shape), first.src_offset,
                                    (src_step // item, *first.src_strides), first.dst_offset,
                                    (dst_step // item, *first.dst_strides)))
            i = j
    return merged
