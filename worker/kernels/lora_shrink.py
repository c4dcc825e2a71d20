"""LoRA shrink over token segments: xa = x @ A^T with each segment's adapter, all slices in one launch.

Semantics:
    R = a.shape[1] // num_slices                      (slot rank, = max_lora_rank)
    for i in range(num_segments):
        w = weight_indices[i]; rank = ranks[w] if w >= 0 else 0
        for t in range(seg_indptr[i], seg_indptr[i+1]), s in range(num_slices), r in range(R):
            xa[t, s*R + r] = x[t] @ a[w, s*R + r]  if r < rank  else  0

Base-only segments (w = -1) and columns past a slot's rank are written as zeros, so a reused `out`
buffer never leaks stale values. Rows of tokens outside every segment are not written.

The grid depends only on host ints (num_tokens, num_segments, max_seg_len, R), so the launch can be
captured in a CUDA graph. Decode batches (one token per segment) get one program per segment and rank
tile; longer segments get one program per m tile that exists, numbered over all segments in turn
(kernels/tiles.py), so a graph of a padded token count serves any split into segments. Programs past
the last tile exit after a few loads, and tiles past the rank store zeros without reading x or a.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from worker.kernels.tiles import CHUNK, group_tile, max_tiles


@triton.jit
def _tile_matmul(a, b, USE_DOT: tl.constexpr):
    """a: [M, K] @ b: [K, N] in float32; tensor cores when M >= 16, else a broadcast-and-sum (GEMV)."""
    if USE_DOT:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit(do_not_specialize=["num_segments"])
def _lora_shrink_kernel(
        x_ptr, a_ptr, xa_ptr, seg_indptr_ptr, weight_indices_ptr, ranks_ptr,
        in_dim, stride_xm, stride_aw, stride_an, stride_xam, num_segments,
        MAX_RANK: tl.constexpr, NUM_N_TILES: tl.constexpr, FLAT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program (m_tile * NUM_N_TILES + n_tile, segment, slice) owns xa[m tile of the segment, slice cols n tile];
    # FLAT: program (tile * NUM_N_TILES + n_tile, 0, slice), tile numbering all segments' m tiles in turn
    n_tile = tl.program_id(0) % NUM_N_TILES
    s = tl.program_id(2)
    seg, m0, seg_end = group_tile(seg_indptr_ptr, num_segments, tl.program_id(0) // NUM_N_TILES, FLAT, BLOCK_M,
                                  CHUNK)
    if seg < 0:
        return
    w = tl.load(weight_indices_ptr + seg)
    rank = tl.where(w >= 0, tl.load(ranks_ptr + tl.maximum(w, 0)), 0)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)     # rank index within the slice
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < seg_end
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if n_tile * BLOCK_N < rank:
        mask_n = offs_n < rank
        # x_ptrs: [BLOCK_M, BLOCK_K]; a_ptrs: [BLOCK_K, BLOCK_N] (A rows read transposed)
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        a_ptrs = (a_ptr + w.to(tl.int64) * stride_aw + (s * MAX_RANK + offs_n)[None, :] * stride_an
                  + offs_k[:, None])
        for k0 in range(0, in_dim, BLOCK_K):
            mask_k = offs_k < in_dim - k0
            x_tile = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            a_tile = tl.load(a_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc += _tile_matmul(x_tile, a_tile, BLOCK_M >= 16)
            x_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
    xa_ptrs = xa_ptr + offs_m.to(tl.int64)[:, None] * stride_xam + (s * MAX_RANK + offs_n)[None, :]
    tl.store(xa_ptrs, acc.to(xa_ptr.dtype.element_ty), mask=mask_m[:, None] & (offs_n < MAX_RANK)[None, :])


@functools.lru_cache(maxsize=None)     # called per launch; eager steps are bound by host time
def default_config(max_seg_len: int, in_dim: int) -> dict:
    """Launch keywords (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), chosen with the kernels_lora bench's
    sweep (BENCHMARKS.md, Kernels).

    One token per segment: a GEMV over 2 rank rows per program with long K steps (parallelism comes
    from the rank axis); short segments: skinny tensor-core tiles with long K steps; prefill: 64-token tiles.
    """
    k_cap = max(16, triton.next_power_of_2(in_dim))
    if max_seg_len == 1:
        return dict(BLOCK_M=1, BLOCK_N=2, BLOCK_K=min(2048, k_cap), num_warps=4, num_stages=3)
    if max_seg_len <= 16:
        return dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=min(512, k_cap), num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=min(256, k_cap), num_warps=4, num_stages=3)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, seg_indptr: torch.Tensor, weight_indices: torch.Tensor,
                ranks: torch.Tensor, num_slices: int, num_segments: int, max_seg_len: int,
                out: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """xa for all slices of one fused projection in one launch; no host-device sync.

    x: [num_tokens, in_dim]; a: [num_slots, num_slices * R, in_dim]; seg_indptr: [>= num_segments + 1] int32;
    weight_indices: [>= num_segments] int32 (-1 = base only); ranks: [num_slots] int32.
    num_segments, max_seg_len: host upper bounds that size the grid and pick the tiles (segments past the
    real ones must have empty token ranges; max_seg_len must be >= every segment's length, and 1 only when
    every segment has at most one token).
    out: optional preallocated [num_tokens, num_slices * R] buffer, returned. config: launch keywords as
    default_config() gives them, None for its choice. -> xa
    """
    num_tokens, in_dim = x.shape
    max_rank = a.shape[1] // num_slices
    assert a.shape[1] == num_slices * max_rank and a.shape[2] == in_dim, "a must be [slots, slices * R, in_dim]"
    assert x.stride(1) == 1 and a.stride(2) == 1, "x and a need a contiguous last dim"
    xa = out if out is not None else x.new_empty(num_tokens, num_slices * max_rank)
    assert xa.shape == (num_tokens, num_slices * max_rank) and xa.stride(1) == 1
    if num_segments == 0 or max_seg_len == 0:
        return xa
    cfg = config or default_config(max_seg_len, in_dim)
    num_n_tiles = triton.cdiv(max_rank, cfg["BLOCK_N"])
    flat = max_seg_len > 1
    if flat:
        grid = (max_tiles(num_tokens, num_segments, cfg["BLOCK_M"]) * num_n_tiles, 1, num_slices)
    else:
        grid = (num_n_tiles, num_segments, num_slices)
    _lora_shrink_kernel[grid](
        x, a, xa, seg_indptr, weight_indices, ranks,
        in_dim, x.stride(0), a.stride(0), a.stride(1), xa.stride(0), num_segments,
        MAX_RANK=max_rank, NUM_N_TILES=num_n_tiles, FLAT=flat, **cfg)
    return xa
