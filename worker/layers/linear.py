"""Linear projections with fused output slices (qkv, gate_up) and per-token-segment LoRA deltas, whole or as one
rank's shard of a tensor-parallel projection (column- or row-parallel, Megatron-style)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.batch import LoRABatchInfo
from worker.lora.weights import LoRAWeights
from worker.distributed.tensor_parallel import SINGLE, TensorParallel
from worker.kernels import reference
from worker.layers.kernel_choices import KernelChoices


# Most tokens of a decode step whose LoRA delta forward_deferred() hands to the next kernel; larger steps add
# it in place, as the float32 delta grows with the step.
MAX_DEFERRED_TOKENS = 256


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: KernelChoices,
            beside_lora: bool = False) -> torch.Tensor:
    """x @ weight^T (+ bias): on a GPU, at most `kernels.gemv_row_limit` rows go through the small-batch kernel
    (kernels/gemv.py: no split-K, W read once at full bandwidth), up to `kernels.skinny_row_limit` through
    kernels/skinny_gemm.py (tensor-core tiles with W as the wide operand), everything else through cuBLAS.
    beside_lora: LoRA kernels run on a second stream beside this projection; the GEMV then does not launch
    early (kernels/gemv.py)."""
    rows = x.shape[0]
    gemv_rows, skinny_rows = kernels.gemv_row_limit, kernels.skinny_row_limit
    if x.is_cuda and 0 < rows <= max(gemv_rows, skinny_rows) and x.stride(1) == 1 and weight.is_contiguous():
        if rows <= gemv_rows:
            from worker.kernels.gemv import gemv     # Triton; imported here so CPU installs need none
            return gemv(x, weight, bias, programmatic_launch=kernels.programmatic_launch,
                        early_launch=not beside_lora)
        from worker.kernels.skinny_gemm import skinny_gemm
        return skinny_gemm(x, weight, bias, kernels.skinny_counters, programmatic_launch=kernels.programmatic_launch)
    return F.linear(x, weight, bias)


@dataclass
class PendingExpand:
    """A projection's LoRA expand left to the kernel that reads the projection's output next, which adds the
    delta as it loads y (kernels/lora_expand.lora_expand_silu_mul): y is not read and written once more, and
    the expand costs no launch of its own. Batches on the host's tile map only (LoRABatchInfo.tile_map)."""
    xa: torch.Tensor         # the shrink's output (or its float32 split-K partials)
    lora: LoRAWeights
    info: LoRABatchInfo

    def silu_and_mul(self, y: torch.Tensor) -> torch.Tensor:
        """fused.silu_and_mul(y + this gate_up projection's LoRA delta): [T, 2I] -> [T, I]."""
        from worker.kernels.lora_expand import lora_expand_silu_mul
        w, info = self.lora, self.info
        return lora_expand_silu_mul(y, self.xa, w.b, info.seg_indptr, info.seg_lora_slots, info.ranks, w.scalings,
                                    info.tile_map)


class Linear(nn.Module):
    """y = x @ W^T (+ b), W stacked from `output_sizes` slices (q|k|v or gate|up).

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
                 kernels: KernelChoices):
        super().__init__()
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.slice_offsets = [0]
        for size in output_sizes:
            self.slice_offsets.append(self.slice_offsets[-1] + size)
        out = self.slice_offsets[-1]
        self.weight = nn.Parameter(torch.empty(out, in_features, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype), requires_grad=False) if bias else None
        self.lora: LoRAWeights | None = None   # attached by the LoRA pool when adapters are enabled
        self.kernels = kernels
        self.tp: TensorParallel = SINGLE
        self.full_output_sizes = list(output_sizes)      # each fused slice's rows in the checkpoint
        self.output_shards: list[tuple[int, int]] | None = None   # column-parallel: (start, length) per slice
        self.input_shard: tuple[int, int] | None = None           # row-parallel: (start, length) of in_features
        self.reduce_results = True                                 # row-parallel: all-reduce the partial sum here
        # fully sharded LoRA (shard_lora_fully): the ranks it is split over, and this rank's (start, length) of
        # lora_A's rank rows (column-parallel) or of lora_B's output rows (row-parallel)
        self.lora_tp: TensorParallel = SINGLE
        self.lora_rank_shard: tuple[int, int] | None = None
        self.lora_output_shard: tuple[int, int] | None = None

    @classmethod
    def column_parallel(cls, in_features: int, output_sizes: list[int], shards: list[tuple[int, int]], bias: bool,
                        dtype: torch.dtype, kernels: KernelChoices) -> "Linear":
        """This rank's rows [start, start + length) of each fused slice of `output_sizes` (`shards`, one per
        slice); no collective."""
        linear = cls(in_features, [length for _, length in shards], bias, dtype, kernels)
        linear.full_output_sizes, linear.output_shards = list(output_sizes), list(shards)
        return linear

    @classmethod
    def row_parallel(cls, in_features: int, output_sizes: list[int], bias: bool, dtype: torch.dtype,
                     kernels: KernelChoices, tp: TensorParallel, reduce_results: bool = True) -> "Linear":
        """This rank's even share of `in_features`; forward all-reduces over `tp` (nothing at world size 1), or,
        with reduce_results=False, returns this rank's partial sum for the caller to all-reduce."""
        start, length = tp.split(in_features, "Input size of a row-parallel projection")
        linear = cls(length, output_sizes, bias, dtype, kernels)
        linear.tp, linear.input_shard, linear.reduce_results = tp, (start, length), reduce_results
        return linear

    def full_shape(self, param: str) -> tuple[int, ...]:
        """The shape of the whole checkpoint tensor `param` (weight or bias) this module holds a shard of."""
        in_features = self.in_features if self.input_shard is None else self.input_shard[1] * self.tp.world_size
        shape = (sum(self.full_output_sizes), in_features)
        return shape if param == "weight" else shape[:1]

    def load_shard(self, param: str, shard: int | None, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor, this rank's shard of it, into the whole parameter (shard None: the whole
        fused tensor, or an unfused one) or into one output slice."""
        if self.output_shards is not None:
            if shard is None:
                for s, part in enumerate(tensor.split(self.full_output_sizes)):
                    self.load_shard(param, s, part)
                return
            start, length = self.output_shards[shard]
            tensor = tensor.narrow(0, start, length)
        elif self.input_shard is not None and param == "weight":
            tensor = tensor.narrow(1, *self.input_shard)
        target = getattr(self, param)
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

    def forward(self, x: torch.Tensor, lora_info: LoRABatchInfo | None = None) -> torch.Tensor:
        # x: [num_tokens, in_features] -> y: [num_tokens, out_features]
        if self.tp.world_size == 1:
            return self._forward(x, lora_info, self.bias)
        y = self._forward(x, lora_info, self.bias if self.tp.rank == 0 else None)   # a partial sum
        return self.tp.all_reduce(y) if self.reduce_results else y

    def _forward(self, x: torch.Tensor, lora_info: LoRABatchInfo | None, bias: torch.Tensor | None) -> torch.Tensor:
        if self.lora is None or lora_info is None or lora_info.max_rank == 0:
            return project(x, self.weight, bias, self.kernels)
        if x.is_cuda:
            return self._forward_lora_cuda(x, lora_info, defer=False, bias=bias)[0]
        y = F.linear(x, self.weight, bias)
        w, info = self.lora, lora_info
        xa = reference.lora_shrink(x, w.a, info.seg_indptr_host, info.seg_lora_slots_host,
                                   info.ranks_host, w.num_slices)
        reference.lora_expand(self._lora_rows(y), self._whole_xa(xa), w.b, info.seg_indptr_host,
                              info.seg_lora_slots_host, info.ranks_host, w.scalings, w.slice_offsets)
        return y

    def _whole_xa(self, xa: torch.Tensor) -> torch.Tensor:
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

    def _lora_rows(self, y: torch.Tensor) -> torch.Tensor:
        """The columns of y this rank's lora_B writes: its share of the output when fully sharded row-parallel."""
        return y if self.lora_output_shard is None else y.narrow(1, *self.lora_output_shard)

    def forward_deferred(self, x: torch.Tensor, lora_info: LoRABatchInfo | None, silu_and_mul_next: bool = False
                         ) -> tuple[torch.Tensor, torch.Tensor | PendingExpand | None]:
        """(y, delta): y = x @ W^T (+ b) and, when the LoRA runs beside the GEMM, its output delta
        ([num_tokens, out_features] float32) for the next kernel to add (kernels/fused.py: round(y + delta)
        is what forward() returns). Decode steps only (one token per segment, at most MAX_DEFERRED_TOKENS):
        the decode graphs compile these kernel variants at capture, and a prefill's float32 delta would be
        large. delta is None when forward() applied the LoRA itself: no adapter, the CPU, no side stream, not a
        CUDA-graph batch (LoRABatchInfo.overlap), not a decode step, a row-parallel shard at world size > 1 (its
        delta would be a partial sum, to be added before the all-reduce), or fully sharded LoRA (a collective
        between its shrink and expand).

        silu_and_mul_next (gate_up, whose caller takes SiLU-and-mul of y next): on a batch with a tile map and
        KernelChoices.lora_expand_in_consumers, delta is a PendingExpand instead, the expand left for that
        kernel to run (PendingExpand.silu_and_mul)."""
        w = self.lora
        if w is None or lora_info is None or lora_info.max_rank == 0 or not x.is_cuda:
            return self.forward(x, lora_info), None
        if self.lora_tp.world_size > 1:       # fully sharded: a collective between shrink and expand
            return self.forward(x, lora_info), None
        if silu_and_mul_next and lora_info.tile_map is not None and self.kernels.lora_expand_in_consumers:
            assert self.input_shard is None, "a row-parallel shard's expand belongs before its all-reduce"
            return self._forward_lora_cuda(x, lora_info, defer=False, bias=self.bias, pending=True)
        if (self.tp.world_size > 1 or w.lora_stream is None or not lora_info.overlap or lora_info.max_seg_len != 1
                or x.shape[0] > MAX_DEFERRED_TOKENS):
            return self.forward(x, lora_info), None
        return self._forward_lora_cuda(x, lora_info, defer=True, bias=self.bias)

    def _forward_lora_cuda(self, x: torch.Tensor, info: LoRABatchInfo, defer: bool, bias: torch.Tensor | None,
                           pending: bool = False) -> tuple[torch.Tensor, torch.Tensor | PendingExpand | None]:
        """Base GEMM (with `bias`) and LoRA on the GPU; returns (y, delta), delta None unless `defer` (the
        float32 delta) or `pending` (no expand here: a PendingExpand for the next kernel).

        The base GEMM and the LoRA shrink both read only x, so with a side stream (CUDA-graph batches only:
        LoRABatchInfo.overlap) the shrink runs there while the GEMM runs. Deferred (decode steps), the expand
        runs there too, writing the float32 delta (write mode: zeros on base-only rows), and only the join is
        left on the critical path; otherwise the expand adds into y after the join. Without a side stream
        everything runs in line.

        Stream order keeps the buffers safe: the side stream starts after everything already queued here,
        so a shrink cannot overwrite an xa an earlier expand still reads, and this stream waits for the
        side stream before anything after it can reuse x. A deferred delta is allocated on the side stream
        and read here: the caller keeps it until its consumer is queued, and any later allocation on the
        side stream follows a fork from after that point. Inside graph capture the fork and join are edges."""
        from worker.kernels import lora_expand as expand   # Triton; imported here so CPU installs need none
        from worker.kernels import lora_shrink as shrink
        w = self.lora
        shrink_kw, expand_kw = {}, {}
        if info.tile_map is not None:     # a decode graph's rows grouped by adapter
            shrink_cfg, split_k = shrink.grouped_config(x.shape[1], self.slice_offsets[-1])
            shrink_kw = dict(config=shrink_cfg, split_k=split_k, tile_map=info.tile_map)
            expand_kw = dict(config=expand.grouped_config(w.b.shape[2]), tile_map=info.tile_map)
        side = w.lora_stream if info.overlap else None
        assert side is not None or not defer
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(x.device))
        delta = None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            xa = shrink.lora_shrink(x, w.a, info.seg_indptr, info.seg_lora_slots, info.ranks, w.num_slices,
                                    info.num_segments, info.max_seg_len, **shrink_kw)
            if defer:
                delta = torch.empty(x.shape[0], self.slice_offsets[-1], dtype=torch.float32, device=x.device)
                expand.lora_expand(delta, xa, w.b, info.seg_indptr, info.seg_lora_slots, info.ranks, w.scalings,
                                   w.slice_offsets, info.num_segments, info.max_seg_len, accumulate=False,
                                   **expand_kw)
        y = project(x, self.weight, bias, self.kernels, beside_lora=side is not None)
        if side is not None:
            torch.cuda.current_stream(x.device).wait_stream(side)
        if pending:
            return y, PendingExpand(xa, w, info)
        if not defer:
            expand.lora_expand(self._lora_rows(y), self._whole_xa(xa), w.b, info.seg_indptr, info.seg_lora_slots,
                               info.ranks, w.scalings, w.slice_offsets, info.num_segments, info.max_seg_len,
                               **expand_kw)
        return y, delta
