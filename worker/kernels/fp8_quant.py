"""Activation quantization to FP8 (float8_e4m3fn) for the W8A8 GEMMs of FP8 base models (kernels/fp8_gemm.py).

Each row of x is cut into groups of `group` columns (the whole row for per-token scales, the weight's block_k for
block-wise checkpoints) and each group gets its own float32 scale s = max(amax, EPS) / 448, so its largest value
lands on float8_e4m3fn's largest finite value; a static scale from the checkpoint replaces s when given. Values are
clamped to ±448 before the cast: CUDA's cast turns values above 464 into NaN rather than saturating, and a static
scale can leave values past the range.

Rounding: x / s is an IEEE division (div_rn, not the approximate one Triton emits for `/`), and the cast rounds to
nearest even, so reference.fp8_quantize_activations reproduces every byte.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels import pdl

FP8_MAX = 448.0     # float8_e4m3fn's largest finite value
EPS = 1e-10         # floor on a group's amax: an all-zero group gets a tiny scale, not a division by zero


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, static_ptr, K, group, num_groups, stride_xm, stride_qm, stride_sm,
                     STATIC: tl.constexpr, AMAX_FLOOR: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    """Semantics, row m, group g (columns [g*group, (g+1)*group) below K):
        s = static[0] if STATIC else max(max_k |x[m, k]|, AMAX_FLOOR) / 448        (AMAX_FLOOR: EPS)
        q[m, k] = fp8(clamp(x[m, k] / s, -448, 448));  scale[m, g] = s
    Grid (M, cdiv(num_groups, BLOCK_G)); a program takes BLOCK_G groups of one row, BLOCK_C columns of each a step.
    """
    pdl.launch_dependents(PDL)
    m = tl.program_id(0).to(tl.int64)
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)              # [G]
    g_mask = groups < num_groups
    cols = tl.arange(0, BLOCK_C)                                             # [C]
    start = groups * group
    x_row, q_row = x_ptr + m * stride_xm, q_ptr + m * stride_qm
    pdl.wait(PDL)
    if STATIC:
        s = tl.load(static_ptr) + tl.zeros((BLOCK_G,), dtype=tl.float32)
    else:
        amax = tl.zeros((BLOCK_G, BLOCK_C), dtype=tl.float32)
        for c0 in range(0, group, BLOCK_C):
            k = start[:, None] + c0 + cols[None, :]
            mask = g_mask[:, None] & (c0 + cols < group)[None, :] & (k < K)
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + k, mask=mask, other=0.0).to(tl.float32)))
        s = tl.math.div_rn(tl.maximum(tl.max(amax, axis=1), AMAX_FLOOR), 448.0)     # [G]
    for c0 in range(0, group, BLOCK_C):
        k = start[:, None] + c0 + cols[None, :]
        mask = g_mask[:, None] & (c0 + cols < group)[None, :] & (k < K)
        x = tl.load(x_row + k, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, s[:, None]), -448.0), 448.0)
        tl.store(q_row + k, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + m * stride_sm + groups, s, mask=g_mask)


def quantize_fp8(x: torch.Tensor, group: int | None, input_scale: torch.Tensor | None = None,
                 programmatic_launch: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] (unit stride along K); group: columns per scale (None: the whole row, per token); input_scale:
    float32 [1], a static scale, or None (computed per group) -> (q [M, K] float8_e4m3fn contiguous,
    scale [M, cdiv(K, group)] float32 contiguous: per token [M, 1], the layout torch._scaled_mm's row-wise
    scale_a takes). No host-device sync."""
    num_rows, k = x.shape
    assert x.stride(1) == 1
    group = k if group is None else group
    num_groups = triton.cdiv(k, group)
    q = torch.empty(num_rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(num_rows, num_groups, dtype=torch.float32, device=x.device)
    if num_rows == 0:
        return q, scale
    block_c = min(triton.next_power_of_2(group), 4096)
    block_g = max(1, min(triton.next_power_of_2(num_groups), 2048 // block_c))
    static = input_scale is not None
    assert not static or input_scale.dtype == torch.float32
    _quantize_kernel[(num_rows, triton.cdiv(num_groups, block_g))](
        x, q, scale, input_scale if static else scale, k, group, num_groups, x.stride(0), q.stride(0),
        scale.stride(0), STATIC=static, AMAX_FLOOR=EPS, BLOCK_G=block_g, BLOCK_C=block_c, num_warps=4,
        **pdl.launch_options(x.device, programmatic_launch))
    return q, scale
