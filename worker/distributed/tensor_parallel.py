"""`TensorParallel`: this process's place in a tensor-parallel group, and the collectives the sharded layers call.

Megatron-style sharding (layers/linear.py, layers/embedding.py, models/llama.py): column-parallel projections
(qkv, gate_up) keep a slice of every fused output, row-parallel ones (o, down) a slice of the input and end in one
all-reduce; attention heads and KV heads are split across ranks (KV heads replicated when fewer than ranks);
embedding and LM head hold a slice of the vocabulary. At world size 1 every helper returns its input untouched,
so a model built with `SINGLE` runs exactly the ops it runs without tensor parallelism.

On CUDA, ranks/group.join_group attaches a faster all-reduce before the model is built
(distributed/all_reduce.py: one-shot over NVLink peer memory for small messages, NCCL above).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    world_size: int = 1
    group: "dist.ProcessGroup | None" = None     # None at world size 1
    # x -> x summed over the ranks (in place or a new tensor); set by ranks/group.join_group on CUDA at world
    # size >= 2 (distributed/all_reduce.py); None: dist.all_reduce
    fast_all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks: x itself at world size 1; in place through dist.all_reduce, or what
        `fast_all_reduce` returns where one is attached (callers use the returned tensor)."""
        if self.world_size == 1:
            return x
        if self.fast_all_reduce is not None:
            return self.fast_all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, cols] -> [rows, world_size * cols], rank r's columns at [r * cols, (r + 1) * cols); x itself
        at world size 1."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """x as rank 0 holds it, on every rank (in place; on a GPU enqueued on the stream, no host wait)."""
        if self.world_size > 1:
            dist.broadcast(x, src=dist.get_global_rank(self.group, 0), group=self.group)
        return x

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's `value` (startup only: on a GPU the host waits for it)."""
        if self.world_size == 1:
            return value
        on_gpu = dist.get_backend(self.group) == "nccl"
        t = torch.tensor([value], dtype=torch.int64, device="cuda" if on_gpu else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def split(self, size: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's even share of `size` items; `what` names them in the error."""
        if size % self.world_size:
            raise ValueError(f"{what} ({size}) must be divisible by tensor parallel size ({self.world_size}).")
        length = size // self.world_size
        return self.rank * length, length

    def kv_heads(self, num_kv_heads: int) -> tuple[int, int]:
        """(first KV head, KV heads) this rank holds: an even share, or, with fewer KV heads than ranks, one head
        that world_size // num_kv_heads consecutive ranks replicate (rank r holds head r * num_kv_heads // world_size).

        Running example: 2 KV heads over 4 ranks: ranks 0, 1 hold head 0; ranks 2, 3 hold head 1."""
        if num_kv_heads >= self.world_size:
            return self.split(num_kv_heads, "Total number of KV heads")
        if self.world_size % num_kv_heads:
            raise ValueError(f"Tensor parallel size ({self.world_size}) must be divisible by the number of KV "
                             f"heads ({num_kv_heads}) when it is larger.")
        return self.rank * num_kv_heads // self.world_size, 1


SINGLE = TensorParallel()


def init_tensor_parallel(rank: int, world_size: int, backend: str, init_method: str) -> TensorParallel:
    """Join the process group (`backend`: "nccl" on GPUs, "gloo" on the CPU; `init_method`: e.g.
    "tcp://127.0.0.1:29500") and return this rank's TensorParallel; SINGLE at world size 1, with no group."""
    if world_size == 1:
        return SINGLE
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return TensorParallel(rank, world_size, dist.group.WORLD)
