"""The expert regions of an adapter slot: one per sparse MoE layer, after the dense regions (lora/slot_layout.py).

Each region holds, 256-byte aligned, exactly the fields of worker/batch.py's MoELoRAWeights for one slot:

    [ gate_up_a [E, 2R, H] | gate_up_b [E, 2I, R] | down_a [E, R, I] | down_b [E, H, R] | scalings [3] f32 | shared_outer i32 ]

and `expert_views` gives them over all slots as strided views: gate_up_a of layer l is
slots[:, off : off + E*2R*H*item] viewed as [S, E, 2R, H], so its strides are (num_bytes / item, 2R*H, H, 1);
scalings are [S, 3] with stride (num_bytes / 4, 1), shared_outer [S] with stride (num_bytes / 4,).

Packing (`pack_expert_layer`) normalises the three formats of lora/formats/experts.py: PEFT target_parameters give
gate and up the same A (written in both the gate rows [0, R) and the up rows [R, 2R)) and B de-interleaved per
expert (formats.materialise); per-expert modules leave the experts they skip zero; stacked tensors go in as
they are. A shared-outer layer (ExpertLayerLoRA.shared_outer) keeps its gate/up A's and down B in expert 0 and
sets the flag; any other matrix stored once for all experts (n = 1) is repeated over them. Ranks below R are
zero-padded, projections left alone have scaling 0.

`expert_layer_reads` writes the same bytes from a file that stores the slots' dtype, reading each stored run
straight into place (SlotLayout.read_packed): A blocks [k, in] per expert are contiguous in every format and
land on their rows (PEFT's A twice, in the gate and the up rows; a matrix stored once, once per expert); B
blocks [out, k] land in place at k = R, else they are read aside and copied with their rows padded to R; PEFT's
B (the projection's rows of it) is read aside and de-interleaved by one transposing copy. Only a file in another
dtype than the slots' takes the converting path (read_adapter + pack).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from worker.lora.formats.expert_lora import ExpertLayerLoRA, ExpertMatrix, materialise
from worker.lora.targets import LoRATargets
from worker.lora.weights import MoELoRAWeights

ALIGN = 256         # bytes; as the dense regions
_UINT = {2: np.uint16, 4: np.uint32}     # a weight's bits by item size: numpy has no bfloat16
Reads = list[tuple[int, memoryview]]    # (file offset, destination), as lora/file_reads.py reads them


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ExpertRegion:
    """Where one sparse layer's expert LoRA sits in a slot: field -> (byte offset, shape, dtype)."""
    fields: dict[str, tuple[int, tuple[int, ...], torch.dtype]]
    offset: int                 # first byte
    num_bytes: int              # aligned size


def expert_regions(model: nn.Module, targets: LoRATargets, max_rank: int, dtype: torch.dtype,
                   offset: int) -> tuple[dict[int, ExpertRegion], int]:
    """The regions of the sparse layers `targets` lists from byte `offset` on, and the offset past the last one;
    the experts' shapes are the built model's (this rank's share of them)."""
    regions = {}
    for layer in targets.experts.sparse_layers if targets.experts is not None else ():
        e, two_i, h = model.moe_block(layer).experts.gate_up_proj.shape      # [E, 2I, H]
        i, r = two_i // 2, max_rank
        shapes = {"gate_up_a": ((e, 2 * r, h), dtype), "gate_up_b": ((e, 2 * i, r), dtype),
                  "down_a": ((e, r, i), dtype), "down_b": ((e, h, r), dtype),
                  "scalings": ((3,), torch.float32), "shared_outer": ((), torch.int32)}
        fields, start = {}, offset
        for name, (shape, field_dtype) in shapes.items():
            fields[name] = (offset, shape, field_dtype)
            offset += aligned(math.prod(shape) * field_dtype.itemsize)
        regions[layer] = ExpertRegion(fields, start, offset - start)
    return regions, offset


def expert_views(slots: torch.Tensor, regions: dict[int, ExpertRegion]) -> dict[int, MoELoRAWeights]:
    """Per sparse layer, MoELoRAWeights over `slots` ([num_slots, num_bytes] uint8), sharing its storage."""
    def view(offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        size = math.prod(shape) * dtype.itemsize
        return slots[:, offset:offset + size].view(dtype).view(slots.shape[0], *shape)   # [S, *shape]

    return {layer: MoELoRAWeights(**{name: view(*spec) for name, spec in region.fields.items()})
            for layer, region in regions.items()}


@torch.no_grad()
def pack_expert_layer(region: ExpertRegion, found: ExpertLayerLoRA | None, file: Path | None) -> torch.Tensor:
    """One layer's expert LoRA in its region's bytes ([region.num_bytes] uint8); zeros when `found` is None."""
    packed = torch.zeros(region.num_bytes, dtype=torch.uint8)
    if found is None:
        return packed
    w = expert_views(packed[None], {0: _shifted(region)})[0]     # each field [1, *shape]
    r, i = w.down_a.shape[2], w.down_a.shape[3]
    shared = found.shared_outer
    for s, proj in enumerate((found.gate, found.up, found.down)):
        if proj is None:
            continue
        a, b, k = materialise(proj.a, file), materialise(proj.b, file), proj.rank   # [n_a, k, in], [n_b, out, k]
        if shared and s < 2:
            w.gate_up_a[0, :1, s * r:s * r + k] = a.to(w.gate_up_a.dtype)
        elif s < 2:
            w.gate_up_a[0, :, s * r:s * r + k] = a.to(w.gate_up_a.dtype)           # n_a = 1 broadcasts
        else:
            w.down_a[0, :, :k] = a.to(w.down_a.dtype)
        if s < 2:
            w.gate_up_b[0, :, s * i:(s + 1) * i, :k] = b.to(w.gate_up_b.dtype)
        elif shared:
            w.down_b[0, :1, :, :k] = b.to(w.down_b.dtype)
        else:
            w.down_b[0, :, :, :k] = b.to(w.down_b.dtype)
        w.scalings[0, s] = proj.scaling
    w.shared_outer[0] = int(shared)
    return packed


def _shifted(region: ExpertRegion) -> ExpertRegion:
    """The region with offsets counted from its own first byte."""
    return ExpertRegion({name: (off - region.offset, shape, dtype) for name, (off, shape, dtype) in region.fields.items()},
                        0, region.num_bytes)


def expert_layer_reads(buf: np.ndarray, region: ExpertRegion, found: ExpertLayerLoRA | None,
                       reads: Reads) -> list[Callable[[], None]]:
    """pack_expert_layer's bytes of one layer written into `buf` (the slot's bytes, uint8) from the adapter's
    file, which stores the slots' dtype: zeros, scalings and the shared-outer flag are written now, the
    (file offset, destination) of every stored run that lands in place is appended to `reads`, and the
    copies to run once those reads are done (B read aside: padded to R or de-interleaved) are returned. Whole
    matrices into a region of their size only: a tensor-parallel rank's share (ExpertMatrix.part, a region sized
    from sharded experts) is packed by pack_expert_layer."""
    def field(name: str) -> np.ndarray:
        off, shape, dtype = region.fields[name]
        size = math.prod(shape) * dtype.itemsize
        buf[off + size:off + aligned(size)] = 0
        return buf[off:off + size].view(_UINT.get(dtype.itemsize, np.uint8)).reshape(shape)

    gate_up_a, gate_up_b, down_a, down_b = (field(n) for n in ("gate_up_a", "gate_up_b", "down_a", "down_b"))
    e, two_r, h = gate_up_a.shape
    a_dst = (*gate_up_a.reshape(e, 2, two_r // 2, h).transpose(1, 0, 2, 3), down_a)    # each [E, R, in]
    b_dst = (*gate_up_b.reshape(e, 2, -1, two_r // 2).transpose(1, 0, 2, 3), down_b)   # each [E, out, R]
    field("scalings")[...] = np.array([0.0, 0.0, 0.0] if found is None else
                                      [0.0 if p is None else p.scaling for p in (found.gate, found.up, found.down)],
                                      dtype=np.float32).view(np.uint32)
    field("shared_outer")[...] = int(found is not None and found.shared_outer)
    finish: list[Callable[[], None]] = []
    for s, (a, b) in enumerate(zip(a_dst, b_dst)):
        proj = None if found is None else (found.gate, found.up, found.down)[s]
        if proj is None:
            a[...], b[...] = 0, 0
            continue
        if proj.a.part or proj.b.part or (proj.a.shape[2], proj.b.shape[1]) != (a.shape[2], b.shape[1]):
            raise ValueError(f"expert LoRA of layer {found.layer} does not fit its slot region in place (a "
                             "tensor-parallel rank's share): read_adapter, shard_adapter and SlotLayout.pack it")
        shared = found.shared_outer
        _read_a(proj.a, proj.rank, a, shared and s < 2, reads)
        finish += _read_b(proj.b, proj.rank, b, shared and s == 2, reads)
    return finish


def _read_a(m: ExpertMatrix, k: int, dst: np.ndarray, once: bool, reads: Reads) -> None:
    """A [n, k, in] into dst [E, R, in]: each expert's k rows read in place, rows [k, R) zero; `once`: the
    matrix serves every expert from expert 0 (shared outer), the other experts zero."""
    dst[:, k:] = 0
    for expert, offset in _blocks(m, dst, once):
        reads.append((offset, _bytes(dst[expert, :k])))


def _read_b(m: ExpertMatrix, k: int, dst: np.ndarray, once: bool, reads: Reads) -> list[Callable[[], None]]:
    """B [n, out, k] into dst [E, out, R]: read in place at k = R, else read aside and copied into columns
    [0, k) (columns [k, R) zero); PEFT's [out, k*E] (column c*E + e: expert e's rank index c) read aside and
    de-interleaved. `once` as in _read_a. Returns the copies to run after the reads."""
    e, out, r = dst.shape
    dst[:, :, k:] = 0
    if m.layout == "peft_b":
        # stored row o of [out, k*E], E = 2, k = 2: [b0[o,0], b1[o,0], b0[o,1], b1[o,1]] (b_e: expert e's B), read
        # as [out, k, E] and copied transposed to [E, out, k]: dst[e, o, c] = staged[o, c, e]
        staged = np.empty((out, k, e), dtype=dst.dtype)          # [out, k, E]
        row_bytes = k * e * dst.itemsize
        reads.append((m.sources[0].span[0] + m.row_offset * row_bytes, _bytes(staged)))

        def deinterleave() -> None:
            dst[:, :, :k] = staged.transpose(2, 0, 1)           # [E, out, k]
        return [deinterleave]
    blocks = _blocks(m, dst, once)
    if k == r:
        reads += [(offset, _bytes(dst[expert])) for expert, offset in blocks]
        return []
    offsets = sorted({offset for _, offset in blocks})
    staged = np.empty((len(offsets), out, k), dtype=dst.dtype)      # [distinct blocks, out, k]
    reads += [(offset, _bytes(block)) for offset, block in zip(offsets, staged)]
    index = {offset: j for j, offset in enumerate(offsets)}
    experts, sources = [expert for expert, _ in blocks], [index[offset] for _, offset in blocks]

    def pad() -> None:
        if experts == sources == list(range(e)):
            dst[:, :, :k] = staged
        else:
            dst[experts, :, :k] = staged[sources]
    return [pad]


def _blocks(m: ExpertMatrix, dst: np.ndarray, once: bool) -> list[tuple[int, int]]:
    """(destination expert, file offset of its stored [rows, cols] block) for each expert of dst [E, ...]
    that gets one; the others are zeroed. A matrix stored once (n = 1) serves every expert unless `once`."""
    n, rows, cols = m.shape
    size = rows * cols * dst.itemsize
    if m.layout == "per_expert":
        blocks = [(expert, t.span[0]) for expert, t in enumerate(m.sources) if t is not None]
    else:                                   # "peft_a", "stacked": [n, rows, cols] blocks one after another
        blocks = [(expert, m.sources[0].span[0] + min(expert, n - 1) * size)
                  for expert in range(1 if once else dst.shape[0])]
    missing = np.ones(dst.shape[0], dtype=bool)
    missing[[expert for expert, _ in blocks]] = False
    if missing.any():
        dst[missing] = 0
    return blocks


def _bytes(a: np.ndarray) -> memoryview:
    """A C-contiguous array's bytes as a flat writable memoryview (what os.preadv fills)."""
    return memoryview(a).cast("B")
