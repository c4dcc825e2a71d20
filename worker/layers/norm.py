"""RMSNorm, computed in float32 and rounded back; optionally fused with the residual add before it."""
from __future__ import annotations

import torch
from torch import nn

from worker.kernels import ops
from worker.kernels.choices import KernelChoices
from worker.layers.lora.deferred import Deferred, split


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, kernels: KernelChoices):
        super().__init__()
        self.eps, self.kernels = eps, kernels
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor | Deferred, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., dim], a projection's output with its LoRA delta still to add (layers/lora/deferred.py) or not.
        With `residual` ([num_tokens, dim]), it becomes x + residual in place and the norm is taken of that sum
        (one launch on the GPU instead of an add and a norm)."""
        x, delta = split(x)
        return ops.rms_norm(x, self.weight, self.eps, residual, delta, self.kernels)
