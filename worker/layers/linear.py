"""Linear projections with fused output slices (qkv, gate_up), whole or as one rank's shard of a tensor-parallel
projection (column- or row-parallel, Megatron-style). The base weight is held by a weight scheme
(layers/weights/), the LoRA delta computed by the model's LoRA backend (layers/lora/)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.batch import LoRABatchInfo
from worker.distributed.tensor_parallel import SINGLE, TensorParallel
from worker.kernels.choices import KernelChoices
from worker.layers.lora.deferred import Deferred
from worker.layers.weights.scheme import LinearScheme
from worker.layers.weights.unquantized import UnquantizedLinear
from worker.lora.weights import LoRAWeights


class Linear(nn.Module):
    """y = x @ W^T (+ b), W stacked from `output_sizes` slices (q|k|v or gate|up), held by `scheme`
    (layers/weights/scheme.py; unquantized by default); with adapters, + the LoRA delta of each token's adapter,
    which `kernels.lora` (the LoRA backend, layers/lora/backend.py) computes, in place or deferred to the next
    kernel (layers/lora/deferred.py).

    Tensor parallelism (`column_parallel`, `row_parallel`): this rank holds a shard of the checkpoint's W.
    Column-parallel: rows [start, start + length) of each fused slice (`output_shards[s]`); y is this rank's share of
    every slice, left sharded; LoRA A whole, B sliced like W's rows. Row-parallel: columns `input_shard` of W;
    x @ W_shard^T is a partial sum, and the LoRA expand (A sliced like W's columns, B whole) adds into it before the
    one all-reduce, so the sum over ranks applies each adapter's scaling once; the bias is added on rank 0 only. A
    row-parallel projection built with reduce_results=False returns the partial sum for its caller to reduce
    (Qwen2-MoE's shared expert, summed into the MoE block's one all-reduce: layers/sparse_moe.py).

    Fully sharded LoRA (`shard_lora_fully`, S-LoRA's scheme; vLLM's --fully-sharded-loras), one more collective
    per projection over `lora_tp` for a smaller share of every adapter on each rank. Column-parallel: A's rank
    rows are split too (rank k holds rows [k * R / tp, (k + 1) * R / tp) of each slice, zero-padded to R), each
    rank's shrink gives its part of xa and an all-gather puts the whole xa on every rank before the expand with
    B's rows of the shard. Row-parallel: B's output rows are split too; the shrink's partial xa (A's columns of
    the shard) is all-reduced, and each rank's expand adds its rows of the delta into its partial sum, which the
    base all-reduce completes.
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                 kernels: KernelChoices, scheme: LinearScheme | None = None, *,
                 full_output_sizes: list[int] | None = None, output_shards: list[tuple[int, int]] | None = None,
                 input_shard: tuple[int, int] | None = None, tp: TensorParallel = SINGLE,
                 reduce_results: bool = True):
        """A whole projection; column_parallel and row_parallel build a rank's shard (the geometry arguments)."""
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.slice_offsets = [0]
        for size in output_sizes:
            self.slice_offsets.append(self.slice_offsets[-1] + size)
        self.kernels = kernels
        self.tp: TensorParallel = tp
        # each fused slice's rows in the checkpoint
        self.full_output_sizes = list(full_output_sizes if full_output_sizes is not None else output_sizes)
        self.output_shards = output_shards      # column-parallel: (start, length) per slice
        self.input_shard = input_shard          # row-parallel: (start, length) of in_features
        self.reduce_results = reduce_results    # row-parallel: all-reduce the partial sum here
        # the weight scheme creates its parameters once the geometry above is known (block-wise scales follow it)
        self.scheme = scheme if scheme is not None else UnquantizedLinear()
        self.scheme.create_weights(self, dtype)
        out = self.slice_offsets[-1]
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None
        self.lora: LoRAWeights | None = None   # attached by the LoRA pool when adapters are enabled
        # fully sharded LoRA (shard_lora_fully): the ranks it is split over, and this rank's (start, length) of
        # lora_A's rank rows (column-parallel) or of lora_B's output rows (row-parallel)
        self.lora_tp: TensorParallel = SINGLE
        self.lora_rank_shard: tuple[int, int] | None = None
        self.lora_output_shard: tuple[int, int] | None = None

    @classmethod
    def column_parallel(cls, in_features: int, output_sizes: list[int], shards: list[tuple[int, int]], bias: bool,
                        dtype: torch.dtype, kernels: KernelChoices, scheme: LinearScheme | None = None) -> "Linear":
        """This rank's rows [start, start + length) of each fused slice of `output_sizes` (`shards`, one per
        slice); no collective."""
        return cls(in_features, [length for _, length in shards], bias, dtype, kernels, scheme,
                   full_output_sizes=list(output_sizes), output_shards=list(shards))

    @classmethod
    def row_parallel(cls, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                     kernels: KernelChoices, tp: TensorParallel, reduce_results: bool = True,
                     scheme: LinearScheme | None = None) -> "Linear":
        """This rank's even share of `in_features`; forward all-reduces over `tp` (nothing at world size 1), or,
        with reduce_results=False, returns this rank's partial sum for the caller to all-reduce."""
        start, length = tp.split(in_features, "Input size of a row-parallel projection")
        return cls(length, output_sizes, bias, dtype, kernels, scheme, input_shard=(start, length), tp=tp,
                   reduce_results=reduce_results)

    def full_rows(self) -> int:
        """Output rows of the whole checkpoint projection (every fused slice)."""
        return sum(self.full_output_sizes)

    def full_in_features(self) -> int:
        """Input columns of the whole checkpoint projection."""
        return self.in_features if self.input_shard is None else self.input_shard[1] * self.tp.world_size

    def checkpoint_tensors(self) -> tuple[str, ...]:
        """The checkpoint tensors this projection takes: its scheme's, and its bias."""
        return self.scheme.checkpoint_tensors() + (("bias",) if self.bias is not None else ())

    def full_shape(self, param: str) -> tuple[int, ...]:
        """The shape of the whole checkpoint tensor `param` this module holds a shard of."""
        return (self.full_rows(),) if param == "bias" else self.scheme.full_shape(self, param)

    def load_shard(self, param: str, shard: int | None, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor, this rank's shard of it, into place (shard None: the whole fused tensor, or
        an unfused one; else one output slice): the bias here, everything else through the weight scheme."""
        if param == "bias":
            self.copy_share(self.bias, tensor, shard, columns=False)
        else:
            self.scheme.load(self, param, shard, tensor)

    def finish_loading(self) -> None:
        """Every checkpoint tensor is in: the scheme settles the weight (layers/weights/scheme.py `finish`)."""
        self.scheme.finish(self)

    def copy_share(self, target: torch.Tensor, tensor: torch.Tensor, shard: int | None, columns: bool) -> None:
        """Copy this rank's share of a checkpoint tensor whose rows are the projection's output rows into
        `target`: column-parallel, rows [start, start + length) of each fused slice; row-parallel with
        `columns`, the columns of this rank's input shard. The checkpoint tensor must have the whole projection's
        shape (of fused slice `shard`): a shard cut from a tensor of another shape would load silently."""
        rows = self.full_rows() if shard is None else self.full_output_sizes[shard]
        whole = (rows, self.full_in_features()) if columns else (rows,) + tuple(tensor.shape[1:])
        if tuple(tensor.shape) != whole:
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs model {whole}")
        if self.output_shards is not None:
            if shard is None:
                for s, part in enumerate(tensor.split(self.full_output_sizes)):
                    self.copy_share(target, part, s, columns)
                return
            start, length = self.output_shards[shard]
            tensor = tensor.narrow(0, start, length)
        elif self.input_shard is not None and columns:
            tensor = tensor.narrow(1, *self.input_shard)
        if shard is not None:
            target = target[self.slice_offsets[shard]:self.slice_offsets[shard + 1]]
        if target.shape != tensor.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs model {tuple(target.shape)}")
        target.copy_(tensor)

    def shard_lora_fully(self, tp: TensorParallel, max_rank: int) -> None:
        """Hold this projection's LoRA fully sharded over `tp` (the class docstring), with slots of `max_rank`."""
        rank_shard = tp.split(max_rank, "max_lora_rank with fully sharded LoRA")
        if self.output_shards is not None:
            self.lora_rank_shard = rank_shard
        elif self.input_shard is not None:
            self.lora_output_shard = tp.split(self.slice_offsets[-1], "Output size of a row-parallel projection")
        else:
            raise ValueError("fully sharded LoRA needs a column- or row-parallel projection")
        self.lora_tp = tp

    def lora_slot_shape(self, max_rank: int) -> tuple[int, tuple[int, ...]]:
        """(rows of lora_A per slice, the slices' row offsets in lora_B) that this module's slot holds."""
        if self.lora_rank_shard is not None:
            return self.lora_rank_shard[1], tuple(self.slice_offsets)
        if self.lora_output_shard is not None:
            return max_rank, (0, self.lora_output_shard[1])
        return max_rank, tuple(self.slice_offsets)

    def shard_lora(self, shard: int, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of one fused slice's LoRA: a [rank, in_features], b [slice rows, rank] of the whole
        checkpoint projection -> (a, b) as this module's slot holds them (column-parallel: b's rows of the shard;
        row-parallel: a's columns of the shard; whole otherwise). Fully sharded, also: column-parallel, a's rows
        [k * R / tp, (k + 1) * R / tp) of a zero-padded to the slots' rank R; row-parallel, b's rows of this rank's
        share of the output."""
        if self.output_shards is not None:
            b = b.narrow(0, *self.output_shards[shard])
            if self.lora_rank_shard is not None:
                start, length = self.lora_rank_shard
                a = F.pad(a, (0, 0, 0, max(0, start + length - a.shape[0]))).narrow(0, start, length)
            return a, b
        if self.input_shard is not None:
            a = a.narrow(1, *self.input_shard)
            if self.lora_output_shard is not None:
                b = b.narrow(0, *self.lora_output_shard)
            return a, b
        return a, b

    def forward(self, x: torch.Tensor, lora: LoRABatchInfo | None = None) -> torch.Tensor | Deferred:
        """x: [num_tokens, in_features] -> y: [num_tokens, out_features], or, when the LoRA backend leaves this
        projection's delta to the next kernel, Deferred(y, delta)."""
        bias = self.bias if self.tp.rank == 0 else None     # a row-parallel shard's bias: added once, on rank 0
        if self.lora is None or lora is None or lora.max_rank == 0:
            y = self.scheme.apply(self, x, bias)
        else:
            y = self.kernels.lora.linear(self, x, lora, bias)
        if self.tp.world_size > 1 and self.reduce_results:
            return self.tp.all_reduce(y)      # a partial sum; the backend never defers a row-parallel shard's delta
        return y

    def base(self, x: torch.Tensor, bias: torch.Tensor | None, beside_lora: bool = False) -> torch.Tensor:
        """The base projection alone, as the weight scheme multiplies: x @ W^T (+ bias)."""
        return self.scheme.apply(self, x, bias, beside_lora)

    def whole_xa(self, xa: torch.Tensor) -> torch.Tensor:
        """The shrink's output as the expand reads it; fully sharded, this rank's part of it made whole over the
        ranks: column-parallel, every rank's rank rows of each slice gathered (each rank's part in its place in a
        zero buffer, summed by one all-reduce: the collective with a one-launch kernel, captured in CUDA graphs);
        row-parallel, the partial sums over the input shards added up. xa: [..., num_slices * r] (split-K partials
        included) -> [..., num_slices * R]."""
        tp = self.lora_tp
        if self.lora_output_shard is not None:
            return tp.all_reduce(xa)
        if self.lora_rank_shard is None:
            return xa
        lead, slices = xa.shape[:-1], len(self.slice_offsets) - 1
        whole = xa.new_zeros(*lead, slices, tp.world_size, xa.shape[-1] // slices)
        whole.select(-2, tp.rank).copy_(xa.unflatten(-1, (slices, -1)))
        return tp.all_reduce(whole).flatten(-3)

    def lora_rows(self, y: torch.Tensor) -> torch.Tensor:
        """The columns of y this rank's lora_B writes: its share of the output when fully sharded row-parallel."""
        return y if self.lora_output_shard is None else y.narrow(1, *self.lora_output_shard)
