"""LoRA shrink over token segments: xa = x @ A^T with each segment's adapter, all slices in one launch.

Semantics:
    R = a.shape[1] // num_slices                      (slot rank: max_lora_rank, or a fully sharded rank's share)
    for i in range(num_segments):
        w = seg_lora_slots[i]; rank = min(ranks[w], R) if w >= 0 else 0
        for t in range(seg_indptr[i], seg_indptr[i+1]), s in range(num_slices), r in range(R):
            xa[t, s*R + r] = x[t] @ a[w, s*R + r]  if r < rank  else  0
    split_k > 1: xa[j, t, s*R + r] = x[t, K_j] @ a[w, s*R + r, K_j] over the j-th of split_k ranges K_j of
    in_dim (float32 partial sums; sum over j gives xa)

Base-only segments (w = -1) and columns past a slot's rank are written as zeros, so a reused `out`
buffer never leaks stale values. Rows of tokens outside every segment are not written.

The grid depends only on host ints (num_tokens, num_segments, max_seg_len, R), so the launch can be
captured in a CUDA graph. Decode batches (one token per segment) get one program per segment and rank
tile; longer segments get one program per m tile that exists, numbered over all segments in turn
(kernels/row_tiles.py), so a graph of a padded token count serves any split into segments. Programs past
the last tile exit after a few loads, and tiles past the rank store zeros without reading x or a.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from worker.kernels.row_tiles_host import TILE_ROWS
from worker.kernels.row_tiles import CHUNK, group_tile, mapped_tile
from worker.kernels.row_tiles_host import max_tiles


@triton.jit
def _tile_matmul(a, b, USE_DOT: tl.constexpr):
    """a: [M, K] @ b: [K, N] in float32; tensor cores when M >= 16, else a broadcast-and-sum (GEMV)."""
    if USE_DOT:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)


@triton.jit(do_not_specialize=["num_segments"])   # k_per_split, a multiple of BLOCK_K, stays specialized: aligned loads
def _lora_shrink_kernel(
        x_ptr, a_ptr, xa_ptr, seg_indptr_ptr, seg_lora_slots_ptr, ranks_ptr, tile_map_ptr,
        in_dim, stride_xm, stride_aw, stride_an, stride_xas, stride_xam, num_segments, k_per_split,
        MAX_RANK: tl.constexpr, NUM_N_TILES: tl.constexpr, SPLIT_K: tl.constexpr, FLAT: tl.constexpr,
        TILE_MAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # program ((m_tile * SPLIT_K + split) * NUM_N_TILES + n_tile, segment, slice) owns the split-th K range's
    # partial xa[split, m tile of the segment, slice cols n tile]; FLAT: program
    # ((tile * SPLIT_K + split) * NUM_N_TILES + n_tile, 0, slice), tiles numbered over all segments in turn
    # (found by search, or read from the host's tile map when TILE_MAP)
    pid = tl.program_id(0)
    n_tile = pid % NUM_N_TILES
    split = (pid // NUM_N_TILES) % SPLIT_K
    s = tl.program_id(2)
    if TILE_MAP:
        seg, m0, seg_end = mapped_tile(tile_map_ptr, seg_indptr_ptr, pid // (NUM_N_TILES * SPLIT_K))
    else:
        seg, m0, seg_end = group_tile(seg_indptr_ptr, num_segments, pid // (NUM_N_TILES * SPLIT_K), FLAT,
                                      BLOCK_M, CHUNK)
    if seg < 0:
        return
    w = tl.load(seg_lora_slots_ptr + seg)
    rank = tl.minimum(tl.where(w >= 0, tl.load(ranks_ptr + tl.maximum(w, 0)), 0), MAX_RANK)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)     # rank index within the slice
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < seg_end
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if n_tile * BLOCK_N < rank:
        mask_n = offs_n < rank
        k_lo = tl.multiple_of(split * k_per_split, 16)
        k_hi = tl.minimum(in_dim, k_lo + k_per_split)
        # x_ptrs: [BLOCK_M, BLOCK_K]; a_ptrs: [BLOCK_K, BLOCK_N] (A rows read transposed)
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + k_lo + offs_k[None, :]
        a_ptrs = (a_ptr + w.to(tl.int64) * stride_aw + (s * MAX_RANK + offs_n)[None, :] * stride_an
                  + k_lo + offs_k[:, None])
        for k0 in range(k_lo, k_hi, BLOCK_K):
            mask_k = offs_k < k_hi - k0
            x_tile = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            a_tile = tl.load(a_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            acc += _tile_matmul(x_tile, a_tile, BLOCK_M >= 16)
            x_ptrs += BLOCK_K
            a_ptrs += BLOCK_K
    xa_ptrs = (xa_ptr + split * stride_xas + offs_m.to(tl.int64)[:, None] * stride_xam
               + (s * MAX_RANK + offs_n)[None, :])
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


@functools.lru_cache(maxsize=None)
def grouped_config(in_dim: int, out_dim: int) -> tuple[dict, int]:
    """(launch keywords, split_k) for rows grouped by adapter in TILE_ROWS-row tiles from the host's tile map
    (chosen with bench.kernels_lora_batch's sweep on an H200, BENCHMARKS.md): K cut into ranges of at least
    1,024 (at most 8) so a batch of few adapters still has programs for every SM; not cut for projections
    whose output is over twice their input (gate_up): their expand, which adds the partial sums up once per
    column tile, has many more tiles to do it in than the shrink saves."""
    split_k = 1 if out_dim > 2 * in_dim else min(8, max(1, in_dim // 1024))
    return dict(BLOCK_M=TILE_ROWS, BLOCK_N=16, BLOCK_K=256, num_warps=4, num_stages=3), split_k


def lora_shrink(x: torch.Tensor, a: torch.Tensor, seg_indptr: torch.Tensor, seg_lora_slots: torch.Tensor,
                ranks: torch.Tensor, num_slices: int, num_segments: int, max_seg_len: int,
                out: torch.Tensor | None = None, config: dict | None = None, split_k: int = 1,
                tile_map: torch.Tensor | None = None) -> torch.Tensor:
    """xa for all slices of one fused projection in one launch; no host-device sync.

    x: [num_tokens, in_dim]; a: [num_slots, num_slices * R, in_dim]; seg_indptr: [>= num_segments + 1] int32;
    seg_lora_slots: [>= num_segments] int32 (-1 = base only); ranks: [num_slots] int32.
    num_segments, max_seg_len: host upper bounds that size the grid and pick the tiles (segments past the
    real ones must have empty token ranges; max_seg_len must be >= every segment's length, and 1 only when
    every segment has at most one token).
    split_k > 1: in_dim is cut into split_k ranges, each program sums one, and xa is returned as float32
    partial sums [split_k, num_tokens, num_slices * R] (their sum is xa; lora_expand adds them up): more
    programs for batches with few row tiles. tile_map: the host's map of the row tiles (row_tiles_host.host_tile_map,
    [>= max_tiles(num_tokens, num_segments, BLOCK_M) * 2] int32, BLOCK_M = config's) instead of a search
    per program; segments longer than one token only.
    out: optional preallocated buffer of xa's shape, returned. config: launch keywords as
    default_config() gives them, None for its choice. -> xa
    """
    num_tokens, in_dim = x.shape
    max_rank = a.shape[1] // num_slices
    assert a.shape[1] == num_slices * max_rank and a.shape[2] == in_dim, "a must be [slots, slices * R, in_dim]"
    assert x.stride(1) == 1 and a.stride(2) == 1, "x and a need a contiguous last dim"
    if split_k > 1:
        shape, dtype = (split_k, num_tokens, num_slices * max_rank), torch.float32
    else:
        shape, dtype = (num_tokens, num_slices * max_rank), x.dtype
    xa = out if out is not None else x.new_empty(shape, dtype=dtype)
    assert xa.shape == shape and xa.dtype == dtype and xa.stride(-1) == 1
    if num_segments == 0 or max_seg_len == 0:
        return xa
    cfg = config or default_config(max_seg_len, in_dim)
    num_n_tiles = triton.cdiv(max_rank, cfg["BLOCK_N"])
    k_per_split = triton.cdiv(triton.cdiv(in_dim, split_k), cfg["BLOCK_K"]) * cfg["BLOCK_K"]
    flat = max_seg_len > 1
    assert flat or tile_map is None, "a tile map is for segments longer than one token"
    if flat:
        grid = (max_tiles(num_tokens, num_segments, cfg["BLOCK_M"]) * split_k * num_n_tiles, 1, num_slices)
    else:
        grid = (split_k * num_n_tiles, num_segments, num_slices)
    _lora_shrink_kernel[grid](
        x, a, xa, seg_indptr, seg_lora_slots, ranks, tile_map if tile_map is not None else seg_indptr,
        in_dim, x.stride(0), a.stride(0), a.stride(1), xa.stride(0) if split_k > 1 else 0, xa.stride(-2),
        num_segments, k_per_split,
        MAX_RANK=max_rank, NUM_N_TILES=num_n_tiles, SPLIT_K=split_k, FLAT=flat, TILE_MAP=tile_map is not None,
        **cfg)
    return xa
