"""The expert regions of an adapter slot: one per sparse MoE layer, after the dense regions (lora/slot_layout.py).

Each region holds, 256-byte aligned, exactly the fields of worker/batch.py's MoELoRAWeights for one slot:

    [ gate_up_a [E, 2R, H] | gate_up_b [E, 2I, R] | down_a [E, R, I] | down_b [E, H, R] | scalings [3] f32 | shared_outer i32 ]

and `expert_views` gives them over all slots as strided views: gate_up_a of layer l is
slots[:, off : off + E*2R*H*item] viewed as [S, E, 2R, H], so its strides are (num_bytes / item, 2R*H, H, 1);
scalings are [S, 3] with stride (num_bytes / 4, 1), shared_outer [S] with stride (num_bytes / 4,).

Packing (`pack_expert_layer`) normalises the three formats of lora/formats.py: PEFT target_parameters give
gate and up the same A (written in both the gate rows [0, R) and the up rows [R, 2R)) and B de-interleaved per
expert (formats.materialise); per-expert modules leave the experts they skip zero; stacked tensors go in as
they are. A shared-outer layer (ExpertLayerLoRA.shared_outer) keeps its gate/up A's and down B in expert 0 and
sets the flag; any other matrix stored once for all experts (n = 1) is repeated over them. Ranks below R are
zero-padded, projections left alone have scaling 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from worker.batch import MoELoRAWeights
from worker.lora.formats import ExpertLayerLoRA, materialise

ALIGN = 256         # bytes; as the dense regions


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ExpertRegion:
    """Where one sparse layer's expert LoRA sits in a slot: field -> (byte offset, shape, dtype)."""
    fields: dict[str, tuple[int, tuple[int, ...], torch.dtype]]
    offset: int                 # first byte
    num_bytes: int              # aligned size


def expert_regions(model: nn.Module, max_rank: int, dtype: torch.dtype,
                   offset: int) -> tuple[dict[int, ExpertRegion], int]:
    """The regions of the model's sparse layers from byte `offset` on, and the offset past the last one."""
    regions = {}
    for layer in model.lora_expert_layers():
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
