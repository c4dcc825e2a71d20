"""W8A8 projection on the FP8 tensor cores for many rows: x quantized to float8_e4m3fn (kernels/fp8_quant.py), then
y = (xq * x_scale) @ (W * w_scale)^T (+ b) with both operands in FP8.

Two scale layouts, as the checkpoints carry them:
- per token x per output row (FP8-dynamic, and per-tensor checkpoints expanded to rows): the sum over all of K
  times x_scale[m] * w_scale[n]. torch._scaled_mm's row-wise mode (cuBLAS/CUTLASS) or the Triton kernel below.
- per 1 x block_k group x per (block_n x block_k) block (DeepSeek-V3, Qwen3-FP8): each block_k-wide partial
  product is multiplied by x_scale[m, kb] * w_scale[n // block_n, kb] in float32 as it joins the sum. Triton only:
  _scaled_mm's block-wise mode returns wrong values unless K / 128 is a multiple of 4.

Accumulation: Hopper's FP8 MMA adds its products in a reduced-precision accumulator, so the kernel moves each
BLOCK_K-wide partial product into the float32 sum (per block: scaled; per row: `max_num_imprecise_acc=BLOCK_K`),
never more than BLOCK_K = 128 products in the narrow accumulator. Bias added in float32, one rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels.fp8_quant import quantize_fp8


@triton.jit
def _w8a8_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_asm, stride_bn,
                 stride_bsn, stride_cm, BLOCK_SCALES: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """Semantics, m < M, n < N (a, b float8_e4m3fn; float32 sums, one rounding):
        per row:    c[m, n] = round(as[m, 0] * bs[n] * sum_k a[m, k] * b[n, k] (+ bias[n]))
        per block:  c[m, n] = round(sum_kb as[m, kb] * bs[n // SCALE_BN, kb] * sum_{k in kb} a[m, k] * b[n, k]
                                    (+ bias[n]))
    Grid: cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N) tiles, GROUP_M row tiles a column sweep (tiles sharing W run together).
    """
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    rows_in_group = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % rows_in_group
    pid_n = (pid % (GROUP_M * tiles_n)) // rows_in_group
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask, n_mask = offs_m < M, offs_n < N
    a_ptrs = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]      # [BLOCK_M, BLOCK_K]
    b_ptrs = b_ptr + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]      # [BLOCK_K, BLOCK_N]: W^T
    as_rows = as_ptr + offs_m * stride_asm
    bs_rows = bs_ptr + (offs_n // SCALE_BN) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if BLOCK_SCALES:
            sa = tl.load(as_rows + k0 // SCALE_BK, mask=m_mask, other=0.0)
            sb = tl.load(bs_rows + k0 // SCALE_BK, mask=n_mask, other=0.0)
            acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
        else:
            acc = tl.dot(a, b, acc, max_num_imprecise_acc=BLOCK_K)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not BLOCK_SCALES:
        sa = tl.load(as_rows, mask=m_mask, other=0.0)
        sb = tl.load(bs_ptr + offs_n, mask=n_mask, other=0.0)
        acc *= sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def w8a8_gemm(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
              block: tuple[int, int] | None, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """The Triton kernel. xq: [M, K] float8_e4m3fn (unit stride along K); x_scale: float32 [M, 1] (block None) or
    [M, cdiv(K, bk)]; weight: [N, K] float8_e4m3fn contiguous; weight_scale: float32 [N] or [cdiv(N, bn),
    cdiv(K, bk)] (bk a power of two >= 32); bias: [N] or None -> y: [M, N] in out_dtype."""
    num_rows, k = xq.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and weight.is_contiguous() and xq.stride(1) == 1 and x_scale.stride(1) == 1
    assert weight_scale.dtype == torch.float32 and weight_scale.stride(-1) == 1
    y = torch.empty(num_rows, n, dtype=out_dtype, device=xq.device)
    if num_rows == 0:
        return y
    bn, bk = block or (1, 1 << 30)
    assert bk & (bk - 1) == 0 and bk >= 32, f"block_k must be a power of two >= 32, got {bk}"
    block_m = 64 if num_rows <= 64 else 128
    block_n, block_k = 128, min(128, bk)
    grid = (triton.cdiv(num_rows, block_m) * triton.cdiv(n, block_n),)
    _w8a8_kernel[grid](
        xq, x_scale, weight, weight_scale, bias if bias is not None else y, y, num_rows, n, k, xq.stride(0),
        x_scale.stride(0), weight.stride(0), weight_scale.stride(0) if block is not None else 0, y.stride(0),
        BLOCK_SCALES=block is not None, SCALE_BN=bn, SCALE_BK=bk if block is not None else 1,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
        num_warps=4 if block_m == 64 else 8, num_stages=4)
    return y


def scaled_mm_rowwise(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """Per-token x per-row scales by torch._scaled_mm (cuBLAS or CUTLASS): xq [M, K], x_scale [M, 1],
    weight [N, K] contiguous, weight_scale [N], K and N multiples of 16 -> [M, N] in out_dtype."""
    return torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1), bias=bias,
                            out_dtype=out_dtype)


def rowwise_by_scaled_mm(num_rows: int, n: int, k: int) -> bool:
    """Whether per-row scales go to torch._scaled_mm rather than the Triton kernel: where it can (K, N multiples of
    16), except at up to 64 rows of a wide projection (48+ column tiles), where the Triton kernel was faster on an
    H200 (BENCHMARKS.md, FP8 projections)."""
    if k % 16 or n % 16:
        return False
    return not (num_rows <= 64 and triton.cdiv(n, 128) >= 48)


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
                block: tuple[int, int] | None, bias: torch.Tensor | None,
                programmatic_launch: bool = True) -> torch.Tensor:
    """x: [M, K] compute dtype -> y: [M, N] in x's dtype: x quantized per token (per row scales) or per 1 x bk
    group (block scales), or with the static input_scale [1], then the GEMM that serves the layout."""
    xq, x_scale = quantize_fp8(x, block[1] if block is not None else None, input_scale, programmatic_launch)
    if block is None and rowwise_by_scaled_mm(x.shape[0], weight.shape[0], x.shape[1]):
        return scaled_mm_rowwise(xq, x_scale, weight, weight_scale, bias, x.dtype)
    return w8a8_gemm(xq, x_scale, weight, weight_scale, block, bias, x.dtype)
