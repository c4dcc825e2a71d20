"""Device memory for adapters: `max_loras` slots per projection, each sized to `max_lora_rank`.

Owned by the model runner. Slot assignment is decided elsewhere (the scheduler's slot table); this
pool only copies an adapter's weights into a slot and keeps the per-slot rank and scalings.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.layers.linear import LoRAWeights
from worker.lora.adapter import LoRAAdapter

_PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class GPULoRAPool:
    def __init__(self, model: nn.Module, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self.num_slots, self.max_rank = num_slots, max_rank
        self.model = model
        self.ranks = torch.zeros(num_slots, dtype=torch.int32, device=device)   # [num_slots]; 0 = empty
        self.ranks_host = [0] * num_slots
        self.weights: dict[tuple[int, str], LoRAWeights] = {}
        for layer in range(model.cfg.num_layers):
            for name in _PROJECTIONS:
                proj = model.projection(layer, name)
                n = len(proj.output_sizes)
                w = LoRAWeights(
                    a=torch.zeros(num_slots, n * max_rank, proj.in_features, dtype=dtype, device=device),
                    b=torch.zeros(num_slots, proj.slice_offsets[-1], max_rank, dtype=dtype, device=device),
                    scalings=torch.zeros(num_slots, n, dtype=torch.float32, device=device),
                    slice_offsets=proj.slice_offsets)
                proj.lora = w
                self.weights[(layer, name)] = w

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in self.weights.values() for t in (w.a, w.b))

    @torch.no_grad()
    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` into `slot`; modules it does not target become zeros (no contribution)."""
        targets = self.model.lora_targets
        for w in self.weights.values():
            w.a[slot].zero_()
            w.b[slot].zero_()
            w.scalings[slot].zero_()
        for (layer, target), m in adapter.modules.items():
            name, s = targets[target]
            w = self.weights[(layer, name)]
            r, R = m.rank, self.max_rank
            w.a[slot, s * R:s * R + r].copy_(m.a, non_blocking=True)
            w.b[slot, w.slice_offsets[s]:w.slice_offsets[s + 1], :r].copy_(m.b, non_blocking=True)
            w.scalings[slot, s] = m.scaling
        self.ranks[slot] = adapter.rank
        self.ranks_host[slot] = adapter.rank

    def clear(self, slot: int) -> None:
        self.ranks[slot] = 0
        self.ranks_host[slot] = 0
