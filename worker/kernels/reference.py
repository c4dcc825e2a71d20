"""Torch references of every kernel. CPU runs use these; kernel tests compare the Triton kernels to them.

All references loop over segments / sequences on the host, so they read the `_host` copies of the
metadata and must never run inside a CUDA graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# an FP8 KV cache (--kv-cache-dtype fp8): its element type, and the largest value it holds (torch.finfo's max)
KV_FP8_DTYPE = torch.float8_e4m3fn
KV_FP8_MAX = 448.0


def lora_shrink(x: torch.Tensor, a: torch.Tensor, seg_indptr: list[int], seg_lora_slots: list[int],
                ranks: list[int], num_slices: int) -> torch.Tensor:
    """Semantics:
        for each segment i with w = seg_lora_slots[i] >= 0, tokens t in [seg_indptr[i], seg_indptr[i+1]):
            for each slice s, r < min(ranks[w], R):
                xa[t, s*R + r] = sum_k x[t, k] * a[w, s*R + r, k]
        every other entry of xa is 0 (base-only segments, and ranks past the adapter's own). R = a's rows per
        slice: max_lora_rank, or a fully sharded rank's share of it (layers/linear.py), which may be below ranks[w].

    x: [num_tokens, in_dim]; a: [num_slots, num_slices * R, in_dim] -> xa: [num_tokens, num_slices * R]
    """
    max_rank = a.shape[1] // num_slices
    xa = x.new_zeros(x.shape[0], a.shape[1])
    for i, w in enumerate(seg_lora_slots):
        if w < 0:
            continue
        lo, hi, r = seg_indptr[i], seg_indptr[i + 1], min(ranks[w], max_rank)
        for s in range(num_slices):
            cols = slice(s * max_rank, s * max_rank + r)
            xa[lo:hi, cols] = x[lo:hi] @ a[w, cols].T
    return xa


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, seg_indptr: list[int],
                seg_lora_slots: list[int], ranks: list[int], scalings: torch.Tensor,
                slice_offsets: list[int]) -> None:
    """Semantics (in place on y):
        for each segment i with w = seg_lora_slots[i] >= 0, tokens t in [seg_indptr[i], seg_indptr[i+1]):
            for each slice s, output column o in [slice_offsets[s], slice_offsets[s+1]):
                y[t, o] += scalings[w, s] * sum_{r < ranks[w]} xa[t, s*R + r] * b[w, o, r]

    y: [num_tokens, out_dim]; xa: [num_tokens, num_slices * R]; b: [num_slots, out_dim, R];
    scalings: [num_slots, num_slices] float32
    """
    max_rank = b.shape[2]
    for i, w in enumerate(seg_lora_slots):
        if w < 0:
            continue
        lo, hi, r = seg_indptr[i], seg_indptr[i + 1], ranks[w]
        for s in range(len(slice_offsets) - 1):
            o0, o1 = slice_offsets[s], slice_offsets[s + 1]
            delta = xa[lo:hi, s * max_rank:s * max_rank + r] @ b[w, o0:o1, :r].T
            y[lo:hi, o0:o1] += (scalings[w, s] * delta.float()).to(y.dtype)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             kv_slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Semantics: k_cache.view(-1, H, D)[kv_slot_mapping[t]] = stored(k[t], k_scale) (same for v), where
        stored(x, s) = x                                                   for a cache in the model's dtype
        stored(x, s) = float8_e4m3fn(clamp(float32(x) / float32(s), -448, 448))   for an FP8 cache
    (vLLM's convention: the scale multiplies the stored value back, paged_attention; round to nearest even; the
    clamp first because CUDA casts values past 448 to NaN where the CPU saturates). A cache in the model's dtype
    ignores the scales.

    k, v: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    """
    k_cache.view(-1, *k_cache.shape[2:])[kv_slot_mapping] = quantize_kv(k, k_scale, k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[kv_slot_mapping] = quantize_kv(v, v_scale, v_cache.dtype)


def quantize_kv(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `cache_dtype` stores it (store_kv's `stored`)."""
    if cache_dtype != KV_FP8_DTYPE:
        return x
    divisor = torch.tensor(scale, dtype=torch.float32, device=x.device)
    return (x.float() / divisor).clamp(-KV_FP8_MAX, KV_FP8_MAX).to(KV_FP8_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 values of cache entries x: float32(x) * float32(scale) for FP8, float32(x) otherwise."""
    if x.dtype != KV_FP8_DTYPE:
        return x.float()
    return x.float() * torch.tensor(scale, dtype=torch.float32, device=x.device)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                    scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Semantics: sequence i has n_i = query_start_loc[i+1] - query_start_loc[i] new tokens, the last n_i of
    its seq_lens[i] context positions. Each new token at context position p attends (causally) to the
    cached K/V of positions [0, p] of its sequence, read through block_tables[i]; KV head of query head h
    is h // (num_heads // num_kv_heads) (GQA). Prefill, extend and decode are the same formula. K and V are read
    as dequantize_kv(entry, k_scale / v_scale): an FP8 entry times its scale, in float32 (the scales are ignored
    for a cache in the model's dtype). Everything after the read is float32, rounded to q's dtype once.

    q: [num_tokens, num_heads, head_dim] -> out: [num_tokens, num_heads, head_dim]
    """
    num_heads, block_size = q.shape[1], k_cache.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.empty_like(q)
    for i, ctx in enumerate(seq_lens):
        lo, hi = query_start_loc[i], query_start_loc[i + 1]
        n_blocks = (ctx + block_size - 1) // block_size
        blocks = block_tables[i, :n_blocks].long()
        k = dequantize_kv(k_cache[blocks].flatten(0, 1)[:ctx], k_scale)   # k: [ctx, num_kv_heads, head_dim] float32
        v = dequantize_kv(v_cache[blocks].flatten(0, 1)[:ctx], v_scale)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)   # [ctx, num_heads, head_dim]
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), k) * scale  # [heads, n, ctx]
        q_pos = torch.arange(ctx - (hi - lo), ctx, device=q.device)
        causal = torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None]      # [n, ctx]
        scores.masked_fill_(causal, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics: with residual, residual <- x + residual (in place, x's dtype) and v = residual, else v = x;
    out = weight * round(v * rsqrt(mean(v^2) + eps)), the mean in float32. x: [..., D]."""
    if residual is not None:
        residual.add_(x)
        x = residual
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return weight * normed


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Semantics (in place, rotate-half layout): x <- x * cos[p] + rotate_half(x) * sin[p] for q and k,
    where rotate_half([x1, x2]) = [-x2, x1]. q: [T, Hq, D]; k: [T, Hk, D]; cos, sin: [max_positions, D]."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    for x in (q, k):
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        x.copy_(x * c + rotated * s)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Semantics: out = silu(x[:, :I]) * x[:, I:] for x: [T, 2I]."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Semantics: y[m, n] = round(sum_k x[m, k] * weight[n, k] (+ bias[n])), the sum in float32.

    x: [M, K], weight: [N, K], bias: [N] -> y: [M, N] in x's dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


FP8_MAX = 448.0     # float8_e4m3fn's largest finite value
FP8_AMAX_FLOOR = 1e-10   # kernels/fp8_quant.EPS: the smallest amax a dynamic scale is taken from


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """Semantics: W[..., n, k] = float32(weight[..., n, k]) * scale[..., n]                    (block None)
                  W[..., n, k] = float32(weight[..., n, k]) * scale[..., n // bn, k // bk]     (block (bn, bk))
    weight: [..., N, K] float8_e4m3fn; scale: float32 [..., N] or [..., cdiv(N, bn), cdiv(K, bk)] -> float32."""
    w = weight.float()
    if block is None:
        return w * scale.float()[..., None]
    n, k = w.shape[-2:]
    s = scale.float().repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return w * s[..., :n, :k]


def fp8_quantize_activations(x: torch.Tensor, group: int | None,
                             input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics of kernels/fp8_quant.quantize_fp8: each row of x cut into groups of `group` columns (None: one
    group, per token), s = input_scale[0] if given else max(amax of the group, FP8_AMAX_FLOOR) / 448,
    q = fp8(clamp(x / s, -448, 448)). x: [M, K] -> (q [M, K] float8_e4m3fn, scale [M, cdiv(K, group)] float32)."""
    num_rows, k = x.shape
    group = k if group is None else group
    num_groups = -(-k // group)
    x32 = torch.nn.functional.pad(x.float(), (0, num_groups * group - k)).view(num_rows, num_groups, group)
    if input_scale is not None:
        scale = input_scale.float().reshape(1, 1).expand(num_rows, num_groups).contiguous()
    else:
        amax = x32.abs().amax(dim=-1).clamp(min=FP8_AMAX_FLOOR)
        scale = amax / torch.full_like(amax, FP8_MAX)      # IEEE division: CUDA multiplies by 1/448 for a scalar
    q = (x32 / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(num_rows, -1)[:, :k], scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, input_scale: torch.Tensor | None,
               block: tuple[int, int] | None, bias: torch.Tensor | None, quantize_input: bool) -> torch.Tensor:
    """Semantics of kernels/ops.fp8_linear, in float32 (rounded once to x's dtype):
        W = fp8_dequantize(weight, weight_scale, block)                                    # [N, K]
        quantize_input (the W8A8 kernels):  xq, s = fp8_quantize_activations(x, bk or None, input_scale)
                                            X[m, k] = float32(xq[m, k]) * s[m, k // bk (or 0)]
        otherwise (the weight-only kernels): X = float32(x)
        y = round(X @ W^T (+ bias))
    x: [M, K]; weight: [N, K] float8_e4m3fn; weight_scale: [N] or [cdiv(N, bn), cdiv(K, bk)] -> y: [M, N]"""
    w = fp8_dequantize(weight, weight_scale, block)
    xf = x.float()
    if quantize_input:
        group = block[1] if block is not None else None
        q, scale = fp8_quantize_activations(x, group, input_scale)
        xf = q.float() * scale.repeat_interleave(group or x.shape[1], dim=1)[:, :x.shape[1]]
    y = xf @ w.T
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype)


def moe_route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Semantics (Hugging Face's routing for Qwen2-MoE, Qwen3-MoE and Mixtral):
        probs = softmax(float32(router_logits[t]))            over the experts
        topk_ids[t], topk_weights[t] = the top_k largest probs, largest first (torch.topk's order and ties)
        if renormalize: topk_weights[t] /= sum(topk_weights[t])
    The weights stay float32; Qwen casts them to the hidden dtype before the weighted sum, Mixtral does not.
    The GPU runs this reference too until the Triton routing kernel exists.

    router_logits: [num_tokens, num_experts] -> (topk_weights [num_tokens, top_k] float32,
    topk_ids [num_tokens, top_k] int64)
    """
    probs = torch.softmax(router_logits.float(), dim=-1)      # [num_tokens, num_experts]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
    """Semantics:
        for each token t and choice j, e = topk_ids[t, j]:
            g, u = split(x[t] @ gate_up[e].T, 2)                  # gate first, then up: [2 * I] -> [I], [I]
            out[t] += cast(topk_weights[t, j] * ((silu(g) * u) @ down[e].T), x.dtype)
    The products are formed in the promoted dtype of the weights and x (float32 weights keep Mixtral's
    float32 products); experts are visited in ascending order, each adding its tokens' rows. Data-dependent
    shapes (the tokens of each expert): it runs eagerly, never in a CUDA graph; the GPU runs it too until
    the Triton grouped-GEMM kernels exist.

    x: [num_tokens, hidden]; gate_up: [num_experts, 2 * I, hidden]; down: [num_experts, hidden, I];
    topk_weights: [num_tokens, top_k]; topk_ids: [num_tokens, top_k] -> out: [num_tokens, hidden]
    """
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():                        # ascending
        tokens, choice = torch.where(topk_ids == e)             # [n], [n]
        gate, up = (x[tokens] @ gate_up[e].T).chunk(2, dim=-1)  # [n, I] each
        y = (torch.nn.functional.silu(gate) * up) @ down[e].T   # [n, hidden]
        out.index_add_(0, tokens, (y * topk_weights[tokens, choice, None]).to(x.dtype))
    return out


def fp8_moe_experts(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                    down_scale: torch.Tensor, block: tuple[int, int] | None, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """Semantics: moe_experts with FP8 experts dequantized to x's dtype first (fp8_dequantize of gate_up
    [E, 2I, H] by gate_up_scale and of down [E, H, I] by down_scale: per output row [E, rows], or per block
    [E, cdiv(rows, bn), cdiv(cols, bk)]). The kernels read the activations unquantized (W8A16), so with x in
    float32 this is their exact math."""
    return moe_experts(x, fp8_dequantize(gate_up, gate_up_scale, block).to(x.dtype),
                       fp8_dequantize(down, down_scale, block).to(x.dtype), topk_weights, topk_ids)


@dataclass
class MoELoRASlots:
    """Expert LoRA weights of every slot, each adapter at its own rank (R: the slots' largest rank).
    Metadata is host-side, as the other references read it."""
    gate_up_a: torch.Tensor      # [num_slots, E, 2 * R, hidden]: gate rows [0, r_gate), up rows [R, R + r_up)
    gate_up_b: torch.Tensor      # [num_slots, E, 2 * I, R]: gate rows [0, I), up rows [I, 2I)
    down_a: torch.Tensor         # [num_slots, E, R, I]
    down_b: torch.Tensor         # [num_slots, E, hidden, R]
    ranks: list[list[int]]       # [num_slots][3]: gate, up, down ranks; 0 = that projection not adapted
    scalings: torch.Tensor       # [num_slots, 3] float32: gate, up, down
    shared_outer: list[bool]     # [num_slots]: gate_up_a[w, 0] and down_b[w, 0] serve every expert


def moe_lora_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, token_lora_slots: list[int], lora: MoELoRASlots) -> torch.Tensor:
    """Semantics (moe_experts with LoRA added where PEFT adds it, inside each expert):
        for each token t and choice j, e = topk_ids[t, j], w = token_lora_slots[t]:
            h = x[t] @ gate_up[e].T                                                   # [2 * I]
            if w >= 0, for slice s in (gate 0, up 1), r = ranks[w][s], ea = 0 if shared_outer[w] else e:
                h[s*I:(s+1)*I] = round(h[s*I:(s+1)*I] + scalings[w, s] *
                                       gate_up_b[w, e, s*I:(s+1)*I, :r] @ (gate_up_a[w, ea, s*R:s*R+r] @ x[t]))
            g = silu(h[:I]) * h[I:]                                                    # [I]
            y = g @ down[e].T                                                          # [hidden]
            if w >= 0, r = ranks[w][2], eb = 0 if shared_outer[w] else e:
                y = round(y + scalings[w, 2] * down_b[w, eb, :, :r] @ (down_a[w, e, :r] @ g))
            out[t] += cast(topk_weights[t, j] * y, x.dtype)
    The LoRA products are float32, each rounded once into h or y (x's dtype): the gate_up delta before the
    activation, the down delta before the routing-weighted sum, as PEFT's merged expert weights place them.
    A shared-outer slot computes x @ gate_up_a[w, 0] once per token, not once per (token, expert); rank 0
    leaves a projection alone; rows with w = -1 are exactly moe_experts. Experts are visited in ascending
    order, each adding its tokens' rows. Data-dependent shapes: eager only, never inside a CUDA graph.

    x: [num_tokens, hidden]; gate_up: [E, 2 * I, hidden]; down: [E, hidden, I]; topk_weights: [num_tokens,
    top_k] float32; topk_ids: [num_tokens, top_k]; token_lora_slots: [num_tokens] -> out: [num_tokens, hidden]
    """
    slots = torch.tensor(token_lora_slots, dtype=torch.long, device=x.device)     # [num_tokens]
    shared_xa = _shared_outer_shrink(x, slots, lora)                         # [num_tokens, 2 * R] float32
    out = torch.zeros_like(x)
    for e in topk_ids.unique().tolist():                                     # ascending
        tokens, choice = torch.where(topk_ids == e)                          # [n], [n]
        h = x[tokens] @ gate_up[e].T                                         # [n, 2 * I]
        h = _moe_lora_gate_up(h, x[tokens], shared_xa[tokens], slots[tokens], e, lora)
        gate, up = h.chunk(2, dim=-1)                                        # [n, I] each
        g = torch.nn.functional.silu(gate) * up
        y = _moe_lora_down(g @ down[e].T, g, slots[tokens], e, lora)         # [n, hidden]
        out.index_add_(0, tokens, (y * topk_weights[tokens, choice, None]).to(x.dtype))
    return out


def _shared_outer_shrink(x: torch.Tensor, slots: torch.Tensor, lora: MoELoRASlots) -> torch.Tensor:
    """x @ gate_up_a[w, 0].T for every token of a shared-outer slot w, once per token; other rows 0.
    x: [num_tokens, hidden] -> [num_tokens, 2 * R] float32"""
    xa = torch.zeros(x.shape[0], lora.gate_up_a.shape[2], device=x.device)
    for w in slots.unique().tolist():
        if w >= 0 and lora.shared_outer[w]:
            rows = slots == w
            xa[rows] = x[rows].float() @ lora.gate_up_a[w, 0].float().T
    return xa


def _moe_lora_gate_up(h: torch.Tensor, x: torch.Tensor, shared_xa: torch.Tensor, slots: torch.Tensor, e: int,
                      lora: MoELoRASlots) -> torch.Tensor:
    """h plus each slot's gate and up deltas for expert e. h: [n, 2 * I]; x: [n, hidden]; slots: [n]."""
    max_rank, inter = lora.down_a.shape[2], h.shape[1] // 2
    delta = torch.zeros(h.shape, dtype=torch.float32, device=h.device)      # [n, 2 * I]
    for w in slots.unique().tolist():
        if w < 0:
            continue
        rows = slots == w
        for s in range(2):
            r = lora.ranks[w][s]
            if r == 0:
                continue
            a_rows, out_rows = slice(s * max_rank, s * max_rank + r), slice(s * inter, (s + 1) * inter)
            if lora.shared_outer[w]:
                xa = shared_xa[rows, a_rows]                                  # [n_w, r]
            else:
                xa = x[rows].float() @ lora.gate_up_a[w, e, a_rows].float().T
            delta[rows, out_rows] = lora.scalings[w, s] * (xa @ lora.gate_up_b[w, e, out_rows, :r].float().T)
    return (h.float() + delta).to(h.dtype)


def _moe_lora_down(y: torch.Tensor, g: torch.Tensor, slots: torch.Tensor, e: int,
                   lora: MoELoRASlots) -> torch.Tensor:
    """y plus each slot's down delta for expert e. y: [n, hidden]; g: [n, I] (silu(gate) * up); slots: [n]."""
    delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)      # [n, hidden]
    for w in slots.unique().tolist():
        r = lora.ranks[w][2] if w >= 0 else 0
        if r == 0:
            continue
        rows, eb = slots == w, 0 if lora.shared_outer[w] else e
        ga = g[rows].float() @ lora.down_a[w, e, :r].float().T              # [n_w, r]
        delta[rows] = lora.scalings[w, 2] * (ga @ lora.down_b[w, eb, :, :r].float().T)
    return (y.float() + delta).to(y.dtype)


def moe_lora_gate_up_flat(h: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, token_lora_slots: list[int],
                          lora: MoELoRASlots) -> torch.Tensor:
    """Semantics of kernels/moe_lora.add_gate_up_lora, on rows flat by (token, choice):
        for row = t*K + j, e = topk_ids[t, j], w = token_lora_slots[t] >= 0:
            h[row] = _moe_lora_gate_up's row for expert e (x[t]'s gate and up deltas, shared-outer xa once per token)
    Rows with w = -1 come back bitwise unchanged.

    h: [T*K, 2 * I]; x: [T, hidden]; topk_ids: [T, K] -> h with the deltas added (h's dtype)
    """
    k = topk_ids.shape[1]
    slots = torch.tensor(token_lora_slots, dtype=torch.long, device=x.device)     # [T]
    shared_xa = _shared_outer_shrink(x, slots, lora)                         # [T, 2 * R] float32
    tokens = torch.arange(h.shape[0], device=x.device) // k                  # [T*K]
    experts = topk_ids.reshape(-1)                                           # [T*K]
    out = h.clone()
    for e in experts.unique().tolist():
        rows = torch.where(experts == e)[0]
        t = tokens[rows]
        out[rows] = _moe_lora_gate_up(h[rows], x[t], shared_xa[t], slots[t], e, lora)
    return out


def moe_lora_down_flat(y: torch.Tensor, act: torch.Tensor, topk_ids: torch.Tensor, token_lora_slots: list[int],
                       lora: MoELoRASlots) -> torch.Tensor:
    """Semantics of kernels/moe_lora.add_down_lora, on rows flat by (token, choice):
        for row = t*K + j, e = topk_ids[t, j], w = token_lora_slots[t] >= 0:
            y[row] = _moe_lora_down's row for expert e (act[row]'s down delta)
    Rows with w = -1 come back bitwise unchanged.

    y: [T*K, hidden] (before the routing weights); act: [T*K, I]; topk_ids: [T, K] -> y with the deltas added
    """
    k = topk_ids.shape[1]
    slots = torch.tensor(token_lora_slots, dtype=torch.long, device=y.device).repeat_interleave(k)   # [T*K]
    experts = topk_ids.reshape(-1)                                                               # [T*K]
    out = y.clone()
    for e in experts.unique().tolist():
        rows = torch.where(experts == e)[0]
        out[rows] = _moe_lora_down(y[rows], act[rows], slots[rows], e, lora)
    return out
