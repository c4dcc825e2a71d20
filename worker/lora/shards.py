"""An adapter's LoRA weights cut to this rank's share, in the shapes its slot holds under tensor parallelism.

vLLM's default scheme: a column-parallel projection (qkv, gate_up) keeps lora_A whole and the rows of lora_B that
match its share of each fused slice; a row-parallel one (o, down) keeps the columns of lora_A that match its share
of the input and lora_B whole (its expand adds into the partial sum the all-reduce completes). Each projection says
which share is its own (`Linear.shard_lora`); the slot layout (lora/slot_layout.py) is built from the sharded
model, so `SlotLayout.pack` of the result is this rank's slot.

Fully sharded LoRA (`shard_loras_fully`, --fully-sharded-loras; S-LoRA's scheme) cuts the rest too: a
column-parallel projection's lora_A rows (its rank) and a row-parallel one's lora_B rows (its output), at one more
collective per projection (layers/linear.py says which). Expert LoRA keeps the scheme below.

Expert LoRA (lora/formats/expert_lora.py ExpertLayerLoRA, every format, shared-outer included) follows the experts'
sharding along the intermediate size I (layers/sparse_moe.py `FusedExperts.intermediate_shard`): gate and up keep A
whole and the rows of B in this rank's share of I; down keeps the columns of A in that share and B whole. The
matrices stay where they are in the file; each is marked with its part (`ExpertMatrix.part`), which `materialise`
cuts when the slot is packed.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from worker.lora.adapter import AdapterBytes
from worker.lora.formats.expert_lora import ExpertLayerLoRA, ExpertProjection


def shard_loras_fully(model: nn.Module, max_rank: int) -> None:
    """Every projection of `model` that takes LoRA holds it fully sharded over the model's ranks (before the
    LoRA slots are laid out); max_rank must divide by the ranks, as vLLM requires."""
    for layer, name in model.lora_targets(model.cfg).layer_projections():
        model.projection(layer, name).shard_lora_fully(model.tp, max_rank)


def shard_adapter(model: nn.Module, adapter: AdapterBytes) -> AdapterBytes:
    """`adapter` (whole, as lora/adapter.read_adapter reads it) as this rank of `model` holds it; unchanged at
    world size 1."""
    if model.tp.world_size == 1:
        return adapter
    targets, modules = model.lora_targets(model.cfg), {}
    for (layer, module), m in adapter.modules.items():
        target, shard = targets.packing(layer, module)
        a = m.a.view(adapter.dtype).view(m.rank, m.in_features)          # lora_A [rank, in_features]
        b = m.b.view(adapter.dtype).view(m.out_features, m.rank)         # lora_B [out_features, rank]
        a, b = model.projection(layer, target.projection).shard_lora(shard, a, b)
        modules[(layer, module)] = dataclasses.replace(m, a=_bytes(a), b=_bytes(b), in_features=a.shape[1],
                                                       out_features=b.shape[0])
    experts = {layer: shard_expert_layer(found, *model.moe_block(layer).experts.intermediate_shard)
               for layer, found in adapter.experts.items()}
    return dataclasses.replace(adapter, modules=modules, experts=experts)


def shard_expert_layer(found: ExpertLayerLoRA, start: int, length: int) -> ExpertLayerLoRA:
    """One layer's expert LoRA cut to intermediate rows/columns [start, start + length): gate and up B
    [n, I, r] -> [n, length, r] (dim 1), down A [n, r, I] -> [n, r, length] (dim 2); the other factors whole."""
    def cut(proj: ExpertProjection | None, factor: str, dim: int) -> ExpertProjection | None:
        if proj is None:
            return None
        matrix = dataclasses.replace(getattr(proj, factor), part=(dim, start, length))
        return dataclasses.replace(proj, **{factor: matrix})

    return dataclasses.replace(found, gate=cut(found.gate, "b", 1), up=cut(found.up, "b", 1),
                               down=cut(found.down, "a", 2))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)
