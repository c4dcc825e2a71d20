"""A projection's output whose LoRA delta is still to be added, by the kernel that reads it next.

In a decode graph the Triton LoRA backend (layers/lora/triton_backend.py) runs a projection's shrink and expand
on a side stream beside its base GEMM and writes the expand's output as a float32 delta instead of adding it into
y; the consumer adds it as it loads y (kernels/fused.py: round(y + delta), exactly what the expand would have
written), so only the join is left on the critical path. The consumers take a `Deferred` wherever they take a
projection's output (layers/norm.py, layers/attention.py, layers/activation.py, layers/sparse_moe.py), so
models pass a projection's output along without looking inside it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Deferred:
    y: torch.Tensor          # [num_tokens, out_features]: the base projection (with its bias)
    delta: torch.Tensor      # [num_tokens, out_features] float32: the LoRA output still to be added

    def __getitem__(self, rows) -> Deferred:
        return Deferred(self.y[rows], self.delta[rows])

    def resolve(self) -> torch.Tensor:
        """round(y + delta): the projection's output as the in-line expand writes it."""
        return (self.y.float() + self.delta).to(self.y.dtype)


def split(output: torch.Tensor | Deferred) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, its deferred delta or None) of a projection's output."""
    return (output.y, output.delta) if isinstance(output, Deferred) else (output, None)


def resolved(output: torch.Tensor | Deferred) -> torch.Tensor:
    """A projection's output with its delta added, for a consumer that cannot add it as it loads."""
    return output.resolve() if isinstance(output, Deferred) else output
