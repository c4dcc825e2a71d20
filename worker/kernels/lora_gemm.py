"""Decode projection with its LoRA: y = x @ W^T (+ b) + every row's own adapter delta, in two launches.

A decode step of up to 64 sequences reads each projection's weight once; with a different adapter per row
it also reads every row's A and B. Run as cuBLAS plus shrink and expand kernels, the adapter bytes are read
by kernels beside the GEMM that compete with it for the same bandwidth, and the delta goes through a float32
buffer. Here:

- A shrink launch computes every row's xa (a GEMV against its slot's A, a few rank rows per program).
- The projection launch streams W and the rows' B together. Swapped operands: a program owns BLOCK_N output
  columns of every row and computes acc^T = W_tile @ x^T, so the weight is the tensor cores' wide operand
  ([BLOCK_N, BLOCK_K], K-contiguous as stored) and the few rows of x the narrow one. The expand is a GEMM
  over the batch's adapters: for rows j..j+G, the B rows of those rows' slots ([BLOCK_N, G*R], gathered)
  times Z ([G*R, BLOCK_M]: row m's xa in its own column, zeros elsewhere), added after the base sum; each B
  byte is read once per column tile.
- A column tile is cut into parts, each its own program: SPLIT_K parts along K (narrow projections: enough
  programs for every SM) and, with adapters, one more for the expand, so B is gathered by programs running
  beside the ones streaming W rather than after them. The last part of a tile to arrive (a per-tile counter)
  adds the parts' float32 sums in part order, so results do not depend on arrival order.
- On Hopper the projection launch is a programmatic dependent launch of the shrink: its programs start
  streaming W while the shrink runs; only the expand parts wait for the shrink's completion
  (griddepcontrol.wait). Without it the two launches simply run in turn.

The arrival counters live in one int32 buffer per device (`sync_buffer`), zero between launches: the last part
of each column tile resets its counter. Launches that share the buffer must therefore not run concurrently:
the engine issues them on one stream.

Rounding: xa is rounded to x's dtype, as lora_shrink writes it; the base sum, bias and scaled expand are
added in float32 and rounded once into y (reference.lora_gemm).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import triton
import triton.language as tl

MAX_ROWS = 64          # rows of x one launch takes (the narrow operand of the tensor-core tiles)
SYNC_WORDS = 4096      # arrival counters per device, one per column tile of a split launch
SHRINK_RANK_ROWS = 2   # xa entries one shrink program computes (2 x 2048 of A per step, as lora_shrink in decode)

_sync: dict[torch.device, torch.Tensor] = {}


def sync_buffer(device: torch.device) -> torch.Tensor:
    """The device's counters (zeros); allocated on first use, which must not be inside a CUDA-graph capture
    (a zero fill captured there would rerun on every replay)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _sync.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("lora_gemm: call once before capturing a CUDA graph (its counters are allocated then)")
        buf = _sync[device] = torch.zeros(SYNC_WORDS, dtype=torch.int32, device=device)
    return buf


@lru_cache(maxsize=None)
def _pdl(device: torch.device) -> bool:
    """Programmatic dependent launch: compiled kernels on compute capability 9.0+ (not the interpreter)."""
    return (device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


@dataclass(frozen=True)
class Config:
    block_n: int       # output columns per program (the tensor cores' M)
    block_k: int       # K per loop step
    split_k: int       # parts along K (narrow projections: enough programs for every SM)
    num_warps: int = 4
    num_stages: int = 4


@lru_cache(maxsize=None)       # called per launch; eager steps are bound by host time
def default_config(num_rows: int, n: int, k: int) -> Config:
    """Tiles for x [num_rows, k] @ W [n, k]^T, from bench/kernels_lora_gemm.py's sweep at 32 rows on an H100
    (Llama-3.1-8B shapes): 64 columns and 128 K per step in 5 stages; K cut in two when there are fewer than
    96 column tiles (o_proj and down_proj's 64), none above (qkv's 96, gate_up's 448 were slower cut)."""
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = min(128, max(16, triton.next_power_of_2(k)))
    split = 2 if triton.cdiv(n, block_n) < 96 and k >= 4 * block_k else 1
    return Config(block_n, block_k, split, num_warps=4, num_stages=5)


@triton.jit
def _shrink_row(x_ptr, a_ptr, xa_ptr, slots_ptr, ranks_ptr, m, s, r0, K, stride_xm, stride_aw, stride_an,
                stride_xam, R: tl.constexpr, RANK_ROWS: tl.constexpr, SHRINK_K: tl.constexpr):
    """xa[m, s*R + r] = round(x[m] @ a[slot, s*R + r]^T) for r in [r0, r0 + RANK_ROWS): zeros past the rank or
    base-only."""
    w = tl.load(slots_ptr + m)
    rank = tl.where(w >= 0, tl.load(ranks_ptr + tl.maximum(w, 0)), 0)
    offs_r = r0 + tl.arange(0, RANK_ROWS)
    offs_k = tl.arange(0, SHRINK_K)
    acc = tl.zeros((RANK_ROWS, SHRINK_K), dtype=tl.float32)
    if r0 < rank:
        a_ptrs = a_ptr + w.to(tl.int64) * stride_aw + (s * R + offs_r)[:, None] * stride_an + offs_k[None, :]
        x_ptrs = x_ptr + m * stride_xm + offs_k
        for k0 in range(0, K, SHRINK_K):
            mask_k = offs_k < K - k0
            a = tl.load(a_ptrs, mask=(offs_r < rank)[:, None] & mask_k[None, :], other=0.0)
            xv = tl.load(x_ptrs, mask=mask_k, other=0.0)
            acc += a.to(tl.float32) * xv.to(tl.float32)[None, :]
            a_ptrs += SHRINK_K
            x_ptrs += SHRINK_K
    xa = tl.sum(acc, axis=1)
    tl.store(xa_ptr + m * stride_xam + s * R + offs_r, xa.to(xa_ptr.dtype.element_ty))


@triton.jit
def _row_shrink_kernel(x_ptr, a_ptr, xa_ptr, slots_ptr, ranks_ptr, K, stride_xm, stride_aw, stride_an, stride_xam,
                       NUM_SLICES: tl.constexpr, R: tl.constexpr, RANK_ROWS: tl.constexpr, SHRINK_K: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """Semantics: xa[m, s*R + r] = round(x[m] @ a[slots[m], s*R + r]^T) for r < ranks[slots[m]], else 0
    (also for slots[m] = -1). Grid: (num_rows * NUM_SLICES, R // RANK_ROWS); program (m * NUM_SLICES + s, g)
    computes ranks g*RANK_ROWS ... of row m's slice s (few rows each: enough programs to stream A at full
    bandwidth beside the projection)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()     # the projection launch may start streaming W now
    pid = tl.program_id(0)
    _shrink_row(x_ptr, a_ptr, xa_ptr, slots_ptr, ranks_ptr, pid // NUM_SLICES, pid % NUM_SLICES,
                tl.program_id(1) * RANK_ROWS, K, stride_xm, stride_aw, stride_an, stride_xam, R, RANK_ROWS, SHRINK_K)


@triton.jit
def _expand_rows(acc, b_ptr, xa_ptr, slots_ptr, ranks_ptr, scalings_ptr, offs_n, offs_m, num_rows, lo, hi, s,
                 stride_bw, stride_bo, stride_sw, stride_xam, R: tl.constexpr, ROWS_PER_STEP: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """acc[n, m] += scalings[slot_m, s] * sum_r b[slot_m, n, r] * xa[m, s*R + r] for the columns n of slice s
    ([lo, hi)), ROWS_PER_STEP rows per step; rows without an adapter add nothing."""
    in_slice = (offs_n >= lo) & (offs_n < hi)
    q = tl.arange(0, ROWS_PER_STEP * R)            # column q of a step: row j0 + q // R, rank index q % R
    r = q % R
    delta = tl.zeros(acc.shape, dtype=tl.float32)
    for j0 in range(0, num_rows, ROWS_PER_STEP):
        j = j0 + q // R
        w = tl.load(slots_ptr + j, mask=j < num_rows, other=-1)
        rank = tl.load(ranks_ptr + tl.maximum(w, 0), mask=w >= 0, other=0)
        use = r < rank
        b = tl.load(b_ptr + w.to(tl.int64)[None, :] * stride_bw + offs_n[:, None] * stride_bo + r[None, :],
                    mask=in_slice[:, None] & use[None, :], other=0.0)                  # [BLOCK_N, G*R]
        xa = tl.load(xa_ptr + j * stride_xam + s * R + r, mask=use, other=0.0)         # [G*R]
        z = tl.where(offs_m[None, :] == j[:, None], xa[:, None], 0.0).to(b.dtype)     # [G*R, BLOCK_M]
        delta = tl.dot(b, z, delta, input_precision=DOT_PRECISION)
    w_m = tl.load(slots_ptr + offs_m, mask=offs_m < num_rows, other=-1)
    scale = tl.load(scalings_ptr + tl.maximum(w_m, 0) * stride_sw + s, mask=w_m >= 0, other=0.0)
    return acc + tl.where(in_slice[:, None], delta * scale[None, :], 0.0)


@triton.jit
def _base_part(x_ptr, w_ptr, offs_n, offs_m, mask_n, mask_m, k_lo, K, stride_xm, stride_wn, EVEN_K: tl.constexpr,
               K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT_PRECISION: tl.constexpr):
    """sum over k in [k_lo, k_lo + K_SPLIT) of w[n, k] * x[m, k]: [BLOCK_N, BLOCK_M] float32."""
    offs_k = tl.arange(0, BLOCK_K)
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
    return acc


@triton.jit(do_not_specialize=["num_rows"])
def _lora_gemm_kernel(
        x_ptr, w_ptr, bias_ptr, y_ptr, ws_ptr, sync_ptr, b_ptr, xa_ptr, slots_ptr, ranks_ptr, scalings_ptr,
        num_rows, N, K, stride_xm, stride_wn, stride_ym, stride_bw, stride_bo, stride_sw, stride_xam,
        SLICE_OFFSETS: tl.constexpr, NUM_SLICES: tl.constexpr, R: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_LORA: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_K: tl.constexpr, K_SPLIT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_PER_STEP: tl.constexpr,
        DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr):
    """Semantics (reference.lora_gemm), rows m < num_rows, columns n < N, slice s holding n, xa from
    _row_shrink_kernel:
        y[m, n] = round(x[m] @ w[n]^T (+ bias[n]) + scalings[slot_m, s] * sum_r xa[m, s*R + r] * b[slot_m, n, r])
    slot_m = slots[m]; -1 = no adapter (no delta). Sums in float32.

    Grid: (cdiv(N, BLOCK_N) * PARTS,), PARTS = SPLIT_K (+ 1 with HAS_LORA); program p is part p % PARTS of
    column tile p // PARTS: parts below SPLIT_K sum their share of K, the last (HAS_LORA) the rows' deltas.
    """
    PARTS: tl.constexpr = SPLIT_K + 1 if HAS_LORA else SPLIT_K
    tile = tl.program_id(0) // PARTS
    part = tl.program_id(0) % PARTS
    n0 = tile * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < num_rows
    if HAS_LORA:
        if part < SPLIT_K:
            acc = _base_part(x_ptr, w_ptr, offs_n, offs_m, mask_n, mask_m, part * K_SPLIT, K, stride_xm, stride_wn,
                             EVEN_K, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        else:
            # the expand part: B of the rows' slots, once the shrink launch has finished (xa complete)
            if USE_PDL:
                tl.extra.cuda.gdc_wait()
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in tl.static_range(NUM_SLICES):
                lo = SLICE_OFFSETS[s]
                hi = SLICE_OFFSETS[s + 1]
                if (n0 < hi) & (n0 + BLOCK_N > lo):
                    acc = _expand_rows(acc, b_ptr, xa_ptr, slots_ptr, ranks_ptr, scalings_ptr, offs_n, offs_m,
                                       num_rows, lo, hi, s, stride_bw, stride_bo, stride_sw, stride_xam, R,
                                       ROWS_PER_STEP, DOT_PRECISION)
    else:
        acc = _base_part(x_ptr, w_ptr, offs_n, offs_m, mask_n, mask_m, part * K_SPLIT, K, stride_xm, stride_wn,
                         EVEN_K, K_SPLIT, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
    last = True
    if PARTS > 1:
        # ws[p, n, m]: part p's sum; the last part to arrive adds them in part order
        ws_tile = ws_ptr + offs_n[:, None] * BLOCK_M + offs_m[None, :]
        tl.store(ws_tile + part * N * BLOCK_M, acc, mask=mask_n[:, None])
        tl.debug_barrier()
        arrived = tl.atomic_add(sync_ptr + tile, 1, sem="acq_rel")
        last = arrived == PARTS - 1
        if last:
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for p in tl.static_range(PARTS):
                acc += tl.load(ws_tile + p * N * BLOCK_M, mask=mask_n[:, None], other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(sync_ptr + tile, 0)
    if last:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[:, None]
        y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])


@dataclass(frozen=True)
class RowLoRA:
    """Each row's adapter for lora_gemm: the projection's slot pool (layers/linear.LoRAWeights) and the slot
    of every row (-1: none)."""
    a: torch.Tensor                  # [num_slots, num_slices * R, K]
    b: torch.Tensor                  # [num_slots, N, R]
    slots: torch.Tensor              # [>= num_rows] int32
    ranks: torch.Tensor              # [num_slots] int32
    scalings: torch.Tensor           # [num_slots, num_slices] float32
    slice_offsets: Sequence[int]     # [num_slices + 1] host ints (compiled in)


def lora_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, lora: RowLoRA | None = None,
              cfg: Config | None = None) -> torch.Tensor:
    """x: [M, K] (M <= MAX_ROWS, unit stride along K), weight: [N, K] contiguous, bias: [N] or None
    -> y: [M, N] in x's dtype, with each row's LoRA delta when `lora` is given (module docstring); no
    host-device sync. `cfg` overrides default_config() (benchmarks)."""
    num_rows, k = x.shape
    n = weight.shape[0]
    assert num_rows <= MAX_ROWS and weight.shape[1] == k and weight.is_contiguous() and x.stride(1) == 1
    y = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y
    cfg = cfg or default_config(num_rows, n, k)
    block_m = max(16, triton.next_power_of_2(num_rows))
    k_split = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k) * cfg.block_k
    num_tiles = triton.cdiv(n, cfg.block_n)
    sync = sync_buffer(x.device)
    parts = cfg.split_k + (lora is not None)
    ws = torch.empty(parts * n * block_m if parts > 1 else 1, dtype=torch.float32, device=x.device)
    assert parts == 1 or num_tiles <= SYNC_WORDS, "too many column tiles for the counters"
    pdl = _pdl(x.device)
    if lora is not None:
        offsets = tuple(int(o) for o in lora.slice_offsets)
        num_slices, rank_slot = len(offsets) - 1, lora.b.shape[2]
        assert rank_slot & (rank_slot - 1) == 0 and rank_slot <= 128, "slot rank: a power of two up to 128"
        assert offsets[0] == 0 and offsets[-1] == n and lora.a.shape[1:] == (num_slices * rank_slot, k)
        assert lora.b.shape[1] == n and lora.a.stride(2) == 1 and lora.b.stride(2) == 1
        assert lora.scalings.shape == (lora.a.shape[0], num_slices) and lora.scalings.stride(1) == 1
        b, slots, ranks, scalings = lora.b, lora.slots, lora.ranks, lora.scalings
        xa = torch.empty(num_rows, num_slices * rank_slot, dtype=x.dtype, device=x.device)
        rank_rows = min(SHRINK_RANK_ROWS, rank_slot)
        _row_shrink_kernel[(num_rows * num_slices, rank_slot // rank_rows)](
            x, lora.a, xa, slots, ranks, k, x.stride(0), lora.a.stride(0), lora.a.stride(1), xa.stride(0),
            NUM_SLICES=num_slices, R=rank_slot, RANK_ROWS=rank_rows, SHRINK_K=min(triton.next_power_of_2(k), 2048),
            USE_PDL=pdl, num_warps=4)
    else:
        offsets, num_slices, rank_slot = (0, n), 1, 16
        b = xa = x                       # never read: the LoRA code is not compiled without HAS_LORA
        slots = ranks = sync
        scalings = ws
    extra = {"launch_pdl": True} if pdl and lora is not None else {}
    _lora_gemm_kernel[(num_tiles * parts,)](
        x, weight, bias if bias is not None else x, y, ws, sync, b, xa, slots, ranks, scalings,
        num_rows, n, k, x.stride(0), weight.stride(0), y.stride(0), b.stride(0), b.stride(1), scalings.stride(0),
        xa.stride(0),
        SLICE_OFFSETS=offsets, NUM_SLICES=num_slices, R=rank_slot, HAS_BIAS=bias is not None,
        HAS_LORA=lora is not None, EVEN_K=k % cfg.block_k == 0, SPLIT_K=cfg.split_k, K_SPLIT=k_split,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROWS_PER_STEP=256 // rank_slot,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", USE_PDL=pdl and lora is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra)
    return y
