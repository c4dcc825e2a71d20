"""The Triton LoRA backend: the base GEMM, then a shrink (kernels/lora_shrink.py: xa = x @ A[slot]^T) and an
expand (kernels/lora_expand.py: y += scaling * xa @ B[slot]^T), one launch each for all the step's segments;
expert LoRA inside the fused MoE kernels (kernels/moe_lora.py).

- In line: eager steps (prefills past the graph sizes, prompt logprobs, --enforce-eager), where the host's
  launches bound the step and a second stream would only add to them.
- Beside the GEMM (CUDA-graph batches, LoRABatchInfo.overlap, with the pool's side stream): the base GEMM and
  the shrink both read only x, so the shrink runs on the side stream while the GEMM runs.
- Deferred (decode graphs: one token per segment, at most MAX_DEFERRED_TOKENS): the expand runs there too and
  writes a float32 delta instead of adding into y; the projection returns `Deferred(y, delta)` and the next
  kernel adds it (layers/lora/deferred.py). Only the join is left on the critical path.
- Grouped rows (LoRABatchInfo.tile_map, from the input builder): each 16-row tile of one adapter's rows reads
  that adapter's A and B once; the shrink is split over K into float32 partial sums that the expand adds up.

Stream order keeps the buffers safe: the side stream starts after everything already queued on the compute
stream, so a shrink cannot overwrite an xa an earlier expand still reads, and the compute stream waits for the
side stream before anything after it can reuse x. A deferred delta is allocated on the side stream and read on
the compute stream: the consumer is queued before any later allocation on the side stream, which follows a fork
from after that point. Inside graph capture the fork and join are edges.
"""
from __future__ import annotations

import contextlib

import torch

from worker.batch import LoRABatchInfo
from worker.layers.lora.backend import LoRABackend, register
from worker.layers.lora.deferred import Deferred
from worker.layers.lora.reference_backend import ReferenceLoRA

# Most tokens of a decode step whose LoRA delta is left to the next kernel; larger steps add it in place, as the
# float32 delta grows with the step.
MAX_DEFERRED_TOKENS = 256


@register
class TritonLoRA(LoRABackend):
    name = "triton"
    device_type = "cuda"

    def linear(self, layer, x: torch.Tensor, info: LoRABatchInfo,
               bias: torch.Tensor | None) -> torch.Tensor | Deferred:
        from worker.kernels import lora_expand as expand   # Triton; imported here so CPU installs need none
        from worker.kernels import lora_shrink as shrink
        w = layer.lora
        side = w.lora_stream if info.overlap else None
        defer = side is not None and self._may_defer(layer, x, info)
        shrink_kw, expand_kw = {}, {}
        if info.tile_map is not None:     # a graph's rows grouped by adapter
            shrink_cfg, split_k = shrink.grouped_config(x.shape[1], layer.slice_offsets[-1])
            shrink_kw = dict(config=shrink_cfg, split_k=split_k, tile_map=info.tile_map)
            expand_kw = dict(config=expand.grouped_config(w.b.shape[2]), tile_map=info.tile_map)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(x.device))
        delta = None
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            xa = shrink.lora_shrink(x, w.a, info.seg_indptr, info.seg_lora_slots, info.ranks, w.num_slices,
                                    info.num_segments, info.max_seg_len, **shrink_kw)
            if defer:
                delta = torch.empty(x.shape[0], layer.slice_offsets[-1], dtype=torch.float32, device=x.device)
                expand.lora_expand(delta, xa, w.b, info.seg_indptr, info.seg_lora_slots, info.ranks, w.scalings,
                                   w.slice_offsets, info.num_segments, info.max_seg_len, accumulate=False,
                                   **expand_kw)
        y = layer.base(x, bias, beside_lora=side is not None)
        if side is not None:
            torch.cuda.current_stream(x.device).wait_stream(side)
        if defer:
            return Deferred(y, delta)
        expand.lora_expand(layer.lora_rows(y), layer.whole_xa(xa), w.b, info.seg_indptr, info.seg_lora_slots,
                           info.ranks, w.scalings, w.slice_offsets, info.num_segments, info.max_seg_len, **expand_kw)
        return y

    @staticmethod
    def _may_defer(layer, x: torch.Tensor, info: LoRABatchInfo) -> bool:
        """A decode step's delta may wait for the next kernel, unless the projection is a row-parallel shard at
        world size > 1 (its delta joins the partial sum before the all-reduce) or fully sharded (a collective
        between its shrink and expand)."""
        return (info.max_seg_len == 1 and x.shape[0] <= MAX_DEFERRED_TOKENS and layer.tp.world_size == 1
                and layer.lora_tp.world_size == 1)

    def experts(self, block, x: torch.Tensor, logits: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
        if block.workspace is None:      # before the model runner attaches the fused path's buffers
            return ReferenceLoRA().experts(block, x, logits, info)
        from worker.kernels.fused_moe import fused_moe      # Triton; imported here so CPU installs need none
        from worker.kernels.moe_lora import MoELoRAStep
        # the kernels' grids follow max_rank; a CUDA graph replays them for any adapter mix, so it is captured at
        # the slots' R (a capture step's own ranks are those of whatever the slots held then)
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        max_rank = block.lora.down_a.shape[2] if capturing else info.max_rank
        step = MoELoRAStep(block.lora, info.token_lora_slots, info.ranks, max_rank, block.lora_workspace)
        m = block.experts.matrices()
        return fused_moe(x, logits, m.gate_up, m.down, block.top_k, block.renormalize, block.float32_weights,
                         block.workspace, lora=step, programmatic_launch=block.kernels.programmatic_launch,
                         gate_up_scale=m.gate_up_scale, down_scale=m.down_scale, block=m.block)
