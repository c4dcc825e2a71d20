"""Fused elementwise kernels of the decoder layer: RMSNorm (with the residual add), rotary with the K/V
write into the paged pool, SiLU-and-mul.

Each replaces a chain of small torch ops with one launch; at decode batch sizes the step is bound by
launch count as much as by bytes, so these matter inside CUDA graphs. Rounding follows the torch
reference in reference.py: values are rounded to the activation dtype where the reference rounds.

Each also takes an optional `delta`: a projection's LoRA output still to be added to its input (float32,
[T, width of that input], contiguous rows), computed beside the projection's GEMM on another stream
(layers/linear.py). The kernel first forms round(x + delta), exactly what the LoRA expand would have
written into x, so a deferred delta changes no result; it saves the expand's launch on the critical path.

On Hopper they launch with programmatic dependent launch (kernels/pdl.py) unless `programmatic_launch` is
False: they let the next kernel launch when they start and wait for the previous one before their first load.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from worker.kernels import pdl
from worker.kernels.reference import KV_FP8_DTYPE, KV_FP8_MAX

FP8_MAX: tl.constexpr = tl.constexpr(KV_FP8_MAX)


@triton.jit
def _plus_delta(x, d_ptrs, mask):
    """round(x + delta): what the LoRA expand would have written into x (module docstring)."""
    return (x.to(tl.float32) + tl.load(d_ptrs, mask=mask, other=0.0)).to(x.dtype)


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, delta_ptr, num_heads, stride_xt, stride_xh, stride_rt,
                     stride_ot, stride_oh, stride_dt, dim, eps, HAS_RESIDUAL: tl.constexpr,
                     HAS_DELTA: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Semantics, for row r = (t, h):
        if HAS_DELTA: x[t] = round(x[t] + delta[t])  (not written back; 2-D x only)
        if HAS_RESIDUAL: res[t] = x[t] + res[t]  (rounded to x's dtype); v = res[t]   else: v = x[t, h]
        out[t, h] = w * round(v * rsqrt(mean(v^2) + eps))    (the mean in float32)
    """
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0)
    t, h = row // num_heads, row % num_heads
    offs = tl.arange(0, BLOCK_D)
    mask = offs < dim
    x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + h * stride_xh + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        x = _plus_delta(x, delta_ptr + t.to(tl.int64) * stride_dt + offs, mask)
    if HAS_RESIDUAL:
        r_ptrs = res_ptr + t.to(tl.int64) * stride_rt + offs
        x = (x.to(tl.float32) + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(r_ptrs, x, mask=mask)
    v = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(v * v, axis=0) / dim + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = (v * inv).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             delta: torch.Tensor | None = None, programmatic_launch: bool = True) -> torch.Tensor:
    """RMSNorm over the last dim of x ([T, D] or [T, H, D], any row strides); with `residual` ([T, D],
    updated in place to x + residual) the norm is taken of that sum; `delta` ([T, D] float32, 2-D x only)
    is added to x first (module docstring). Returns a new contiguous tensor."""
    x3 = x if x.dim() == 3 else x[:, None, :]
    assert x3.stride(2) == 1 and (residual is None or (x.dim() == 2 and residual.stride(1) == 1))
    assert delta is None or (x.dim() == 2 and delta.shape == x.shape and delta.dtype == torch.float32
                             and delta.stride(1) == 1)
    num_tokens, num_heads, dim = x3.shape
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    if num_tokens:
        res = residual if residual is not None else x3
        d = delta if delta is not None else x3
        _rms_norm_kernel[(num_tokens * num_heads,)](
            x3, res, weight, out, d, num_heads, x3.stride(0), x3.stride(1), res.stride(0), out.stride(0),
            out.stride(1), d.stride(0), dim, eps, HAS_RESIDUAL=residual is not None, HAS_DELTA=delta is not None,
            BLOCK_D=triton.next_power_of_2(dim), num_warps=4 if dim >= 2048 else 1,
            **pdl.launch_options(x.device, programmatic_launch))
    return out.view(x.shape)


@triton.jit
def _rotate_heads(base_ptr, t, stride_t, stride_h, num_heads, c, s, half, d_row_ptr, norm_w_ptr, eps,
                  HAS_DELTA: tl.constexpr, QK_NORM: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rotate every head of token t in place (after adding its delta row d_row_ptr[h * 2 * half + col], then, with
    QK_NORM, taking each head's RMSNorm with weight norm_w_ptr[:2 * half] as _rms_norm_kernel does); returns the
    rotated halves ([BLOCK_H, BLOCK_HALF] each)."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    offs = tl.arange(0, BLOCK_HALF)[None, :]
    ptrs = base_ptr + t.to(tl.int64) * stride_t + heads * stride_h + offs
    mask = (heads < num_heads) & (offs < half)
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + half, mask=mask, other=0.0)
    if HAS_DELTA:
        d_ptrs = d_row_ptr + heads * 2 * half + offs
        x1, x2 = _plus_delta(x1, d_ptrs, mask), _plus_delta(x2, d_ptrs + half, mask)
    if QK_NORM:
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        inv = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * half) + eps)[:, None]   # [BLOCK_H, 1]
        w1 = tl.load(norm_w_ptr + offs, mask=offs < half, other=0.0).to(tl.float32)
        w2 = tl.load(norm_w_ptr + half + offs, mask=offs < half, other=0.0).to(tl.float32)
        x1 = ((a * inv).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype)
        x2 = ((b * inv).to(x2.dtype).to(tl.float32) * w2).to(x2.dtype)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    r1, r2 = (a * c - b * s).to(x1.dtype), (b * c + a * s).to(x1.dtype)
    tl.store(ptrs, r1, mask=mask)
    tl.store(ptrs + half, r2, mask=mask)
    return r1, r2


@triton.jit
def as_stored(x, scale, FP8: tl.constexpr):
    """x as the cache stores it (reference.store_kv): float8_e4m3fn(clamp(x / scale, +-448)) for an FP8 cache (a
    correctly rounded division and a round-to-nearest-even cast, as torch's), x itself otherwise."""
    if FP8:      # one return per branch: Triton compiles only the constexpr's branch, and types its return
        y = tl.math.div_rn(x.to(tl.float32), scale)
        stored = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX).to(tl.float8e4nv, fp_downcast_rounding="rtne")
    else:
        stored = x
    return stored


@triton.jit
def _rotary_store_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                            delta_ptr, q_norm_ptr, k_norm_ptr, eps, k_scale, v_scale, stride_qt, stride_qh,
                            stride_kt, stride_kh, stride_vt, stride_vh, stride_cos, stride_dt, num_q_heads,
                            num_k_heads, half, HAS_DELTA: tl.constexpr, QK_NORM: tl.constexpr, FP8: tl.constexpr,
                            BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    """Semantics, for token t at position p = pos[t] with slot = slot[t] (rotate-half layout):
        if HAS_DELTA: [q[t] | k[t] | v[t]] (heads flattened) = round(that + delta[t]) first
        if QK_NORM (Qwen3): every head of q[t] = rms_norm(head, q_norm, eps), of k[t] with k_norm (as
            _rms_norm_kernel computes it; the sum of squares taken over the two halves)
        for x in every head of q[t] and k[t], in place: x1, x2 = x[:half], x[half:]; c, s = cos[p, :half],
            sin[p, :half]; x = [x1*c - x2*s, x2*c + x1*s]   (float32, rounded once)
        if slot >= 0 (negative slots are CUDA-graph padding):
            k_cache.view(-1, Hk, D)[slot] = stored(k[t] (rotated), k_scale);  v_cache.view(-1, Hk, D)[slot] =
            stored(v[t], v_scale)       (reference.store_kv: FP8 caches quantize, others store x itself)
    The caches are contiguous [num_blocks, block_size, Hk, D].
    """
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    c = tl.load(cos_ptr + p * stride_cos + offs, mask=offs < half, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + p * stride_cos + offs, mask=offs < half, other=0.0).to(tl.float32)[None, :]
    d_q = delta_ptr + t.to(tl.int64) * stride_dt          # the delta row: q heads, then k heads, then v heads
    d_k = d_q + num_q_heads * 2 * half
    d_v = d_k + num_k_heads * 2 * half
    _rotate_heads(q_ptr, t, stride_qt, stride_qh, num_q_heads, c, s, half, d_q, q_norm_ptr, eps, HAS_DELTA, QK_NORM,
                  BLOCK_HALF, BLOCK_H)
    k1, k2 = _rotate_heads(k_ptr, t, stride_kt, stride_kh, num_k_heads, c, s, half, d_k, k_norm_ptr, eps, HAS_DELTA,
                           QK_NORM, BLOCK_HALF, BLOCK_H)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)[:, None]
        cols = offs[None, :]
        mask = (heads < num_k_heads) & (cols < half)
        row = slot * num_k_heads * 2 * half + heads * 2 * half + cols    # (slot, head, col) in the caches
        tl.store(k_cache_ptr + row, as_stored(k1, k_scale, FP8), mask=mask)
        tl.store(k_cache_ptr + row + half, as_stored(k2, k_scale, FP8), mask=mask)
        v_ptrs = v_ptr + t.to(tl.int64) * stride_vt + heads * stride_vh + cols
        v1 = tl.load(v_ptrs, mask=mask)
        v2 = tl.load(v_ptrs + half, mask=mask)
        if HAS_DELTA:
            d_ptrs = d_v + heads * 2 * half + cols
            v1, v2 = _plus_delta(v1, d_ptrs, mask), _plus_delta(v2, d_ptrs + half, mask)
        tl.store(v_cache_ptr + row, as_stored(v1, v_scale, FP8), mask=mask)
        tl.store(v_cache_ptr + row + half, as_stored(v2, v_scale, FP8), mask=mask)


def rotary_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_slot_mapping: torch.Tensor,
                    delta: torch.Tensor | None = None, programmatic_launch: bool = True,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> None:
    """reference.rotary(positions, q, k, cos, sin) then reference.store_kv(k, v, k_cache, v_cache, kv_slot_mapping,
    k_scale, v_scale) in one launch: a decode layer's rotary and K/V write cost one kernel instead of two. With
    `qk_norm` (Qwen3's per-head norms: (q_norm weight [D], k_norm weight [D], eps)), q and k are normed first, as
    rms_norm(q, q_norm, eps) and rms_norm(k, k_norm, eps) would (after the delta): three launches become one.

    q: [T, Hq, D], k, v: [T, Hk, D] (head_dim contiguous, any token/head strides); k_cache, v_cache:
    contiguous [num_blocks, block_size, Hk, D], in k's dtype or FP8 (reference.KV_FP8_DTYPE: quantized with the
    per-tensor k_scale / v_scale, which caches in k's dtype ignore); kv_slot_mapping: [T], negative entries are
    skipped.
    delta: [T, (Hq + 2 Hk) * D] float32 (module docstring), in q | k | v order; v's part reaches only the cache.
    """
    num_tokens, num_q_heads, dim = q.shape
    num_k_heads = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1 and cos.stride(1) == 1 and dim % 2 == 0
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (num_k_heads, dim)
    assert k.dtype == v.dtype and k_cache.dtype == v_cache.dtype and k_cache.dtype in (k.dtype, KV_FP8_DTYPE)
    assert delta is None or (delta.shape == (num_tokens, (num_q_heads + 2 * num_k_heads) * dim)
                             and delta.dtype == torch.float32 and delta.stride(1) == 1)
    assert qk_norm is None or (qk_norm[0].shape == qk_norm[1].shape == (dim,) and qk_norm[0].is_contiguous()
                               and qk_norm[1].is_contiguous())
    if num_tokens:
        d = delta if delta is not None else q
        q_norm, k_norm, eps = qk_norm if qk_norm is not None else (q, q, 0.0)
        _rotary_store_kv_kernel[(num_tokens,)](
            q, k, v, cos, sin, positions, k_cache, v_cache, kv_slot_mapping, d, q_norm, k_norm, eps, float(k_scale),
            float(v_scale), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            d.stride(0), num_q_heads, num_k_heads, dim // 2, HAS_DELTA=delta is not None,
            QK_NORM=qk_norm is not None, FP8=k_cache.dtype == KV_FP8_DTYPE,
            BLOCK_HALF=triton.next_power_of_2(dim // 2),
            BLOCK_H=triton.next_power_of_2(max(num_q_heads, num_k_heads)), num_warps=4,
            **pdl.launch_options(q.device, programmatic_launch))


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, delta_ptr, stride_xt, stride_ot, stride_dt, inter, HAS_DELTA: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Semantics: if HAS_DELTA: x[t] = round(x[t] + delta[t]) (not written back); then
    out[t] = round(silu(x[t, :I])) * x[t, I:]   (rounded once more)."""
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    row = x_ptr + t.to(tl.int64) * stride_xt
    g = tl.load(row + offs, mask=mask, other=0.0)
    u = tl.load(row + inter + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d_row = delta_ptr + t.to(tl.int64) * stride_dt
        g, u = _plus_delta(g, d_row + offs, mask), _plus_delta(u, d_row + inter + offs, mask)
    g32 = g.to(tl.float32)
    act = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype).to(tl.float32)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + offs, (act * u.to(tl.float32)).to(g.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, delta: torch.Tensor | None = None, programmatic_launch: bool = True,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, 2I] (gate | up) -> [T, I]; delta: [T, 2I] float32 (module docstring); out: a [T, I] buffer to
    write into (the MoE workspace's), else a new tensor."""
    num_tokens, inter = x.shape[0], x.shape[1] // 2
    assert delta is None or (delta.shape == x.shape and delta.dtype == torch.float32 and delta.stride(1) == 1)
    if out is None:
        out = torch.empty(num_tokens, inter, dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, inter) and out.dtype == x.dtype and out.stride(1) == 1
    if num_tokens:
        block = min(1024, triton.next_power_of_2(inter))
        d = delta if delta is not None else x
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            x, out, d, x.stride(0), out.stride(0), d.stride(0), inter, HAS_DELTA=delta is not None, BLOCK=block,
            num_warps=4, **pdl.launch_options(x.device, programmatic_launch))
    return out
