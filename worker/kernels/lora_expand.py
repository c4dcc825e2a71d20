"""LoRA expand over token segments: y += scaling * xa @ B^T with each segment's adapter, in place, one launch.

Semantics:
    R = b.shape[2]                                    (slot rank, = max_lora_rank)
    for i in range(num_segments) with w = seg_lora_slots[i] >= 0:
        for t in range(seg_indptr[i], seg_indptr[i+1]), s in range(num_slices),
                o in range(slice_offsets[s], slice_offsets[s+1]):
            y[t, o] += scalings[w, s] * sum(xa[t, s*R + r] * b[w, o, r] for r in range(ranks[w]))
    (accumulated in float32, rounded once into y's dtype)

Base-only segments (w = -1) are skipped: y and xa rows are not touched, so xa may hold anything there.

Write mode (accumulate=False): y = the delta instead of y += it, base-only segments' rows = 0, so y may
start as anything; every row of y must then lie in a segment (the model's batches and graph padding do).
The grid tiles the whole output row (all slices), so a tile may straddle a slice boundary; each slice
that meets the tile adds its own columns. Programs of empty segments or tiles past a segment's
length exit after a few loads; the rank loop stops at the segment's own rank. As in lora_shrink, segments
longer than one token are tiled over all segments in turn (kernels/row_tiles.py).
"""
from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from worker.kernels.lora_shrink import _tile_matmul
from worker.kernels.row_tiles import CHUNK, group_tile, mapped_tile
from worker.kernels.row_tiles_host import TILE_ROWS, max_tiles


@triton.jit
def _slice_bound(slice_offsets_ptr, SLICE_OFFSETS: tl.constexpr, s: tl.constexpr):
    """slice_offsets[s], from the compile-time tuple when given, else from device memory."""
    if SLICE_OFFSETS is None:
        return tl.load(slice_offsets_ptr + s)
    else:
        return SLICE_OFFSETS[s]


@triton.jit
def _slice_delta(xa_ptr, b_slot_ptr, offs_m, mask_m, offs_n, mask_n, xa_col0, rank, stride_xas, stride_xam,
                 stride_bo, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_R: tl.constexpr):
    """xa[offs_m, xa_col0 : xa_col0 + rank] @ b_slot[offs_n, :rank]^T -> [BLOCK_M, BLOCK_N] float32; with
    SPLIT_K > 1 xa is the sum of SPLIT_K float32 partials (rounded to B's dtype, as a stored xa would be)."""
    offs_r = tl.arange(0, BLOCK_R)
    # xa_ptrs: [BLOCK_M, BLOCK_R]; b_ptrs: [BLOCK_R, BLOCK_N] (B rows read transposed)
    xa_ptrs = xa_ptr + offs_m.to(tl.int64)[:, None] * stride_xam + xa_col0 + offs_r[None, :]
    b_ptrs = b_slot_ptr + offs_n[None, :] * stride_bo + offs_r[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        mask_r = offs_r < rank - r0
        if SPLIT_K == 1:
            xa_tile = tl.load(xa_ptrs, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
        else:
            xa_sum = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for j in tl.static_range(SPLIT_K):
                xa_sum += tl.load(xa_ptrs + j * stride_xas, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
            xa_tile = xa_sum.to(b_slot_ptr.dtype.element_ty)
        b_tile = tl.load(b_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0)
        acc += _tile_matmul(xa_tile, b_tile, BLOCK_M >= 16)
        xa_ptrs += BLOCK_R
        b_ptrs += BLOCK_R
    return acc


@triton.jit
def program_tile(tile_map_ptr, seg_indptr_ptr, num_segments, NUM_N_TILES: tl.constexpr, FLAT: tl.constexpr,
                 TILE_MAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first column, segment, first row, segment end) of the output tile this program owns: program
    (m_tile * NUM_N_TILES + n_tile, segment) owns [m tile of the segment, n tile]; FLAT: program
    (tile * NUM_N_TILES + n_tile, 0), tiles numbered over all segments in turn (searched, or read from the host's
    tile map); segment -1 when it owns none."""
    n0 = (tl.program_id(0) % NUM_N_TILES) * BLOCK_N
    if TILE_MAP:
        seg, m0, seg_end = mapped_tile(tile_map_ptr, seg_indptr_ptr, tl.program_id(0) // NUM_N_TILES)
    else:
        seg, m0, seg_end = group_tile(seg_indptr_ptr, num_segments, tl.program_id(0) // NUM_N_TILES, FLAT,
                                      BLOCK_M, CHUNK)
    return n0, seg, m0, seg_end


@triton.jit
def add_adapter_delta(delta, xa_ptr, b_ptr, ranks_ptr, scalings_ptr, slice_offsets_ptr, w, offs_m, mask_m, n0,
                      stride_xas, stride_xam, stride_bw, stride_bo, stride_sw, SLICE_OFFSETS: tl.constexpr,
                      NUM_SLICES: tl.constexpr, MAX_RANK: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_R_HIGH: tl.constexpr):
    """`delta` ([BLOCK_M, BLOCK_N] float32) plus slot w's scaled LoRA product over rows offs_m and the columns from
    n0, each slice that meets them adding its own columns; ranks up to 2 * BLOCK_R step by BLOCK_R, higher ranks by
    BLOCK_R_HIGH (fewer, wider steps)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    rank = tl.load(ranks_ptr + w)
    b_slot_ptr = b_ptr + w.to(tl.int64) * stride_bw
    for s in tl.static_range(NUM_SLICES):
        lo = _slice_bound(slice_offsets_ptr, SLICE_OFFSETS, s)
        hi = _slice_bound(slice_offsets_ptr, SLICE_OFFSETS, s + 1)
        if (n0 < hi) & (n0 + BLOCK_N > lo):
            mask_n = (offs_n >= lo) & (offs_n < hi)
            if rank <= 2 * BLOCK_R:
                acc = _slice_delta(xa_ptr, b_slot_ptr, offs_m, mask_m, offs_n, mask_n, s * MAX_RANK, rank,
                                   stride_xas, stride_xam, stride_bo, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R)
            else:
                acc = _slice_delta(xa_ptr, b_slot_ptr, offs_m, mask_m, offs_n, mask_n, s * MAX_RANK, rank,
                                   stride_xas, stride_xam, stride_bo, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R_HIGH)
            delta += acc * tl.load(scalings_ptr + w.to(tl.int64) * stride_sw + s)   # slots may pass 2**31 elements
    return delta


@triton.jit(do_not_specialize=["num_segments"])
def _lora_expand_kernel(
        y_ptr, xa_ptr, b_ptr, seg_indptr_ptr, seg_lora_slots_ptr, ranks_ptr, scalings_ptr, slice_offsets_ptr,
        tile_map_ptr, out_dim, stride_ym, stride_xas, stride_xam, stride_bw, stride_bo, stride_sw, num_segments,
        SLICE_OFFSETS: tl.constexpr, NUM_SLICES: tl.constexpr, MAX_RANK: tl.constexpr, NUM_N_TILES: tl.constexpr,
        SPLIT_K: tl.constexpr, FLAT: tl.constexpr, TILE_MAP: tl.constexpr, ACCUMULATE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_R_HIGH: tl.constexpr):
    # program (m_tile * NUM_N_TILES + n_tile, segment) owns y[m tile of the segment, output cols n tile];
    # FLAT: program (tile * NUM_N_TILES + n_tile, 0), tile numbering all segments' m tiles in turn;
    n0, seg, m0, seg_end = program_tile(tile_map_ptr, seg_indptr_ptr, num_segments, NUM_N_TILES, FLAT, TILE_MAP,
                                        BLOCK_M, BLOCK_N)
    if seg < 0:
        return
    w = tl.load(seg_lora_slots_ptr + seg)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_m = offs_m < seg_end
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    mask = mask_m[:, None] & (offs_n < out_dim)[None, :]
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if w < 0:
        if not ACCUMULATE:
            tl.store(y_ptrs, delta.to(y_ptr.dtype.element_ty), mask=mask)
        return
    delta = add_adapter_delta(delta, xa_ptr, b_ptr, ranks_ptr, scalings_ptr, slice_offsets_ptr, w, offs_m, mask_m,
                              n0, stride_xas, stride_xam, stride_bw, stride_bo, stride_sw, SLICE_OFFSETS, NUM_SLICES,
                              MAX_RANK, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_R_HIGH)
    if ACCUMULATE:
        delta += tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, delta.to(y_ptr.dtype.element_ty), mask=mask)


@functools.lru_cache(maxsize=None)     # called per launch; eager steps are bound by host time
def default_config(max_seg_len: int, max_rank: int) -> dict:
    """Launch keywords (BLOCK_M, BLOCK_N, BLOCK_R, BLOCK_R_HIGH, num_warps, num_stages), chosen with the
    kernels_lora bench's sweep (BENCHMARKS.md, Kernels).

    Rank steps of 16 for ranks up to 32, wider steps above (fewer dependent loop iterations).
    One token per segment with slots of rank <= 32 (decode): a GEMV per program over a wide column
    tile, no tensor cores, in rank steps of 16 (wider steps spill the [step, columns] product out of
    registers). Larger slots keep the tensor-core tiles, faster there than the GEMV's rank loop.
    """
    high = min(64, max(16, triton.next_power_of_2(max_rank)))
    if max_seg_len == 1 and max_rank <= 32:
        return dict(BLOCK_M=1, BLOCK_N=128, BLOCK_R=16, BLOCK_R_HIGH=16, num_warps=4, num_stages=2)
    if max_seg_len <= 16:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_R=16, BLOCK_R_HIGH=high, num_warps=4, num_stages=2)
    return dict(BLOCK_M=64, BLOCK_N=64, BLOCK_R=16, BLOCK_R_HIGH=high, num_warps=8, num_stages=2)


@functools.lru_cache(maxsize=None)
def grouped_config(max_rank: int) -> dict:
    """Launch keywords for a decode graph's rows grouped by adapter (lora_shrink.grouped_config's tiles)."""
    high = min(64, max(16, triton.next_power_of_2(max_rank)))
    return dict(BLOCK_M=TILE_ROWS, BLOCK_N=256, BLOCK_R=16, BLOCK_R_HIGH=high, num_warps=4, num_stages=2)


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, seg_indptr: torch.Tensor,
                seg_lora_slots: torch.Tensor, ranks: torch.Tensor, scalings: torch.Tensor,
                slice_offsets: Sequence[int] | torch.Tensor, num_segments: int, max_seg_len: int,
                accumulate: bool = True, config: dict | None = None, tile_map: torch.Tensor | None = None) -> None:
    """Add every slice's LoRA delta into y in one launch (accumulate=False: write it, zeros on base-only
    rows; module docstring); no host-device sync.

    y: [num_tokens, out_dim] (updated in place); xa: [num_tokens, num_slices * R], or lora_shrink's float32
    partial sums [split_k, num_tokens, num_slices * R]; b: [num_slots, out_dim, R];
    seg_indptr: [>= num_segments + 1] int32; seg_lora_slots: [>= num_segments] int32 (-1 = base only);
    ranks: [num_slots] int32; scalings: [num_slots, num_slices] float32;
    slice_offsets: [num_slices + 1] host ints (compiled in) or an int32 device tensor (read by the kernel).
    num_segments, max_seg_len: host upper bounds that size the grid, as for lora_shrink; tile_map as there.
    config: launch keywords as default_config() gives them, None for its choice.
    """
    out_dim, max_rank = b.shape[1], b.shape[2]
    if isinstance(slice_offsets, torch.Tensor):
        offsets_ptr, offsets_const, num_slices = slice_offsets, None, slice_offsets.numel() - 1
    else:
        offsets_ptr, offsets_const, num_slices = None, tuple(int(o) for o in slice_offsets), len(slice_offsets) - 1
    split_k = xa.shape[0] if xa.dim() == 3 else 1
    assert y.shape[1] == out_dim and xa.shape[-2:] == (y.shape[0], num_slices * max_rank), "y, xa, b disagree"
    assert y.stride(1) == 1 and xa.stride(-1) == 1 and b.stride(2) == 1, "y, xa and b need a contiguous last dim"
    assert scalings.shape == (b.shape[0], num_slices) and scalings.stride(1) == 1
    if num_segments == 0 or max_seg_len == 0:
        return
    cfg = config or default_config(max_seg_len, max_rank)
    num_n_tiles = triton.cdiv(out_dim, cfg["BLOCK_N"])
    flat = max_seg_len > 1
    assert flat or tile_map is None, "a tile map is for segments longer than one token"
    if flat:
        grid = (max_tiles(y.shape[0], num_segments, cfg["BLOCK_M"]) * num_n_tiles, 1)
    else:
        grid = (num_n_tiles, num_segments)
    _lora_expand_kernel[grid](
        y, xa, b, seg_indptr, seg_lora_slots, ranks, scalings, offsets_ptr,
        tile_map if tile_map is not None else seg_indptr, out_dim, y.stride(0),
        xa.stride(0) if split_k > 1 else 0, xa.stride(-2), b.stride(0), b.stride(1), scalings.stride(0), num_segments,
        SLICE_OFFSETS=offsets_const, NUM_SLICES=num_slices, MAX_RANK=max_rank, NUM_N_TILES=num_n_tiles,
        SPLIT_K=split_k, FLAT=flat, TILE_MAP=tile_map is not None, ACCUMULATE=accumulate, **cfg)
