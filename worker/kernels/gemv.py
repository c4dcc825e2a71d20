"""Small-batch projection: y = x @ W^T (+ b) for a few rows of x, reading W once at full bandwidth.

At decode batch sizes a projection is a matrix-vector product bound by the bytes of W. cuBLAS picks
split-K tiles for the narrow projections there (o_proj, down_proj), which add a reduce launch each, and
reads some weights well below the device's copy bandwidth (BENCHMARKS.md, Decode step). This kernel gives
each program BLOCK_N whole output rows: it streams those rows of W once, K-contiguous, keeps the products in
float32 registers and reduces them once at the end, so there is no split-K and no second launch. The rows of
x (at most MAX_ROWS) are reread from L1/L2 by every program; they are tiny.

Rounding: one float32 accumulation per output, the bias added in float32, one rounding to x's dtype, as
cuBLAS's epilogue does; only the summation order differs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels import pdl

MAX_ROWS = 4      # rows of x one launch takes (the float32 products stay in registers); the engine sends it
                  # at most KernelConfig.gemv_row_limit (why 2: BENCHMARKS.md, Kernels)


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


def default_config(num_rows: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for x [num_rows, k] and W [n, k]: 4-16 KB of W per program per
    loop step; more output rows per program for long K, fewer for small matrices, so every SM gets several
    programs (chosen with `python -m bench.kernels_gemv --sweep`, BENCHMARKS.md)."""
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
         config: tuple[int, int, int, int] | None = None, programmatic_launch: bool = True,
         early_launch: bool = True) -> torch.Tensor:
    """x: [M, K] (M <= MAX_ROWS, unit stride along K), weight: [N, K] contiguous, bias: [N] or None
    -> y: [M, N] in x's dtype. `config`: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps), None for default_config().
    `programmatic_launch`: kernels/pdl.py, where the device has it.

    early_launch=False: launched only once the previous kernel has ended, even with PDL, though it still lets
    the next kernel launch early. For a GEMV with LoRA kernels on a second stream beside it: its programs fill
    every SM's warp slots, so launched early they would keep those kernels off the SMs until the GEMV ends
    (BENCHMARKS.md, Tried and dropped)."""
    y, num_rows, n, k = projection_output(x, weight, MAX_ROWS)
    if num_rows == 0:
        return y
    block_m, block_n, block_k, num_warps = config or default_config(num_rows, n, k)
    assert block_m >= num_rows
    launch = pdl.launch_options(x.device, programmatic_launch)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, num_rows, n, k, x.stride(0), weight.stride(0),
        y.stride(0), HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, num_warps=num_warps, **(launch if early_launch else {"PDL": launch["PDL"]}))
    return y
