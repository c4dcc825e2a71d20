"""Small-batch projection: y = x @ W^T (+ b) for a few rows of x, reading W once at full bandwidth.

At decode batch sizes a projection is a matrix-vector product bound by the bytes of W. cuBLAS picks
split-K tiles for the narrow projections there (o_proj, down_proj), which add a reduce launch each, and
reads the qkv weight at ~80% of the device's copy bandwidth (H100, Llama-3.1-8B shapes; BENCHMARKS.md).
This kernel gives each program BLOCK_N whole output rows: it streams those rows of W once, K-contiguous,
keeps the products in float32 registers and reduces them once at the end, so there is no split-K and no
second launch. The rows of x (at most MAX_ROWS) are reread from L1/L2 by every program; they are tiny.

Rounding: one float32 accumulation per output, the bias added in float32, one rounding to x's dtype, as
cuBLAS's epilogue does; only the summation order differs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from worker.kernels import pdl

MAX_ROWS = 4      # rows of x one launch takes (the float32 products stay in registers); the engine sends it
                  # at most 2 (model_runner/runner.py): from 4 rows cuBLAS is faster (H100 sweep, BENCHMARKS.md)


@triton.jit
def _lora_rows_delta(offs_m, m_mask, offs_n, n_mask, xa_ptr, b_ptr, seg_ptr, widx_ptr, ranks_ptr, scal_ptr,
                     num_segments, stride_xam, stride_bw, stride_bn, stride_sw, SLICE_OFFSETS: tl.constexpr,
                     NUM_SLICES: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """[BLOCK_M, BLOCK_N] float32: scalings[w, s] * xa[m, s*R : s*R + rank] . b[w, n, :rank] for row m's slot
    w (its segment's weight index; 0 where w < 0 or m lies past the segments) and output n's slice s."""
    offs_s = tl.arange(0, BLOCK_M)                 # a row per segment at most
    ends = tl.load(seg_ptr + 1 + offs_s, mask=offs_s < num_segments, other=2147483647)
    seg = tl.sum((ends[None, :] <= offs_m[:, None]).to(tl.int32), axis=1)           # row m's segment
    w = tl.load(widx_ptr + seg, mask=m_mask & (seg < num_segments), other=-1)
    has = w >= 0
    w = tl.maximum(w, 0)
    rank = tl.where(has, tl.load(ranks_ptr + w, mask=has, other=0), 0)
    s_n = tl.zeros_like(offs_n)                    # output column n's slice
    for j in tl.static_range(1, NUM_SLICES):
        s_n += (offs_n >= SLICE_OFFSETS[j]).to(offs_n.dtype)
    offs_r = tl.arange(0, BLOCK_R)
    ok = (has & m_mask)[:, None, None] & n_mask[None, :, None] & (offs_r[None, None, :] < rank[:, None, None])
    xa = tl.load(xa_ptr + offs_m[:, None, None] * stride_xam + s_n[None, :, None] * R + offs_r[None, None, :],
                 mask=ok, other=0.0)
    b = tl.load(b_ptr + w.to(tl.int64)[:, None, None] * stride_bw + offs_n.to(tl.int64)[None, :, None] * stride_bn
                + offs_r[None, None, :], mask=ok, other=0.0)
    scale = tl.load(scal_ptr + w[:, None] * stride_sw + s_n[None, :], mask=has[:, None] & n_mask[None, :], other=0.0)
    return scale * tl.sum(xa.to(tl.float32) * b.to(tl.float32), axis=2)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 xa_ptr, b_ptr, seg_ptr, widx_ptr, ranks_ptr, scal_ptr, num_segments, stride_xam, stride_bw,
                 stride_bn, stride_sw,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, LORA: tl.constexpr, SLICE_OFFSETS: tl.constexpr, NUM_SLICES: tl.constexpr,
                 R: tl.constexpr, BLOCK_R: tl.constexpr, X_CACHE: tl.constexpr, PDL: tl.constexpr):
    """Semantics:
        y[m, n] = round(sum_k x[m, k] * w[n, k] (+ bias[n]) (+ delta[m, n]))   for m < M, n < N; in float32
    with LORA: delta[m, n] = scalings[w, s] * sum_{r < ranks[w]} xa[m, s*R + r] * b[w, n, r], w the weight index
    of row m's segment (none when -1), s output n's slice (SLICE_OFFSETS[s] <= n < SLICE_OFFSETS[s+1]).

    Grid: cdiv(N, BLOCK_N) programs; program p owns output columns [p*BLOCK_N, (p+1)*BLOCK_N) of every row.
    PDL: kernels/pdl.py. With LORA the kernel before is the shrink that wrote xa, which let this one launch only
    once the kernel before it (the writer of x) had ended (lora_shrink's `programmatic`): x is read at once,
    through L2, and the wait comes before xa is read.
    """
    pdl.launch_dependents(PDL)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if not LORA:
        pdl.wait(PDL)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0, cache_modifier=X_CACHE)
        else:
            k_mask = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0,
                        cache_modifier=X_CACHE)
        acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)                                            # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if LORA:
        pdl.wait(PDL)
        y += _lora_rows_delta(offs_m, m_mask, offs_n, n_mask, xa_ptr, b_ptr, seg_ptr, widx_ptr, ranks_ptr, scal_ptr,
                              num_segments, stride_xam, stride_bw, stride_bn, stride_sw, SLICE_OFFSETS, NUM_SLICES,
                              R, BLOCK_M, BLOCK_R)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def config(num_rows: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for x [num_rows, k] and W [n, k].

    From bench/kernels_gemv.py's sweep on an H100 at Llama-3.1-8B shapes (BENCHMARKS.md): 4-16 KB of W
    per program per loop step; more output rows per program for long K, fewer for small matrices, so
    every SM gets several programs."""
    block_m = triton.next_power_of_2(num_rows)
    block_k = min(1024 // block_m, triton.next_power_of_2(k))
    if block_m > 1:
        block_n = 4
    else:
        block_n = 8 if k > 8192 else 2 if n * k <= 4096 * 4096 else 4
    return block_m, block_n, block_k, 4


@dataclass(frozen=True)
class RowLoRA:
    """The LoRA expand a GEMV adds to its rows (layers/linear.py: decode batches of 1-2 rows): xa from lora_shrink
    launched just before with programmatic=True, the projection's slice of the slot pool, the step's segments."""
    xa: torch.Tensor               # [M, num_slices * R]
    b: torch.Tensor                # [num_slots, N, R]
    seg_indptr: torch.Tensor       # [>= num_segments + 1] int32
    weight_indices: torch.Tensor   # [>= num_segments] int32, -1 = base only
    ranks: torch.Tensor            # [num_slots] int32
    scalings: torch.Tensor         # [num_slots, num_slices] float32
    slice_offsets: tuple[int, ...]
    num_segments: int


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         cfg: tuple[int, int, int, int] | None = None, lora: RowLoRA | None = None) -> torch.Tensor:
    """x: [M, K] (M <= MAX_ROWS, unit stride along K), weight: [N, K] contiguous, bias: [N] or None
    -> y: [M, N] in x's dtype. `cfg` overrides config() (benchmarks).

    lora: each row's LoRA delta added before the one rounding (kernel Semantics); the GEMV must come right
    after the lora_shrink(programmatic=True) that wrote lora.xa, in the same stream."""
    num_rows, k = x.shape
    n = weight.shape[0]
    assert num_rows <= MAX_ROWS and weight.shape[1] == k and weight.is_contiguous() and x.stride(1) == 1
    y = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y
    block_m, block_n, block_k, num_warps = cfg or config(num_rows, n, k)
    assert block_m >= num_rows
    if lora is not None:
        la = lora
        r = la.b.shape[2]
        assert la.b.shape[1] == n and la.b.stride(2) == 1 and la.xa.shape == (num_rows, (len(la.slice_offsets) - 1) * r)
        assert la.xa.stride(1) == 1 and la.scalings.stride(1) == 1 and la.num_segments <= block_m
        lora_args = (la.xa, la.b, la.seg_indptr, la.weight_indices, la.ranks, la.scalings, la.num_segments,
                     la.xa.stride(0), la.b.stride(0), la.b.stride(1), la.scalings.stride(0))
        lora_consts = dict(SLICE_OFFSETS=tuple(int(o) for o in la.slice_offsets),
                           NUM_SLICES=len(la.slice_offsets) - 1, R=r, BLOCK_R=triton.next_power_of_2(r), X_CACHE=".cg")
    else:
        lora_args = (y, y, y, y, y, y, 0, 0, 0, 0, 0)
        lora_consts = dict(SLICE_OFFSETS=(0, n), NUM_SLICES=1, R=1, BLOCK_R=1, X_CACHE="")
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, num_rows, n, k, x.stride(0), weight.stride(0),
        y.stride(0), *lora_args, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, LORA=lora is not None, **lora_consts, num_warps=num_warps,
        **pdl.launch_options(x.device))
    return y
