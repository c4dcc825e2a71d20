"""Projection of a few rows by an FP8 weight on the tensor cores, weight-only (W8A16): y = x @ (W * scales)^T (+ b).

kernels/skinny_gemm.py's layout for a float8_e4m3fn W: a program owns BLOCK_N output columns of every row and
computes acc^T = W_tile @ x^T, W the wide operand streamed K-contiguous through the software pipeline, the few
rows of x the narrow one. Each W tile is converted to x's dtype in registers (exact: every e4m3 value is a bf16 and
an fp16 value) and multiplied with x as it is, so the activations are not quantized and the step needs no
quantization launch; at these row counts the time is the bytes of W, half those of a bf16 W.

Scales: per output row multiply the float32 sum at the end; per (block_n x block_k) block multiply each K step's
float32 partial product (BLOCK_K divides block_k, so a step lies in one column block) before it joins the sum.
No split-K: narrow projections take 32-column tiles instead, so every SM still has programs.

Rounding: float32 sums, the bias added in float32, one rounding to x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels import pdl

MAX_ROWS = 64          # rows of x one launch takes (the narrow operand of the tensor-core tiles)
SMEM_BYTES = 200 << 10  # shared memory the pipeline's stages may take (a Hopper SM has 227 KB)


@triton.jit(do_not_specialize=["num_rows"])
def _fp8_skinny_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, num_rows, N, K, stride_xm, stride_wn, stride_sn,
                       stride_ym, BLOCK_SCALES: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
                       HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Semantics, m < num_rows, n < N (float32 sums, one rounding):
        per row:    y[m, n] = round(s[n] * sum_k x[m, k] * w[n, k] (+ bias[n]))
        per block:  y[m, n] = round(sum_kb s[n // SCALE_BN, kb] * sum_{k in block kb} x[m, k] * w[n, k] (+ bias[n]))

    Grid: (cdiv(N, BLOCK_N),). PDL: kernels/pdl.py.
    """
    pdl.launch_dependents(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < num_rows
    pdl.wait(PDL)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]                   # x^T: [BLOCK_K, BLOCK_M]
    s_rows = s_ptr + (offs_n // SCALE_BN) * stride_sn                                 # block scales of each row
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            wt = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0, eviction_policy="evict_first")
            xt = tl.load(x_ptrs, mask=mask_m[None, :], other=0.0)
        else:
            mask_k = offs_k < K - k0
            wt = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first")
            xt = tl.load(x_ptrs, mask=mask_k[:, None] & mask_m[None, :], other=0.0)
        wt = wt.to(xt.dtype)
        if BLOCK_SCALES:
            s = tl.load(s_rows + k0 // SCALE_BK, mask=mask_n, other=0.0)               # [BLOCK_N]
            acc += tl.dot(wt, xt) * s[:, None]
        else:
            acc = tl.dot(wt, xt, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if not BLOCK_SCALES:
        acc *= tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


def default_config(num_rows: int, n: int, k: int, block_k_max: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_stages): 64 columns a program, 32 where 64 would leave fewer than 128 programs (o_proj
    and down_proj at 8B: no split-K here); 128 K a step (at most block_k_max)."""
    block_n = 64 if triton.cdiv(n, 64) >= 128 else 32
    block_k = min(128, block_k_max, max(32, triton.next_power_of_2(k)))
    block_m = max(16, triton.next_power_of_2(num_rows))
    stage_bytes = block_n * block_k + block_m * block_k * 2
    return block_n, block_k, max(1, min(5, SMEM_BYTES // stage_bytes))


def fp8_skinny_gemm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int] | None,
                    bias: torch.Tensor | None = None, programmatic_launch: bool = True) -> torch.Tensor:
    """x: [M, K] (M <= MAX_ROWS, unit stride along K, bf16 or fp16); weight: [N, K] float8_e4m3fn contiguous;
    weight_scale: float32 [N] (block None) or [cdiv(N, bn), cdiv(K, bk)] (block (bn, bk), bk a power of two
    >= 16); bias: [N] or None -> y: [M, N] in x's dtype. No host-device sync."""
    num_rows, k = x.shape
    n = weight.shape[0]
    assert num_rows <= MAX_ROWS and weight.shape[1] == k and weight.is_contiguous() and x.stride(1) == 1
    assert weight_scale.dtype == torch.float32 and weight_scale.stride(-1) == 1
    y = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y
    bn, bk = block or (1, 1 << 30)
    assert bk & (bk - 1) == 0 and bk >= 16, f"block_k must be a power of two >= 16, got {bk}"
    block_n, block_k, stages = default_config(num_rows, n, k, bk)
    _fp8_skinny_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight_scale, bias if bias is not None else x, y, num_rows, n, k, x.stride(0), weight.stride(0),
        weight_scale.stride(0) if block is not None else 0, y.stride(0), BLOCK_SCALES=block is not None,
        SCALE_BN=bn, SCALE_BK=bk if block is not None else 1, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0,
        BLOCK_M=max(16, triton.next_power_of_2(num_rows)), BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        num_stages=stages, **pdl.launch_options(x.device, programmatic_launch))
    return y
