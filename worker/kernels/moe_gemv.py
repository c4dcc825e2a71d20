"""The MoE block at one or two tokens: two fused GEMV kernels, expert LoRA inside them.

At decode batch 1 a MoE layer reads only its token's K chosen experts (Qwen3-30B-A3B: 8 of 128, 75 MB a layer),
and every kernel boundary costs about as much as a kernel: the sorted path's route, gate_up, SiLU-and-mul, down
and weighted sum (and two LoRA hooks of two launches each) are nine launches for ~25 µs of weight bytes on an
H100. Here the block is at most five launches, each with programmatic dependent launch (kernels/pdl.py):

    route (kernels/fused_moe.py)  ->  [LoRA: gate/up shrink]  ->  gate_up + LoRA expand + SiLU-and-mul
                            ->  [LoRA: down shrink]     ->  down + LoRA expand + routing-weighted sum

Rows are FLAT by (token, choice) as in kernels/fused_moe.py: row t*K + j is token t's j-th expert e = topk_ids[t, j],
its adapter w = token_lora_slots[t] (-1: none). Each GEMV program streams BLOCK_N whole rows of its expert's weights
K-contiguous in BLOCK_K steps and reduces once at the end, as kernels/gemv.py does for dense projections. The
shrinks are kernels/moe_lora.py's per-row shrink (xa = rows @ A^T, float32, in the MoE-LoRA workspace); the
expand of each row is done by the program that writes the row's columns, so the deltas never go to memory.

Every value is the one the sorted path computes (kernels/fused_moe.py steps 3-6 with kernels/moe_lora.py's hooks):
the same roundings in the same places, the K weighted terms summed in the same order; only the order of the
float32 sums inside a dot product differs. No host-device syncs, no allocations: grids depend on host ints.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels import pdl
from worker.kernels.moe_lora import MoELoRAStep, shrink_rows


@triton.jit
def _gate_up_act_kernel(
        x_ptr, w_ptr, ids_ptr, act_ptr, inter, hidden, stride_x, stride_we, stride_wn, stride_act,
        xa_ptr, b_ptr, scalings_ptr, token_lora_slots_ptr, ranks_ptr, shared_ptr,
        stride_xa, stride_bw, stride_be, stride_bn, stride_sw, stride_shared, s_ptr, stride_se, stride_sn, stride_sk,
        TOP_K: tl.constexpr, HAS_LORA: tl.constexpr, MAX_RANK: tl.constexpr, BLOCK_R: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SCALES: tl.constexpr,
        SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, PDL: tl.constexpr):
    """Semantics, flat row r = t*K + j, e = ids[r], columns n < I of this program:
        g = round(x[t] @ gate_up[e, n]),  u = round(x[t] @ gate_up[e, I + n])          (float32 sums)
        HAS_LORA, w = token_lora_slots[t] >= 0, rank = ranks[w], xr = t*K if shared_outer[w] else r:
            g = round(g + scalings[w, 0] * sum_{q < rank} xa[xr, q] * gate_up_b[w, e, n, q])          (if scaling != 0)
            u = round(u + scalings[w, 1] * sum_{q < rank} xa[xr, R + q] * gate_up_b[w, e, I + n, q])  (if scaling != 0)
        act[r, n] = round(round(silu(g)) * u)
    FP8 experts (SCALES 1: per output row, 2: per block; expert_scale_args): gate_up[e] above is
    w[e] times its float32 scales, applied to each row's sum (1) or to each weight of a BLOCK_K step, which lies in
    one column block (2). Program (row, column block). Longer than a helper-sized function because the gate and up GEMVs, their LoRA
    expands and the activation share one pass over x and the row's weights in registers: split into helpers, the
    two accumulators and the LoRA operands would be returned through Triton tuples and spill at decode shapes."""
    pdl.launch_dependents(PDL)
    row = tl.program_id(0)
    t = row // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    pdl.wait(PDL)
    e = tl.load(ids_ptr + row).to(tl.int64)
    g_ptrs = w_ptr + e * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]   # [N, K]
    u_ptrs = g_ptrs + inter * stride_wn
    x_ptrs = x_ptr + t.to(tl.int64) * stride_x + offs_k
    acc_g = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        if EVEN_K:
            mask = n_mask[:, None]
            x = tl.load(x_ptrs).to(tl.float32)
        else:
            k_mask = offs_k < hidden - k0
            mask = n_mask[:, None] & k_mask[None, :]
            x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        gw = tl.load(g_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        uw = tl.load(u_ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if SCALES == 2:
            s_col = s_ptr + e * stride_se + (k0 // SCALE_BK) * stride_sk
            gw *= tl.load(s_col + (offs_n // SCALE_BN) * stride_sn, mask=n_mask, other=0.0)[:, None]
            uw *= tl.load(s_col + ((inter + offs_n) // SCALE_BN) * stride_sn, mask=n_mask, other=0.0)[:, None]
        acc_g += gw * x[None, :]
        acc_u += uw * x[None, :]
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    dtype = act_ptr.dtype.element_ty
    g = tl.sum(acc_g, axis=1)                                                # [N]
    u = tl.sum(acc_u, axis=1)
    if SCALES == 1:
        g *= tl.load(s_ptr + e * stride_se + offs_n * stride_sn, mask=n_mask, other=0.0)
        u *= tl.load(s_ptr + e * stride_se + (inter + offs_n) * stride_sn, mask=n_mask, other=0.0)
    g = g.to(dtype)
    u = u.to(dtype)
    if HAS_LORA:
        w = tl.load(token_lora_slots_ptr + t)
        if w >= 0:
            rank = tl.load(ranks_ptr + w)
            shared = tl.load(shared_ptr + w.to(tl.int64) * stride_shared) != 0
            xa_row = xa_ptr + tl.where(shared, t * TOP_K, row).to(tl.int64) * stride_xa
            offs_r = tl.arange(0, BLOCK_R)
            r_mask = offs_r < rank
            b_rows = (b_ptr + w.to(tl.int64) * stride_bw + e * stride_be
                      + offs_n.to(tl.int64)[:, None] * stride_bn + offs_r[None, :])                # [N, R]
            b_mask = n_mask[:, None] & r_mask[None, :]
            scale_g = tl.load(scalings_ptr + w.to(tl.int64) * stride_sw)
            scale_u = tl.load(scalings_ptr + w.to(tl.int64) * stride_sw + 1)
            if scale_g != 0:
                xa = tl.load(xa_row + offs_r, mask=r_mask, other=0.0)
                b = tl.load(b_rows, mask=b_mask, other=0.0).to(tl.float32)
                g = (g.to(tl.float32) + tl.sum(b * xa[None, :], axis=1) * scale_g).to(dtype)
            if scale_u != 0:
                xa = tl.load(xa_row + MAX_RANK + offs_r, mask=r_mask, other=0.0)
                b = tl.load(b_rows + inter * stride_bn, mask=b_mask, other=0.0).to(tl.float32)
                u = (u.to(tl.float32) + tl.sum(b * xa[None, :], axis=1) * scale_u).to(dtype)
    g32 = g.to(tl.float32)
    silu = (g32 / (1.0 + tl.exp(-g32))).to(dtype).to(tl.float32)
    tl.store(act_ptr + row.to(tl.int64) * stride_act + offs_n, (silu * u.to(tl.float32)).to(dtype), mask=n_mask)


@triton.jit
def _down_sum_kernel(
        act_ptr, w_ptr, ids_ptr, topk_w_ptr, out_ptr, hidden, inter, stride_act, stride_we, stride_wn, stride_out,
        xa_ptr, b_ptr, scalings_ptr, token_lora_slots_ptr, ranks_ptr, shared_ptr,
        stride_xa, stride_bw, stride_be, stride_bn, stride_sw, stride_shared, s_ptr, stride_se, stride_sn, stride_sk,
        TOP_K: tl.constexpr, BLOCK_J: tl.constexpr, FLOAT32_WEIGHTS: tl.constexpr, HAS_LORA: tl.constexpr,
        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
        SCALES: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr, PDL: tl.constexpr):
    """Semantics, token t, columns n < H of this program, for each choice j (row r = t*K + j, e = ids[r]):
        y_j = round(act[r] @ down[e, n])                                                       (float32 sum)
        HAS_LORA, w = token_lora_slots[t] >= 0, scalings[w, 2] != 0, eb = 0 if shared_outer[w] else e:
            y_j = round(y_j + scalings[w, 2] * sum_{q < ranks[w]} xa[r, q] * down_b[w, eb, n, q])
        FLOAT32_WEIGHTS:  out[t, n] = round(sum_j w[t, j] * y_j)                        (Mixtral)
        otherwise:        out[t, n] = round(sum_j round(round(w[t, j]) * y_j))          (Qwen)
    the sum over j in float32, in order j = 0, 1, ... (kernels/fused_moe.py's weighted sum). Program (token, column
    block); the K rows are one [BLOCK_J, BLOCK_N, BLOCK_K] tile of weights per step. FP8 experts: down[e] is w[e]
    times its scales, as in _gate_up_act_kernel. Long for the reason
    _gate_up_act_kernel is: the GEMV, the LoRA expand and the routing-weighted sum share the tile's registers."""
    pdl.launch_dependents(PDL)
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    offs_j = tl.arange(0, BLOCK_J)
    j_mask = offs_j < TOP_K
    rows = t * TOP_K + offs_j                                                # [J]
    offs_k = tl.arange(0, BLOCK_K)
    pdl.wait(PDL)
    e = tl.load(ids_ptr + rows, mask=j_mask, other=0).to(tl.int64)           # [J]
    w_ptrs = (w_ptr + e[:, None, None] * stride_we + offs_n.to(tl.int64)[None, :, None] * stride_wn
              + offs_k[None, None, :])                                       # [J, N, K]
    a_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_act + offs_k[None, :]   # [J, K]
    jn_mask = j_mask[:, None] & n_mask[None, :]
    acc = tl.zeros((BLOCK_J, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        if EVEN_K:
            wt = tl.load(w_ptrs, mask=jn_mask[:, :, None], other=0.0, eviction_policy="evict_first")
            a = tl.load(a_ptrs, mask=j_mask[:, None], other=0.0)
        else:
            k_mask = offs_k < inter - k0
            wt = tl.load(w_ptrs, mask=jn_mask[:, :, None] & k_mask[None, None, :], other=0.0,
                         eviction_policy="evict_first")
            a = tl.load(a_ptrs, mask=j_mask[:, None] & k_mask[None, :], other=0.0)
        wt = wt.to(tl.float32)
        if SCALES == 2:
            wt *= tl.load(s_ptr + e[:, None] * stride_se + (offs_n // SCALE_BN)[None, :] * stride_sn
                          + (k0 // SCALE_BK) * stride_sk, mask=jn_mask, other=0.0)[:, :, None]
        acc += wt * a.to(tl.float32)[:, None, :]
        w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    y = tl.sum(acc, axis=2)                                                  # [J, N]
    if SCALES == 1:
        y *= tl.load(s_ptr + e[:, None] * stride_se + offs_n[None, :] * stride_sn, mask=jn_mask, other=0.0)
    y = y.to(dtype)
    if HAS_LORA:
        w = tl.load(token_lora_slots_ptr + t)
        if w >= 0:
            scale = tl.load(scalings_ptr + w.to(tl.int64) * stride_sw + 2)
            if scale != 0:
                rank = tl.load(ranks_ptr + w)
                shared = tl.load(shared_ptr + w.to(tl.int64) * stride_shared) != 0
                eb = tl.where(shared, 0, e)                                  # [J]
                offs_r = tl.arange(0, BLOCK_R)
                r_mask = offs_r < rank
                xa = tl.load(xa_ptr + rows.to(tl.int64)[:, None] * stride_xa + offs_r[None, :],
                             mask=j_mask[:, None] & r_mask[None, :], other=0.0)                      # [J, R]
                b = tl.load(b_ptr + w.to(tl.int64) * stride_bw + eb[:, None, None] * stride_be
                            + offs_n.to(tl.int64)[None, :, None] * stride_bn + offs_r[None, None, :],
                            mask=jn_mask[:, :, None] & r_mask[None, None, :], other=0.0)            # [J, N, R]
                y = (y.to(tl.float32) + tl.sum(b.to(tl.float32) * xa[:, None, :], axis=2) * scale).to(dtype)
    weights = tl.load(topk_w_ptr + t * TOP_K + offs_j, mask=j_mask, other=0.0)    # [J] float32
    if FLOAT32_WEIGHTS:
        terms = weights[:, None] * y.to(tl.float32)
    else:
        terms = (weights.to(dtype).to(tl.float32)[:, None] * y.to(tl.float32)).to(dtype).to(tl.float32)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):                          # in order, as the weighted-sum kernel adds them
        total += tl.sum(tl.where(offs_j[:, None] == j, terms, 0.0), axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + offs_n, total.to(dtype), mask=n_mask)


def _gate_up_config(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): 2 gate and 2 up rows of up to 512 columns a step (4 KB of bf16 weights);
    the best or within 1% of it at Qwen3-30B-A3B's and Mixtral's shapes, 1 and 2 tokens, on an H100
    (`python -m bench.kernels_moe_gemv --sweep`, BENCHMARKS.md)."""
    return 2, min(512, triton.next_power_of_2(hidden)), 4


def _down_config(top_k: int, inter: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps): 2 output columns of each of the K experts, 4,096 weights a step."""
    block_j = triton.next_power_of_2(top_k)
    return 2, min(max(16, 2048 // block_j), triton.next_power_of_2(inter)), 4


def _lora_args(lora: MoELoRAStep | None, b_name: str, placeholder: torch.Tensor) -> tuple[list, dict]:
    """The kernels' LoRA pointer/stride arguments and constexprs for the B of `b_name` (gate_up_b or down_b); a
    placeholder tensor, never read, without LoRA."""
    if lora is None:
        return [placeholder] * 6 + [0] * 6, dict(HAS_LORA=False, BLOCK_R=1)
    w, ws = lora.weights, lora.workspace
    b = getattr(w, b_name)
    assert b.stride(3) == 1 and w.scalings.stride(1) == 1
    return ([ws.xa, b, w.scalings, lora.token_lora_slots, lora.ranks, w.shared_outer,
             ws.xa.stride(0), b.stride(0), b.stride(1), b.stride(2), w.scalings.stride(0), w.shared_outer.stride(0)],
            dict(HAS_LORA=True, BLOCK_R=triton.next_power_of_2(ws.max_rank)))


def expert_scale_args(scale: torch.Tensor | None, block: tuple[int, int] | None, placeholder: torch.Tensor
                      ) -> tuple[list, dict]:
    """The expert kernels' scale arguments: [pointer, stride over experts, over rows, over column blocks] and the
    SCALES, SCALE_BN, SCALE_BK constexprs. scale: None (w in the compute dtype), float32 [E, rows] (per output
    row) or [E, cdiv(rows, bn), cdiv(cols, bk)] (block (bn, bk), bk a power of two >= 16)."""
    if scale is None:
        return [placeholder, 0, 0, 0], dict(SCALES=0, SCALE_BN=1, SCALE_BK=1)
    assert scale.dtype == torch.float32
    if block is None:
        return [scale, scale.stride(0), scale.stride(1), 0], dict(SCALES=1, SCALE_BN=1, SCALE_BK=1)
    assert block[1] & (block[1] - 1) == 0 and block[1] >= 16, f"block_k must be a power of two >= 16, got {block[1]}"
    return [scale, *scale.stride()], dict(SCALES=2, SCALE_BN=block[0], SCALE_BK=block[1])


def small_batch_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, float32_weights: bool, act: torch.Tensor, out: torch.Tensor,
                    lora: MoELoRAStep | None = None, programmatic_launch: bool = True, configs: dict | None = None,
                    gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                    block: tuple[int, int] | None = None) -> None:
    """The experts of a routed batch of a few tokens into out (module docstring).

    x: [T, H]; gate_up: [E, 2I, H]; down: [E, H, I]; topk_weights: [T, K] float32 and topk_ids: [T, K] int32
    (kernels/moe.route's, contiguous); act: a [T*K, I] buffer (the MoE workspace's); out: [T, H] (x.dtype).
    lora: a kernels/moe_lora.MoELoRAStep or None. configs: {"gate_up" | "down": (BLOCK_N, BLOCK_K, num_warps)}
    to override the defaults (bench/kernels_moe_gemv.py sweeps them). FP8 experts: gate_up and down in
    float8_e4m3fn with their scales (kernels/fused_moe.fused_moe).
    """
    num_tokens, hidden = x.shape
    top_k, inter = topk_ids.shape[1], down.shape[2]
    rows = num_tokens * top_k
    assert x.stride(1) == 1 and gate_up.stride(2) == 1 and down.stride(2) == 1 and gate_up.shape[1] == 2 * inter
    assert topk_ids.is_contiguous() and topk_weights.is_contiguous() and act.stride(1) == 1 and out.stride(1) == 1
    launch = pdl.launch_options(x.device, programmatic_launch)
    configs = configs or {}

    if lora is not None:
        shrink_rows(x, topk_ids, lora, gate_up=True, programmatic_launch=programmatic_launch)
    args, consts = _lora_args(lora, "gate_up_b", topk_ids)
    block_n, block_k, warps = configs.get("gate_up") or _gate_up_config(hidden)
    max_rank = lora.workspace.max_rank if lora is not None else 1
    scale_args, scale_consts = expert_scale_args(gate_up_scale, block, topk_ids)
    if block is not None:
        block_k = min(block_k, block[1])             # a step in one column block
    _gate_up_act_kernel[(rows, triton.cdiv(inter, block_n))](
        x, gate_up, topk_ids, act, inter, hidden, x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        *args, *scale_args, TOP_K=top_k, MAX_RANK=max_rank, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=hidden % block_k == 0, num_warps=warps, **consts, **scale_consts, **launch)

    if lora is not None:
        shrink_rows(act[:rows], topk_ids, lora, gate_up=False, programmatic_launch=programmatic_launch)
    args, consts = _lora_args(lora, "down_b", topk_ids)
    block_n, block_k, warps = configs.get("down") or _down_config(top_k, inter)
    scale_args, scale_consts = expert_scale_args(down_scale, block, topk_ids)
    if block is not None:
        block_k = min(block_k, block[1])
    _down_sum_kernel[(num_tokens, triton.cdiv(hidden, block_n))](
        act, down, topk_ids, topk_weights, out, hidden, inter, act.stride(0), down.stride(0), down.stride(1),
        out.stride(0), *args, *scale_args, TOP_K=top_k, BLOCK_J=triton.next_power_of_2(top_k), FLOAT32_WEIGHTS=float32_weights,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=inter % block_k == 0, num_warps=warps, **consts, **scale_consts,
        **launch)
