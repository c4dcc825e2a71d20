"""RMSNorm, computed in float32 and rounded back; optionally fused with the residual add before it."""
from __future__ import annotations

import torch
from torch import nn

from worker.kernels import reference
from worker.layers.kernel_choices import KernelChoices


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, kernels: KernelChoices):
        super().__init__()
        self.eps, self.kernels = eps, kernels
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                delta: torch.Tensor | None = None) -> torch.Tensor:
        """x: [..., dim]. With `residual` ([num_tokens, dim]), it becomes x + residual in place and the
        norm is taken of that sum (one launch on the GPU instead of an add and a norm). `delta`: the LoRA
        output of the projection that made x, still to be added (Linear.forward_deferred; CUDA only)."""
        if x.is_cuda:   # Triton kernels; imported here so CPU-only installs need no triton
            from worker.kernels import fused
            return fused.rms_norm(x, self.weight, self.eps, residual, delta, self.kernels.programmatic_launch)
        assert delta is None, "deferred LoRA deltas exist on CUDA only"
        return reference.rms_norm(x, self.weight, self.eps, residual)
