"""Projection of a few rows: y = x @ W^T (+ b) for up to 64 rows of x, the weight as the tensor cores' wide operand.

At decode batch sizes a projection is bound by the bytes of W, which cuBLAS reads below the device's copy
bandwidth at 32 rows (BENCHMARKS.md, Kernels). Here operands are swapped: a program owns BLOCK_N output
columns of every row and computes acc^T = W_tile @ x^T, so W is the wide operand ([BLOCK_N, BLOCK_K],
K-contiguous as stored, streamed through a deep software pipeline) and the few rows of x the narrow one.

Narrow projections are cut along K into SPLIT_K parts, each its own program, so every SM has work; each
part writes its float32 sum to a workspace and the last part of a column tile to arrive (a per-tile counter)
adds the parts in part order, so the result does not depend on which part finishes first. The counters are
an int32 buffer the caller allocates once (`new_counters`, outside any CUDA-graph capture) and passes to
every launch; they are zero between launches (the last part resets its tile's), and launches that share a
buffer must not run concurrently: the engine's model holds one per device and issues them on one stream.

Rounding: one float32 sum per output (parts added in order), the bias added in float32, one rounding to x's
dtype, as cuBLAS's epilogue does; only the summation order differs.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

from worker.kernels import pdl
from worker.kernels.gemv import projection_output

MAX_ROWS = 64          # rows of x one launch takes (the narrow operand of the tensor-core tiles)
NUM_COUNTERS = 4096    # arrival counters in a buffer, one per column tile of a split launch
SMEM_BYTES = 200 << 10  # shared memory the pipeline's stages may take (a Hopper SM has 227 KB)


def new_counters(device: torch.device) -> torch.Tensor:
    """[NUM_COUNTERS] int32 zeros: the arrival counters skinny_gemm's launches on `device` share. Not inside a
    CUDA-graph capture (a zero fill captured there would rerun on every replay)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("skinny_gemm: allocate the counters before capturing a CUDA graph")
    return torch.zeros(NUM_COUNTERS, dtype=torch.int32, device=device)


@dataclass(frozen=True)
class Config:
    block_n: int       # output columns per program (the tensor cores' M)
    block_k: int       # K per loop step
    split_k: int       # parts along K (narrow projections: enough programs for every SM)
    num_warps: int = 4
    num_stages: int = 5  # at most: fewer when the stages would not fit SMEM_BYTES (wide rows, float32)


@lru_cache(maxsize=None)       # called per launch; eager steps are bound by host time
def default_config(num_rows: int, n: int, k: int) -> Config:
    """Tiles for x [num_rows, k] @ W [n, k]^T: 64 columns and 128 K per step in 5 stages; K cut in two when
    there are fewer than 96 column tiles (o_proj and down_proj's 64), not above (chosen with the kernels_skinny
    bench's sweep, BENCHMARKS.md)."""
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = min(128, max(16, triton.next_power_of_2(k)))
    split = 2 if triton.cdiv(n, block_n) < 96 and k >= 4 * block_k else 1
    return Config(block_n, block_k, split)


@triton.jit(do_not_specialize=["num_rows"])
def _skinny_gemm_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, ws_ptr, counters_ptr, num_rows, N, K, stride_xm, stride_wn,
                        stride_ym, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Semantics: y[m, n] = round(sum_k x[m, k] * w[n, k] (+ bias[n])) for m < num_rows, n < N; float32 sums.

    Grid: (cdiv(N, BLOCK_N) * SPLIT_K,); program p sums K in [(p % SPLIT_K) * K_SPLIT, ... + K_SPLIT) for the
    column tile p // SPLIT_K. PDL: kernels/pdl.py.
    """
    pdl.launch_dependents(PDL)
    tile = tl.program_id(0) // SPLIT_K
    part = tl.program_id(0) % SPLIT_K
    k_lo = part * K_SPLIT
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < num_rows
    pdl.wait(PDL)
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k_lo + offs_k)[:, None]          # x^T: [BLOCK_K, BLOCK_M]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(K, k_lo + K_SPLIT), BLOCK_K):
        if EVEN_K:
            wt = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0, eviction_policy="evict_first")
            xt = tl.load(x_ptrs, mask=mask_m[None, :], other=0.0)
        else:
            mask_k = offs_k < K - k0
            wt = tl.load(w_ptrs, mask=mask_n[:, None] & mask_k[None, :], other=0.0, eviction_policy="evict_first")
            xt = tl.load(x_ptrs, mask=mask_k[:, None] & mask_m[None, :], other=0.0)
        acc = tl.dot(wt, xt, acc, input_precision=DOT_PRECISION)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    last = True
    if SPLIT_K > 1:
        # ws[p, n, m]: part p's sum; the last part to arrive adds them in part order
        ws_tile = ws_ptr + offs_n[:, None] * BLOCK_M + offs_m[None, :]
        tl.store(ws_tile + part * N * BLOCK_M, acc, mask=mask_n[:, None])
        tl.debug_barrier()                       # every thread's part stored before the arrival is counted
        arrived = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel")
        last = arrived == SPLIT_K - 1
        if last:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for p in tl.static_range(SPLIT_K):
                acc += tl.load(ws_tile + p * N * BLOCK_M, mask=mask_n[:, None], other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counters_ptr + tile, 0)
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counters: torch.Tensor,
                config: Config | None = None, programmatic_launch: bool = True) -> torch.Tensor:
    """x: [M, K] (M <= MAX_ROWS, unit stride along K), weight: [N, K] contiguous, bias: [N] or None,
    counters: new_counters(x.device) -> y: [M, N] in x's dtype; no host-device sync. `config`: None for
    default_config(). `programmatic_launch`: kernels/pdl.py, where the device has it."""
    y, num_rows, n, k = projection_output(x, weight, MAX_ROWS)
    if num_rows == 0:
        return y
    cfg = config or default_config(num_rows, n, k)
    block_m = max(16, triton.next_power_of_2(num_rows))
    stage_bytes = (cfg.block_n + block_m) * cfg.block_k * x.element_size()
    stages = max(1, min(cfg.num_stages, SMEM_BYTES // stage_bytes))
    k_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    num_tiles = triton.cdiv(n, cfg.block_n)
    assert cfg.split_k == 1 or num_tiles <= counters.numel(), "too many column tiles for the counters"
    ws = torch.empty(cfg.split_k * n * block_m if cfg.split_k > 1 else 1, dtype=torch.float32, device=x.device)
    _skinny_gemm_kernel[(num_tiles * cfg.split_k,)](
        x, weight, bias if bias is not None else x, y, ws, counters, num_rows, n, k, x.stride(0), weight.stride(0),
        y.stride(0), HAS_BIAS=bias is not None,
        EVEN_K=k % cfg.block_k == 0, SPLIT_K=cfg.split_k, K_SPLIT=k_split, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=cfg.num_warps,
        num_stages=stages, **pdl.launch_options(x.device, programmatic_launch))
    return y
