"""SiLU-and-mul: the gated MLP's activation of the gate_up projection's output."""
from __future__ import annotations

import torch
from torch import nn

from worker.kernels import ops
from worker.kernels.choices import KernelChoices
from worker.layers.lora.deferred import Deferred, split


class SiluAndMul(nn.Module):
    def __init__(self, kernels: KernelChoices):
        super().__init__()
        self.kernels = kernels

    def forward(self, gate_up: torch.Tensor | Deferred) -> torch.Tensor:
        """gate_up: [num_tokens, 2I] (gate | up), with its LoRA delta still to add or not -> silu(gate) * up [T, I]."""
        x, delta = split(gate_up)
        return ops.silu_and_mul(x, delta, self.kernels)
