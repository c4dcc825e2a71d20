"""Token embedding and the LM head (which may share the embedding's weight), each holding one rank's slice of the
vocabulary under tensor parallelism (vocab-parallel)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.distributed.tensor_parallel import SINGLE, TensorParallel
from worker.kernels.choices import KernelChoices
from worker.kernels.ops import linear as project


class VocabShard(nn.Module):
    """Rows [vocab_start, vocab_start + rows) of a [vocab_size, hidden] checkpoint tensor, rows = ceil(vocab_size /
    world_size); the last rank's rows past vocab_size are zero padding.

    Running example: vocab 10 over 4 ranks: 3 rows each, rank 3 holds token 9 and two padding rows."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TensorParallel,
                 tied_to: "VocabShard | None" = None):
        super().__init__()
        self.vocab_size, self.hidden_size, self.tp = vocab_size, hidden_size, tp
        rows = -(-vocab_size // tp.world_size)
        self.vocab_start = tp.rank * rows
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype), requires_grad=False)

    def full_shape(self, param: str) -> tuple[int, int]:
        return self.vocab_size, self.hidden_size

    def load_shard(self, param: str, shard: int | None, tensor: torch.Tensor) -> None:
        """This rank's rows of the checkpoint's [vocab_size, hidden] tensor; padding rows zeroed."""
        if tuple(tensor.shape) != self.full_shape(param):
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs model {self.full_shape(param)}")
        real = max(0, min(self.vocab_size - self.vocab_start, self.weight.shape[0]))
        self.weight[:real].copy_(tensor[self.vocab_start:self.vocab_start + real])
        self.weight[real:].zero_()


class Embedding(VocabShard):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tp: TensorParallel = SINGLE):
        super().__init__(vocab_size, hidden_size, dtype, tp)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(input_ids, self.weight)    # [num_tokens, hidden]
        local = input_ids - self.vocab_start                # [num_tokens]; ids of other ranks give zero rows
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(h.masked_fill_(outside[:, None], 0))


class LMHead(VocabShard):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, tied_to: Embedding | None,
                 kernels: KernelChoices, tp: TensorParallel = SINGLE):
        super().__init__(vocab_size, hidden_size, dtype, tp, tied_to)
        self.kernels = kernels

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = project(hidden, self.weight, None, self.kernels)      # [num_rows, vocab rows of this rank]
        if self.tp.world_size == 1:
            return logits
        return self.tp.all_gather(logits)[:, :self.vocab_size]         # [num_rows, vocab]
