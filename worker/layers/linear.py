"""Linear projections with fused output slices (qkv, gate_up) and per-token-segment LoRA deltas."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from worker.batch import LoRABatchInfo, LoRAWeights
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


class Linear(nn.Module):
    """y = x @ W^T (+ b), W stacked from `output_sizes` slices (q|k|v or gate|up)."""

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

    def load_shard(self, param: str, shard: int | None, tensor: torch.Tensor) -> None:
        """Copy a checkpoint tensor into the whole parameter (shard None) or into one output slice."""
        target = getattr(self, param)
        if shard is not None:
            target = target[self.slice_offsets[shard]:self.slice_offsets[shard + 1]]
        if target.shape != tensor.shape:
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs model {tuple(target.shape)}")
        target.copy_(tensor)

    def forward(self, x: torch.Tensor, lora_info: LoRABatchInfo | None = None) -> torch.Tensor:
        # x: [num_tokens, in_features] -> y: [num_tokens, out_features]
        if self.lora is None or lora_info is None or lora_info.max_rank == 0:
            return project(x, self.weight, self.bias, self.kernels)
        if x.is_cuda:
            return self._forward_lora_cuda(x, lora_info, defer=False)[0]
        y = F.linear(x, self.weight, self.bias)
        w, info = self.lora, lora_info
        xa = reference.lora_shrink(x, w.a, info.seg_indptr_host, info.weight_indices_host,
                                   info.ranks_host, w.num_slices)
        reference.lora_expand(y, xa, w.b, info.seg_indptr_host, info.weight_indices_host,
                              info.ranks_host, w.scalings, w.slice_offsets)
        return y

    def forward_deferred(self, x: torch.Tensor, lora_info: LoRABatchInfo | None) -> tuple[torch.Tensor,
                                                                                         torch.Tensor | None]:
        """(y, delta): y = x @ W^T (+ b) and, when the LoRA runs beside the GEMM, its output delta
        ([num_tokens, out_features] float32) for the next kernel to add (kernels/fused.py: round(y + delta)
        is what forward() returns). Decode steps only (one token per segment, at most MAX_DEFERRED_TOKENS):
        the decode graphs compile these kernel variants at capture, and a prefill's float32 delta would be
        large. delta is None when forward() applied the LoRA itself: no adapter, the CPU, no side stream, not a
        CUDA-graph batch (LoRABatchInfo.overlap) or not a decode step."""
        w = self.lora
        if (w is None or lora_info is None or lora_info.max_rank == 0 or not x.is_cuda or w.lora_stream is None
                or not lora_info.overlap or lora_info.max_seg_len != 1 or x.shape[0] > MAX_DEFERRED_TOKENS):
            return self.forward(x, lora_info), None
        return self._forward_lora_cuda(x, lora_info, defer=True)

    def _forward_lora_cuda(self, x: torch.Tensor, info: LoRABatchInfo, defer: bool) -> tuple[torch.Tensor,
                                                                                           torch.Tensor | None]:
        """Base GEMM and LoRA on the GPU; returns (y, delta), delta None unless `defer`.

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
            xa = shrink.lora_shrink(x, w.a, info.seg_indptr, info.weight_indices, info.ranks, w.num_slices,
                                    info.num_segments, info.max_seg_len, **shrink_kw)
            if defer:
                delta = torch.empty(x.shape[0], self.slice_offsets[-1], dtype=torch.float32, device=x.device)
                expand.lora_expand(delta, xa, w.b, info.seg_indptr, info.weight_indices, info.ranks, w.scalings,
                                   w.slice_offsets, info.num_segments, info.max_seg_len, accumulate=False,
                                   **expand_kw)
        y = project(x, self.weight, self.bias, self.kernels, beside_lora=side is not None)
        if side is not None:
            torch.cuda.current_stream(x.device).wait_stream(side)
        if not defer:
            expand.lora_expand(y, xa, w.b, info.seg_indptr, info.weight_indices, info.ranks, w.scalings,
                               w.slice_offsets, info.num_segments, info.max_seg_len, **expand_kw)
        return y, delta
