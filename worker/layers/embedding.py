"""Token embedding and the LM head (which may share the embedding's weight)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.layers.kernel_choices import KernelChoices
from worker.layers.linear import project


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)        # [num_tokens, hidden]


class LMHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tied_to: Embedding | None,
                 kernels: KernelChoices):
        super().__init__()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        self.kernels = kernels

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return project(hidden, self.weight, None, self.kernels)   # [num_rows, vocab]
