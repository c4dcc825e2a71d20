"""Fused norm / rotary + K/V write / SiLU-and-mul kernels against their torch references (float32 and float16)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.kernels import fused, reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def rand(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def with_delta(x: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """What a LoRA expand would have left in x: round(x + delta), delta float32."""
    return (x.float() + delta).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, dim", [(1, 64), (5, 96), (3, 128)])
def test_rms_norm_with_and_without_residual(dtype, tokens, dim):
    x, w = rand(tokens, dim, dtype=dtype), rand(dim, dtype=dtype, seed=1)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6),
                               atol=TOL[dtype], rtol=TOL[dtype])
    res_a, res_b = rand(tokens, dim, dtype=dtype, seed=2), rand(tokens, dim, dtype=dtype, seed=2)
    out = fused.rms_norm(x, w, 1e-6, residual=res_a)
    ref = reference.rms_norm(x, w, 1e-6, residual=res_b)
    torch.testing.assert_close(res_a, res_b, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_adds_a_deferred_lora_delta_first(dtype, residual):
    x, w = rand(4, 96, dtype=dtype), rand(96, dtype=dtype, seed=1)
    delta = rand(4, 96, dtype=torch.float32, seed=5)
    res_a, res_b = (rand(4, 96, dtype=dtype, seed=2), rand(4, 96, dtype=dtype, seed=2)) if residual else (None, None)
    out = fused.rms_norm(x, w, 1e-6, residual=res_a, delta=delta)
    ref = reference.rms_norm(with_delta(x, delta), w, 1e-6, residual=res_b)
    torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    if residual:
        torch.testing.assert_close(res_a, res_b, atol=TOL[dtype], rtol=TOL[dtype])
    else:   # the delta is not lost in the norm: without it the result differs
        assert not torch.allclose(out, fused.rms_norm(x, w, 1e-6), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_per_head_on_a_strided_view(dtype):
    qkv = rand(4, 3 * 4 * 32, dtype=dtype)
    q = qkv[:, :4 * 32].view(4, 4, 32)              # rows strided by the fused width
    w = rand(32, dtype=dtype, seed=3)
    torch.testing.assert_close(fused.rms_norm(q, w, 1e-5), reference.rms_norm(q, w, 1e-5),
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("q_heads, k_heads, dim", [(4, 2, 32), (8, 8, 24), (6, 1, 40)])
@pytest.mark.parametrize("deferred", [False, True], ids=["plain", "with-delta"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["", "qk-norm"])
def test_rotary_store_kv_matches_rotary_then_store(dtype, q_heads, k_heads, dim, deferred, qk_norm):
    """q and k rotated in place on strided views of a fused qkv row; rotated k and v written to their slots,
    padding slots (-1) skipped and the rest of the pool untouched. With a deferred LoRA delta, the same as
    adding it to the qkv row first; with Qwen3's q/k norms, the same as reference.rms_norm of every head (after
    the delta) before the rotary."""
    tokens, block_size, num_blocks = 5, 4, 3
    qkv = rand(tokens, (q_heads + 2 * k_heads) * dim, dtype=dtype)
    theta = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(64).float(), theta)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(dtype=dtype, device=DEVICE), emb.sin().to(dtype=dtype, device=DEVICE)
    positions = torch.tensor([0, 3, 17, 63, 5], device=DEVICE)
    slots = torch.tensor([7, -1, 0, 11, 2], device=DEVICE)
    pool = rand(2, num_blocks, block_size, k_heads, dim, dtype=dtype, seed=4)
    delta = rand(*qkv.shape, dtype=torch.float32, seed=6) if deferred else None
    norms = (rand(dim, dtype=dtype, seed=7), rand(dim, dtype=dtype, seed=8), 1e-6) if qk_norm else None
    runs = {}
    for name in ("ours", "ref"):
        t, (k_cache, v_cache) = qkv.clone(), pool.clone()
        if name == "ref" and deferred:
            t = with_delta(t, delta)
        q = t[:, :q_heads * dim].view(tokens, q_heads, dim)
        k = t[:, q_heads * dim:(q_heads + k_heads) * dim].view(tokens, k_heads, dim)
        v = t[:, (q_heads + k_heads) * dim:].view(tokens, k_heads, dim)
        if name == "ours":
            fused.rotary_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slots, delta, qk_norm=norms)
        else:
            if qk_norm:
                q.copy_(reference.rms_norm(q, norms[0], norms[2]))
                k.copy_(reference.rms_norm(k, norms[1], norms[2]))
            reference.rotary(positions, q, k, cos, sin)
            keep = slots >= 0
            reference.store_kv(k[keep], v[keep], k_cache, v_cache, slots[keep])
        runs[name] = (t, k_cache, v_cache)
    q_and_k = slice(0, (q_heads + k_heads) * dim)     # v's delta reaches only the cache
    torch.testing.assert_close(runs["ours"][0][:, q_and_k], runs["ref"][0][:, q_and_k], atol=2 * TOL[dtype],
                               rtol=2 * TOL[dtype])
    for ours, ref in zip(runs["ours"][1:], runs["ref"][1:]):
        torch.testing.assert_close(ours, ref, atol=2 * TOL[dtype], rtol=2 * TOL[dtype])
    assert not torch.equal(runs["ours"][0], qkv)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[[7, 0, 11, 2]] = True
    for cache, before in zip(runs["ours"][1:], pool):
        changed = (cache != before).view(num_blocks * block_size, -1).any(dim=1).cpu()
        assert torch.equal(changed, written)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, inter", [(1, 48), (7, 256), (2, 1500)])
def test_silu_and_mul(dtype, tokens, inter):
    x = rand(tokens, 2 * inter, dtype=dtype)
    torch.testing.assert_close(fused.silu_and_mul(x), reference.silu_and_mul(x), atol=TOL[dtype], rtol=TOL[dtype])
    delta = rand(tokens, 2 * inter, dtype=torch.float32, seed=7)
    torch.testing.assert_close(fused.silu_and_mul(x, delta), reference.silu_and_mul(with_delta(x, delta)),
                               atol=TOL[dtype], rtol=TOL[dtype])
