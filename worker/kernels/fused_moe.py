"""Triton kernels of the sparse MoE block: routing, expert GEMMs, SiLU-and-mul and the weighted sum.

Rows are FLAT by (token, choice): row t*K + j is token t's j-th chosen expert e = topk_ids[t, j].
fused_moe runs, in order:
    1. routing: softmax over E (float32), top-K, renormalise -> ws.topk_weights, ws.topk_ids
    2. grouping: T <= SMALL_BATCH_MAX_TOKENS: none, steps 3-6 run as kernels/moe_gemv.py's two fused GEMVs,
       which read each row's expert directly; otherwise rows are counting-sorted by expert, each expert padded
       to BLOCK_M tiles (kernels/moe_align.py)
    3. gate_up: ws.gate_up_out[row] = round(x[t] @ gate_up[e].T)       (float32 accumulate, one rounding)
    4. LoRA gate_up hook (kernels/moe_lora.py), then ws.act[row] = round(round(silu(g)) * u)
    5. down: ws.down_out[row] = round(act[row] @ down[e].T)           (not weighted yet)
    6. LoRA down hook, then out[t] = round(sum_j w[t, j] * down_out[t*K + j])
No host-device syncs, no allocations but the output: grids depend on host ints (T, K, E, sizes) only and
programs past the real work exit early, so a CUDA graph captured once replays any routing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels import moe_align, pdl
from worker.kernels.fused import silu_and_mul
from worker.kernels.moe_gemv import expert_scale_args, small_batch_moe
from worker.kernels.moe_lora import add_down_lora, add_gate_up_lora

SMALL_BATCH_MAX_TOKENS = 2      # T up to this runs kernels/moe_gemv.py (no sort, no tensor cores)
_BLOCK_M_SMALL, _BLOCK_M_LARGE = 16, 64


def _block_m(num_rows: int, num_experts: int) -> int:
    """Tiles of 16 rows while experts average at most 16 rows (each used expert read about once)."""
    return _BLOCK_M_SMALL if num_rows <= _BLOCK_M_SMALL * num_experts else _BLOCK_M_LARGE


class MoEWorkspace:
    """Every intermediate of a MoE layer's forward, allocated once (startup) and shared by all layers."""

    def __init__(self, max_tokens: int, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.max_tokens, self.num_experts, self.top_k = max_tokens, num_experts, top_k
        for name, (shape, dt) in self._buffers(max_tokens, num_experts, top_k, hidden_size, intermediate_size,
                                               dtype).items():
            setattr(self, name, torch.zeros(shape, dtype=dt, device=device))

    @staticmethod
    def _buffers(max_tokens, num_experts, top_k, hidden_size, intermediate_size, dtype) -> dict:
        rows = max_tokens * top_k
        padded = moe_align.max_padded_rows(rows, num_experts, _BLOCK_M_LARGE)
        chunks = moe_align.num_chunks(rows)
        return {
            "topk_weights": ((max_tokens, top_k), torch.float32),
            "topk_ids": ((max_tokens, top_k), torch.int32),
            "gate_up_out": ((rows, 2 * intermediate_size), dtype),       # [T*K, 2I]
            "act": ((rows, intermediate_size), dtype),                   # [T*K, I]
            "down_out": ((rows, hidden_size), dtype),                    # [T*K, H]
            "row_rank": ((rows,), torch.int32),                          # rank of a row within chunk and expert
            "chunk_hist": ((chunks, num_experts), torch.int32),          # rows per (chunk, expert)
            "chunk_base": ((chunks, num_experts), torch.int32),          # exclusive prefix of chunk_hist
            "expert_start": ((num_experts,), torch.int32),               # first slot of each expert
            "expert_count": ((num_experts,), torch.int32),               # real rows of each expert
            "total_padded": ((1,), torch.int32),                         # slots in use (device)
            "sorted_rows": ((padded,), torch.int32),                     # flat row per slot, pads = T*K
            "block_expert": ((triton.cdiv(padded, _BLOCK_M_SMALL),), torch.int32),   # expert of each tile
        }

    @staticmethod
    def num_bytes(max_tokens, num_experts, top_k, hidden_size, intermediate_size, dtype) -> int:
        """What __init__ allocates."""
        bufs = MoEWorkspace._buffers(max_tokens, num_experts, top_k, hidden_size, intermediate_size, dtype)
        return sum(torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size()
                   for shape, dt in bufs.values())


@triton.jit
def _route_kernel(logits_ptr, w_ptr, ids_ptr, num_experts, stride_t, TOP_K: tl.constexpr,
                  RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """Semantics, token t:
        p = softmax(float32(logits[t]));  ids[t], w[t] = top-K of p (largest first, ties: lower index first)
        if RENORMALIZE: w[t] /= sum(w[t])
    PDL: kernels/pdl.py.
    """
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    mask = offs < num_experts
    logits = tl.load(logits_ptr + t.to(tl.int64) * stride_t + offs, mask=mask, other=-float("inf")).to(tl.float32)
    e = tl.exp(logits - tl.max(logits, axis=0))
    p = e / tl.sum(e, axis=0)
    p = tl.where(mask & (p == p), p, -1.0)          # a NaN row (non-finite hidden state) picks experts 0, 1, ...
    slots = tl.arange(0, BLOCK_K)                                            # the K choices, padded
    weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    ids = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=0)
        idx = tl.minimum(tl.min(tl.where(p == best, offs, BLOCK_E), axis=0), num_experts - 1)   # always an expert
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, idx, ids)
        p = tl.where(offs == idx, -2.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    tl.store(w_ptr + t * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(ids_ptr + t * TOP_K + slots, ids, mask=slots < TOP_K)


@triton.jit
def _grouped_gemm_kernel(a_ptr, w_ptr, sorted_ptr, block_expert_ptr, total_ptr, out_ptr, num_rows, n, k,
                         stride_a, stride_we, stride_wn, stride_o, s_ptr, stride_se, stride_sn, stride_sk,
                         A_DIV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         DOT_PRECISION: tl.constexpr, SCALES: tl.constexpr, SCALE_BN: tl.constexpr,
                         SCALE_BK: tl.constexpr):
    """Semantics, tile b (slots [b*BLOCK_M, (b+1)*BLOCK_M) of sorted rows, all of expert e = block_expert[b]):
        out[r, :n] = round(a[r // A_DIV] @ W[e].T)    for each real row r = sorted[slot] (pads: r = num_rows)
    with W = w (SCALES 0), or w float8_e4m3fn times float32 scales s (W8A16: each tile converted to a's dtype,
    exact, and multiplied with a as it is): SCALES 1, per output row, W[e, j] = w[e, j] * s[e, j], the sum scaled at
    the end; SCALES 2, per (SCALE_BN x SCALE_BK) block, W[e, j, c] = w[e, j, c] * s[e, j // SCALE_BN, c // SCALE_BK],
    each BLOCK_K step's partial product scaled (BLOCK_K divides SCALE_BK). Tiles at or past total_padded exit at once.
    """
    b = tl.program_id(0)
    if b * BLOCK_M >= tl.load(total_ptr):
        return
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    rows = tl.load(sorted_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))           # [BLOCK_M]
    row_valid = rows < num_rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)                  # [BLOCK_N]
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (rows // A_DIV).to(tl.int64)[:, None] * stride_a + ks[None, :]          # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + e * stride_we + cols.to(tl.int64)[None, :] * stride_wn + ks[:, None]    # [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        k_mask = k0 + ks < k
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & (cols[None, :] < n), other=0.0)
        if SCALES == 0:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        elif SCALES == 1:
            acc = tl.dot(a, w.to(a.dtype), acc, input_precision=DOT_PRECISION)
        else:
            s = tl.load(s_ptr + e * stride_se + (cols // SCALE_BN) * stride_sn + (k0 // SCALE_BK) * stride_sk,
                        mask=cols < n, other=0.0)
            acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION) * s[None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if SCALES == 1:
        acc *= tl.load(s_ptr + e * stride_se + cols * stride_sn, mask=cols < n, other=0.0)[None, :]
    out_ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & (cols[None, :] < n))


@triton.jit
def _weighted_sum_kernel(y_ptr, w_ptr, out_ptr, hidden, stride_y, stride_o, TOP_K: tl.constexpr,
                         FLOAT32_WEIGHTS: tl.constexpr, BLOCK: tl.constexpr):
    """Semantics, token t:
        FLOAT32_WEIGHTS:  out[t] = round(sum_j w[t, j] * y[t*K + j])                  (Mixtral)
        otherwise:        out[t] = round(sum_j round(round(w[t, j]) * y[t*K + j]))    (Qwen)
    The sum is float32, rounded once; the reference instead adds each rounded term into out in x.dtype,
    expert by expert, so the two differ by the reference's K - 1 intermediate roundings.
    """
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        y = tl.load(y_ptr + (t * TOP_K + j).to(tl.int64) * stride_y + offs, mask=mask, other=0.0)
        w = tl.load(w_ptr + t * TOP_K + j)
        if FLOAT32_WEIGHTS:
            acc += w * y.to(tl.float32)
        else:
            acc += (w.to(y.dtype).to(tl.float32) * y.to(tl.float32)).to(y.dtype).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, ws: MoEWorkspace,
          programmatic_launch: bool = True) -> None:
    """router_logits [T, E] -> ws.topk_weights[:T] [T, K] float32, ws.topk_ids[:T] [T, K] int32."""
    num_tokens, num_experts = router_logits.shape
    assert router_logits.stride(1) == 1 and top_k == ws.top_k and num_experts == ws.num_experts
    _route_kernel[(num_tokens,)](router_logits, ws.topk_weights, ws.topk_ids, num_experts,
                                 router_logits.stride(0), TOP_K=top_k, RENORMALIZE=renormalize,
                                 BLOCK_E=triton.next_power_of_2(num_experts),
                                 BLOCK_K=triton.next_power_of_2(top_k), num_warps=1,
                                 **pdl.launch_options(router_logits.device, programmatic_launch))


def _expert_matmul(a, w, out, num_rows: int, a_div: int, ws: MoEWorkspace, grouping: tuple[int, int],
                   w_scale: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> None:
    """out[r] = round(a[r // a_div] @ W[ids[r]].T) for flat rows r < num_rows, W = w (times w_scale when w is
    FP8: moe_gemv.expert_scale_args); grouping: (block_m, n_blocks) from moe_align.align_by_expert."""
    n, k = w.shape[1], w.shape[2]
    assert a.stride(1) == 1 and w.stride(2) == 1 and out.stride(1) == 1
    block_m, n_blocks = grouping
    block_n = 64 if block_m == _BLOCK_M_SMALL else 128
    scale_args, scale_consts = expert_scale_args(w_scale, block, a)
    _grouped_gemm_kernel[(n_blocks, triton.cdiv(n, block_n))](
        a, w, ws.sorted_rows, ws.block_expert, ws.total_padded, out, num_rows, n, k, a.stride(0), w.stride(0),
        w.stride(1), out.stride(0), *scale_args, A_DIV=a_div, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=min(64, scale_consts["SCALE_BK"]) if block is not None else 64,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32", num_warps=4, num_stages=3, **scale_consts)


def fused_moe(x, router_logits, gate_up, down, top_k: int, renormalize: bool, float32_weights: bool,
              ws: MoEWorkspace, lora=None, programmatic_launch: bool = True, gate_up_scale=None, down_scale=None,
              block: tuple[int, int] | None = None) -> torch.Tensor:
    """x [T, H]; router_logits [T, E]; gate_up [E, 2I, H]; down [E, H, I] -> out [T, H] (x.dtype; out may be
    allocated with torch.empty, it is the layer output). T <= ws.max_tokens (assert). lora: a
    kernels/moe_lora.MoELoRAStep or None; programmatic_launch: kernels/pdl.py (the small-batch chain).
    FP8 experts: gate_up and down float8_e4m3fn, gate_up_scale / down_scale float32 per output row ([E, 2I],
    [E, H]) or per block ([E, cdiv(2I, bn), cdiv(H, bk)], [E, cdiv(H, bn), cdiv(I, bk)]) with block = (bn, bk):
    the GEMMs read them weight-only (x and the activations as they are, in their dtype).

    Semantics: reference.moe_route then reference.moe_experts (weights cast to x.dtype first unless
    float32_weights; FP8 experts: reference.fp8_moe_experts), except that the K weighted terms are summed in
    float32 and rounded once (module docstring, step 6)."""
    num_tokens, hidden = x.shape
    inter = down.shape[2]
    assert num_tokens <= ws.max_tokens, f"{num_tokens} tokens exceed the MoE workspace's {ws.max_tokens}"
    assert x.stride(1) == 1 and gate_up.shape[1] == 2 * inter
    out = torch.empty_like(x)                                                # [T, H]
    if num_tokens == 0:
        return out
    rows = num_tokens * top_k
    route(router_logits, top_k, renormalize, ws, programmatic_launch)
    h, act, y = ws.gate_up_out[:rows], ws.act[:rows], ws.down_out[:rows]    # [T*K, 2I], [T*K, I], [T*K, H]
    topk_ids = ws.topk_ids[:num_tokens]                                      # [T, K]
    if num_tokens <= SMALL_BATCH_MAX_TOKENS:
        small_batch_moe(x, gate_up, down, ws.topk_weights[:num_tokens], topk_ids, float32_weights, act, out, lora,
                        programmatic_launch, gate_up_scale=gate_up_scale, down_scale=down_scale, block=block)
        return out
    block_m = _block_m(rows, ws.num_experts)
    grouping = (block_m, moe_align.align_by_expert(ws.topk_ids, rows, ws.num_experts, block_m, ws))
    _expert_matmul(x, gate_up, h, rows, top_k, ws, grouping, gate_up_scale, block)
    if lora is not None:
        add_gate_up_lora(h, x, topk_ids, lora)
    silu_and_mul(h, programmatic_launch=False, out=act)
    _expert_matmul(act, down, y, rows, 1, ws, grouping, down_scale, block)
    if lora is not None:
        add_down_lora(y, act, topk_ids, lora)
    block = min(1024, triton.next_power_of_2(hidden))
    _weighted_sum_kernel[(num_tokens, triton.cdiv(hidden, block))](
        y, ws.topk_weights, out, hidden, y.stride(0), out.stride(0), TOP_K=top_k,
        FLOAT32_WEIGHTS=float32_weights, BLOCK=block, num_warps=4)
    return out
