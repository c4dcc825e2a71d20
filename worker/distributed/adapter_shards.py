"""An adapter's LoRA weights cut to this rank's share, in the shapes its slot holds under tensor parallelism.

vLLM's default scheme: a column-parallel projection (qkv, gate_up) keeps lora_A whole and the rows of lora_B that
match its share of each fused slice; a row-parallel one (o, down) keeps the columns of lora_A that match its share
of the input and lora_B whole (its expand adds into the partial sum the all-reduce completes). Each projection says
which share is its own (`Linear.shard_lora`); the slot layout (lora/slot_layout.py) is built from the sharded
model, so `SlotLayout.pack` of the result is this rank's slot.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from worker.lora.adapter import AdapterBytes


def shard_adapter(model: nn.Module, adapter: AdapterBytes) -> AdapterBytes:
    """`adapter` (whole, as lora/adapter.read_adapter reads it) as this rank of `model` holds it; unchanged at
    world size 1."""
    if model.tp.world_size == 1:
        return adapter
    if adapter.experts:
        raise ValueError(f"adapter {adapter.spec.name!r}: expert LoRA is not supported with tensor parallelism")
    modules = {}
    for (layer, target), m in adapter.modules.items():
        name, shard = model.lora_targets[target]
        a = m.a.view(adapter.dtype).view(m.rank, m.in_features)          # lora_A [rank, in_features]
        b = m.b.view(adapter.dtype).view(m.out_features, m.rank)         # lora_B [out_features, rank]
        a, b = model.projection(layer, name).shard_lora(shard, a, b)
        modules[(layer, target)] = dataclasses.replace(m, a=_bytes(a), b=_bytes(b), in_features=a.shape[1],
                                                       out_features=b.shape[0])
    return dataclasses.replace(adapter, modules=modules)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)

