"""A projection's GEMM with the LoRA expand in its epilogue: y = x @ W^T (+ bias) + each segment's delta, one store.

Semantics:
    R = b.shape[2]                                    (slot rank, = max_lora_rank)
    for i in range(num_segments), t in range(seg_indptr[i], seg_indptr[i+1]):
        y[t, :] = x[t, :] @ w^T (+ bias)
        if (v := seg_lora_slots[i]) >= 0:
            for s in range(num_slices), o in range(slice_offsets[s], slice_offsets[s+1]):
                y[t, o] += scalings[v, s] * sum(xa[t, s*R + r] * b[v, o, r] for r in range(ranks[v]))
    (the base product and the delta summed in float32, rounded once into y's dtype)

Against the base GEMM followed by lora_expand: y is stored once and never read back, and the delta is added to the
unrounded base product. The tiles are the segments' row tiles (kernels/row_tiles.py, or the host's tile map of a
graph whose rows are grouped by adapter), so each tile's rows share one adapter and its delta is one more small
tensor-core product per slice it meets, [BLOCK_M, R] x [R, BLOCK_N], before the store. Rows that lie in no segment
are not written: every row must lie in one (the model's batches and graph padding do). xa is lora_shrink's.

BLOCK_M is at least 16 (tensor-core tiles): the path for steps whose segments are longer than one row, or whose
decode rows are grouped by adapter; a decode step of one row per segment keeps its GEMV and lora_expand.
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from worker.kernels.lora_expand import add_adapter_delta, program_tile
from worker.kernels.row_tiles_host import TILE_ROWS, max_tiles


@triton.jit(do_not_specialize=["num_segments"])
def _lora_gemm_kernel(
        y_ptr, x_ptr, w_ptr, bias_ptr, xa_ptr, b_ptr, seg_indptr_ptr, seg_lora_slots_ptr, ranks_ptr, scalings_ptr,
        slice_offsets_ptr, tile_map_ptr, in_dim, out_dim, stride_ym, stride_xm, stride_wn, stride_xam, stride_bw,
        stride_bo, stride_sw, num_segments,
        SLICE_OFFSETS: tl.constexpr, NUM_SLICES: tl.constexpr, MAX_RANK: tl.constexpr, NUM_N_TILES: tl.constexpr,
        TILE_MAP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    # the K loop is the base product; the tile's adapter delta follows it into the same float32 accumulator
    n0, seg, m0, seg_end = program_tile(tile_map_ptr, seg_indptr_ptr, num_segments, NUM_N_TILES, True, TILE_MAP,
                                        BLOCK_M, BLOCK_N)
    if seg < 0:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < seg_end
    mask_n = offs_n < out_dim
    # x_ptrs: [BLOCK_M, BLOCK_K]; w_ptrs: [BLOCK_K, BLOCK_N] (W's rows read transposed)
    x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        mask_k = offs_k < in_dim - k0
        x_tile = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w_tile = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(x_tile, w_tile, acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    v = tl.load(seg_lora_slots_ptr + seg)
    if v >= 0:
        acc = add_adapter_delta(acc, xa_ptr, b_ptr, ranks_ptr, scalings_ptr, slice_offsets_ptr, v, offs_m, mask_m, n0,
                                0, stride_xam, stride_bw, stride_bo, stride_sw, SLICE_OFFSETS, NUM_SLICES, MAX_RANK, 1,
                                BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_R)
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@functools.lru_cache(maxsize=None)
def default_config(max_seg_len: int, grouped: bool) -> dict:
    """Launch keywords (BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, num_warps, num_stages). Rows grouped by adapter in a
    decode graph take its 16-row tiles; longer segments 64-row tiles. Not yet tuned on a GPU against cuBLAS."""
    if grouped or max_seg_len <= 16:
        return dict(BLOCK_M=TILE_ROWS, BLOCK_N=128, BLOCK_K=64, BLOCK_R=16, num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, BLOCK_R=16, num_warps=4, num_stages=3)


def lora_gemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, xa: torch.Tensor, b: torch.Tensor,
              seg_indptr: torch.Tensor, seg_lora_slots: torch.Tensor, ranks: torch.Tensor, scalings: torch.Tensor,
              slice_offsets: Sequence[int] | torch.Tensor, num_segments: int, max_seg_len: int,
              out: torch.Tensor | None = None, config: dict | None = None,
              tile_map: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ w^T (+ bias) with every segment's LoRA delta, in one launch (module docstring); no host-device sync.

    x: [num_tokens, in_dim]; w: [out_dim, in_dim]; bias: [out_dim] or None; xa: [num_tokens, num_slices * R]
    (lora_shrink's, one partial); b: [num_slots, out_dim, R]; seg_indptr, seg_lora_slots, ranks, scalings,
    slice_offsets, num_segments, max_seg_len, tile_map: as lora_expand takes them. out: [num_tokens, out_dim] to
    write (rows in no segment keep what they hold), or None for a new tensor of x's dtype.
    """
    num_tokens, in_dim = x.shape
    out_dim, max_rank = w.shape[0], b.shape[2]
    if isinstance(slice_offsets, torch.Tensor):
        offsets_ptr, offsets_const, num_slices = slice_offsets, None, slice_offsets.numel() - 1
    else:
        offsets_ptr, offsets_const, num_slices = None, tuple(int(o) for o in slice_offsets), len(slice_offsets) - 1
    assert w.shape[1] == in_dim and b.shape[1] == out_dim, "x, w and b disagree"
    assert xa.shape == (num_tokens, num_slices * max_rank), "xa: one partial, num_slices * R columns"
    assert x.stride(1) == 1 and w.stride(1) == 1 and xa.stride(1) == 1 and b.stride(2) == 1, "contiguous last dims"
    assert scalings.shape == (b.shape[0], num_slices) and scalings.stride(1) == 1
    y = torch.empty(num_tokens, out_dim, dtype=x.dtype, device=x.device) if out is None else out
    assert y.shape == (num_tokens, out_dim) and y.stride(1) == 1
    if num_segments == 0 or max_seg_len == 0:
        return y
    cfg = config or default_config(max_seg_len, tile_map is not None)
    assert tile_map is None or cfg["BLOCK_M"] == TILE_ROWS, "the host's tile map is cut in TILE_ROWS-row tiles"
    num_n_tiles = triton.cdiv(out_dim, cfg["BLOCK_N"])
    grid = (max_tiles(num_tokens, num_segments, cfg["BLOCK_M"]) * num_n_tiles,)
    _lora_gemm_kernel[grid](
        y, x, w, bias if bias is not None else w, xa, b, seg_indptr, seg_lora_slots, ranks, scalings, offsets_ptr,
        tile_map if tile_map is not None else seg_indptr, in_dim, out_dim, y.stride(0), x.stride(0), w.stride(0),
        xa.stride(0), b.stride(0), b.stride(1), scalings.stride(0), num_segments,
        SLICE_OFFSETS=offsets_const, NUM_SLICES=num_slices, MAX_RANK=max_rank, NUM_N_TILES=num_n_tiles,
        TILE_MAP=tile_map is not None, HAS_BIAS=bias is not None, **cfg)
    return y
