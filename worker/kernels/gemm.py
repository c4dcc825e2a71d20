"""Skinny GEMM for decode-sized batches: y = x @ W^T (+ bias) with few rows of x.

At one to sixteen tokens a projection is a read of W and nothing else. cuBLAS's choice for some
shapes leaves SMs idle (at Llama-8B's o_proj, 4096 x 4096, batch 1 on an H100 it runs 64 CTAs at
about half the bandwidth); this kernel spreads the output columns over many small programs, each
streaming its rows of W once. Which of the two runs for a shape is decided by timing both at
start-up (worker/layers/linear.py), so this kernel only runs where it is faster.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16     # the kernel holds all rows of x in one 16-row tile


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Semantics: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for m < M <= BLOCK_M, n < N;
    accumulated in float32, rounded once into y's dtype. Program i owns columns [i*BLOCK_N, (i+1)*BLOCK_N)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n, mask_m = offs_n < N, offs_m < M
    # x_ptrs: [BLOCK_M, BLOCK_K]; w_ptrs: [BLOCK_K, BLOCK_N] (rows of W read transposed)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += tl.dot(x, w, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M <= 16, K] (contiguous rows); weight: [N, K] contiguous; bias: [N] or None -> y: [M, N] in x's dtype."""
    (m, k), n = x.shape, weight.shape[0]
    assert m <= MAX_ROWS, f"skinny_gemm takes at most {MAX_ROWS} rows, got {m}"
    assert weight.shape[1] == k and weight.stride(1) == 1 and x.stride(1) == 1
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_n = 16
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=256, num_warps=4, num_stages=4)
    return y
