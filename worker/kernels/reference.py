"""Torch references of every kernel. CPU runs use these; kernel tests compare the Triton kernels to them.

All references loop over segments / sequences on the host, so they read the `_host` copies of the
metadata and must never run inside a CUDA graph.
"""
from __future__ import annotations

import torch


def lora_shrink(x: torch.Tensor, a: torch.Tensor, seg_indptr: list[int], weight_indices: list[int],
                ranks: list[int], num_slices: int) -> torch.Tensor:
    """Semantics:
        for each segment i with w = weight_indices[i] >= 0, tokens t in [seg_indptr[i], seg_indptr[i+1]):
            for each slice s, r < ranks[w]:
                xa[t, s*R + r] = sum_k x[t, k] * a[w, s*R + r, k]
        every other entry of xa is 0 (base-only segments, and ranks past the adapter's own).

    x: [num_tokens, in_dim]; a: [num_slots, num_slices * R, in_dim] -> xa: [num_tokens, num_slices * R]
    """
    max_rank = a.shape[1] // num_slices
    xa = x.new_zeros(x.shape[0], a.shape[1])
    for i, w in enumerate(weight_indices):
        if w < 0:
            continue
        lo, hi, r = seg_indptr[i], seg_indptr[i + 1], ranks[w]
        for s in range(num_slices):
            cols = slice(s * max_rank, s * max_rank + r)
            xa[lo:hi, cols] = x[lo:hi] @ a[w, cols].T
    return xa


def lora_expand(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor, seg_indptr: list[int],
                weight_indices: list[int], ranks: list[int], scalings: torch.Tensor,
                slice_offsets: list[int]) -> None:
    """Semantics (in place on y):
        for each segment i with w = weight_indices[i] >= 0, tokens t in [seg_indptr[i], seg_indptr[i+1]):
            for each slice s, output column o in [slice_offsets[s], slice_offsets[s+1]):
                y[t, o] += scalings[w, s] * sum_{r < ranks[w]} xa[t, s*R + r] * b[w, o, r]

    y: [num_tokens, out_dim]; xa: [num_tokens, num_slices * R]; b: [num_slots, out_dim, R];
    scalings: [num_slots, num_slices] float32
    """
    max_rank = b.shape[2]
    for i, w in enumerate(weight_indices):
        if w < 0:
            continue
        lo, hi, r = seg_indptr[i], seg_indptr[i + 1], ranks[w]
        for s in range(len(slice_offsets) - 1):
            o0, o1 = slice_offsets[s], slice_offsets[s + 1]
            delta = xa[lo:hi, s * max_rank:s * max_rank + r] @ b[w, o0:o1, :r].T
            y[lo:hi, o0:o1] += (scalings[w, s] * delta.float()).to(y.dtype)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Semantics: k_cache.view(-1, H, D)[slot_mapping[t]] = k[t] (same for v).

    k, v: [num_tokens, num_kv_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    """
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                    scale: float) -> torch.Tensor:
    """Semantics: sequence i has n_i = query_start_loc[i+1] - query_start_loc[i] new tokens, the last n_i of
    its seq_lens[i] context positions. Each new token at context position p attends (causally) to the
    cached K/V of positions [0, p] of its sequence, read through block_tables[i]; KV head of query head h
    is h // (num_heads // num_kv_heads) (GQA). Prefill, extend and decode are the same formula.

    q: [num_tokens, num_heads, head_dim] -> out: [num_tokens, num_heads, head_dim]
    """
    num_heads, block_size = q.shape[1], k_cache.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.empty_like(q)
    for i, ctx in enumerate(seq_lens):
        lo, hi = query_start_loc[i], query_start_loc[i + 1]
        n_blocks = (ctx + block_size - 1) // block_size
        blocks = block_tables[i, :n_blocks].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx].repeat_interleave(group, dim=1)  # k: [ctx, num_heads, head_dim]
        v = v_cache[blocks].flatten(0, 1)[:ctx].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[lo:hi].float(), k.float()) * scale  # [heads, n, ctx]
        q_pos = torch.arange(ctx - (hi - lo), ctx, device=q.device)
        causal = torch.arange(ctx, device=q.device)[None, :] > q_pos[:, None]      # [n, ctx]
        scores.masked_fill_(causal, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
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


def tile_map(indptr: list[int], num_groups: int, block: int, num_tiles: int) -> list[tuple[int, int]]:
    """Semantics of kernels/tiles.locate_tile for tiles 0..num_tiles-1: groups [indptr[i], indptr[i+1]) cut
    into block-row tiles, numbered group after group; (group, first row) of each tile, (-1, 0) past the last."""
    tiles = [(i, row) for i in range(num_groups) for row in range(indptr[i], indptr[i + 1], block)]
    return (tiles + [(-1, 0)] * num_tiles)[:num_tiles]
