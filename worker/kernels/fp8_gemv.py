"""Small-batch projection of an FP8 weight: y = x @ (W * scales)^T (+ b) for a few rows of x, W read once.

kernels/gemv.py for a float8_e4m3fn W: half the bytes of a bf16 W, so a decode step's projections can take half the
time. The activations stay in the compute dtype (weight-only, W8A16): every fp8 value is exact in float32, each
product is formed in float32, and the weight's scales multiply in float32, so the only roundings are the float32
sums and the one rounding of y.

Scales: per output row ([N]) multiply each row's sum at the end; per (block_n x block_k) block
([cdiv(N, block_n), cdiv(K, block_k)]) multiply x's columns as they are read (x[m, k] * scale[n // block_n,
k // block_k]): a program's BLOCK_N rows lie in one row block (block_n % BLOCK_N == 0), so that costs BLOCK_M
products per column, not one per weight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels import pdl

MAX_ROWS = 4      # rows of x one launch takes (the float32 products stay in registers)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                     BLOCK_SCALES: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                     HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Semantics, m < M, n < N (float32 sums, one rounding):
        per row:    y[m, n] = round(s[n] * sum_k x[m, k] * w[n, k] (+ bias[n]))
        per block:  y[m, n] = round(sum_k x[m, k] * s[n // SCALE_BN, k // SCALE_BK] * w[n, k] (+ bias[n]))

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
    s_row = s_ptr + (pid * BLOCK_N // SCALE_BN) * stride_sn             # block scales: the program's row block
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0).to(tl.float32)
            if BLOCK_SCALES:
                x = x * tl.load(s_row + (k0 + offs_k) // SCALE_BK)[None, :]
        else:
            k_mask = (k0 + offs_k) < K
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            if BLOCK_SCALES:
                x = x * tl.load(s_row + (k0 + offs_k) // SCALE_BK, mask=k_mask, other=0.0)[None, :]
        acc += w.to(tl.float32)[None, :, :] * x[:, None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    y = tl.sum(acc, axis=2)                                            # [BLOCK_M, BLOCK_N]
    if not BLOCK_SCALES:
        y *= tl.load(s_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def default_config(num_rows: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): one row: 8 rows of W by 1,024 columns a step (8 KB), the best or
    within 4% of it at Llama-3.1-8B's projections on an H200 (BENCHMARKS.md, FP8 projections); more rows:
    gemv.default_config's bytes of W a step."""
    block_m = triton.next_power_of_2(num_rows)
    if block_m == 1:
        return 1, 8, min(1024, triton.next_power_of_2(k)), 4
    return block_m, 4, min(2048 // block_m, triton.next_power_of_2(k)), 4


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None,
             bias: torch.Tensor | None = None, config: tuple[int, int, int, int] | None = None,
             programmatic_launch: bool = True, early_launch: bool = True) -> torch.Tensor:
    """x: [M, K] (M <= MAX_ROWS, unit stride along K); weight: [N, K] float8_e4m3fn contiguous; weight_scale:
    float32 [N] (block None) or [cdiv(N, bn), cdiv(K, bk)] (block (bn, bk)); bias: [N] or None -> y: [M, N] in
    x's dtype. `config`: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps), None for default_config(); early_launch as in
    kernels/gemv.py."""
    num_rows, k = x.shape
    n = weight.shape[0]
    assert num_rows <= MAX_ROWS and weight.shape[1] == k and weight.is_contiguous() and x.stride(1) == 1
    assert weight_scale.dtype == torch.float32 and weight_scale.stride(-1) == 1
    y = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y
    block_m, block_n, block_k, num_warps = config or default_config(num_rows, k)
    bn, bk = block or (1, 1)
    if block is not None:
        block_n = min(block_n, bn & -bn)          # a program's rows in one row block
        assert bn % block_n == 0
    launch = pdl.launch_options(x.device, programmatic_launch)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight_scale, bias if bias is not None else x, y, num_rows, n, k, x.stride(0), weight.stride(0),
        weight_scale.stride(0) if block is not None else 0, y.stride(0), BLOCK_SCALES=block is not None,
        SCALE_BN=bn, SCALE_BK=bk, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        **(launch if early_launch else {"PDL": launch["PDL"]}))
    return y
