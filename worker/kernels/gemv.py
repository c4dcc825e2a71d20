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

import torch
import triton
import triton.language as tl

from worker.kernels import pdl

MAX_ROWS = 4      # rows of x one launch takes (the float32 products stay in registers); the engine sends it
                  # at most 2 (model_runner/runner.py): from 4 rows cuBLAS is faster (H100 sweep, BENCHMARKS.md)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Semantics:
        y[m, n] = round(sum_k x[m, k] * w[n, k] (+ bias[n]))   for m < M, n < N; sum and bias in float32

    Grid: cdiv(N, BLOCK_N) programs; program p owns output columns [p*BLOCK_N, (p+1)*BLOCK_N) of every row.
    PDL: kernels/pdl.py.
    """
    pdl.launch_dependents(PDL)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    pdl.wait(PDL)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            k_mask = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += w.to(tl.float32)[None, :, :] * x.to(tl.float32)[:, None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)                                            # [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
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


def projection_output(x: torch.Tensor, weight: torch.Tensor, max_rows: int) -> tuple[torch.Tensor, int, int, int]:
    """(y, M, N, K) for a small-batch projection kernel (here and kernels/skinny_gemm.py): checks x [M, K]
    (M <= max_rows, unit stride along K) against weight [N, K] (contiguous); y [M, N] in x's dtype, unwritten."""
    num_rows, k = x.shape
    n = weight.shape[0]
    assert num_rows <= max_rows and weight.shape[1] == k and weight.is_contiguous() and x.stride(1) == 1
    return torch.empty(num_rows, n, dtype=x.dtype, device=x.device), num_rows, n, k


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         cfg: tuple[int, int, int, int] | None = None, early_launch: bool = True) -> torch.Tensor:
    """x: [M, K] (M <= MAX_ROWS, unit stride along K), weight: [N, K] contiguous, bias: [N] or None
    -> y: [M, N] in x's dtype. `cfg` overrides config() (benchmarks).

    early_launch=False: launched only once the previous kernel has ended, even where kernels/pdl.py is
    active, though it still lets the next kernel launch early. For a GEMV with LoRA kernels on a second stream
    beside it: its programs fill every SM's warp slots, so launched early they keep those kernels off the SMs
    until the GEMV ends (measured at batch 1 with one adapter: 7% slower steps); letting the next kernel launch
    early gained 1.8% there (BENCHMARKS.md)."""
    y, num_rows, n, k = projection_output(x, weight, MAX_ROWS)
    if num_rows == 0:
        return y
    block_m, block_n, block_k, num_warps = cfg or config(num_rows, n, k)
    assert block_m >= num_rows
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, num_rows, n, k, x.stride(0), weight.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=num_warps,
        **(pdl.launch_options(x.device) if early_launch else {"PDL": pdl.active(x.device)}))
    return y
