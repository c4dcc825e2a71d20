"""An FP8 KV cache (--kv-cache-dtype fp8): the writers (reference.store_kv, the Triton store_kv and rotary_store_kv)
store float8_e4m3fn(clamp(x / scale, ±448)), the readers (reference and Triton paged attention) read stored * scale.

The Triton kernels are checked against a float32 reference of the same quantized math: the very FP8 entries,
dequantized and attended in float32 (reference.paged_attention). What separates the two is the kernel's compute dtype
and summation order, bounded in `attention_bound`; FP8 rounding itself is the same on both sides, so it is no part of
the tolerance.

Without CUDA the kernels run in the Triton interpreter, whose float32 -> float8 cast rounds wrongly (a mantissa that
rounds up past 1.75 drops to half the value: 126.5 -> 64, where E4M3 gives 128; subnormals truncate). The GPU rounds
to nearest even as torch does, so `fp8_casts_as_on_the_gpu` gives the interpreter torch's cast for these tests.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.worker.kernels.test_attention import MIXED, PagedBatch  # noqa: E402
from worker.kernels import attention, fused, reference  # noqa: E402
from worker.kernels.reference import KV_FP8_DTYPE, KV_FP8_MAX  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if CUDA else [])
EPS = torch.finfo(torch.float32).eps
# unit roundoff of the dtype p is rounded to before p·v and the output is rounded to (float32: neither is rounded)
UNIT_ROUNDOFF = {torch.float32: 0.0, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
K_SCALE, V_SCALE = 0.37, 0.0213      # float32 values (as the checkpoint's float32 scales are)


@pytest.fixture(autouse=True)
def fp8_casts_as_on_the_gpu(monkeypatch):
    """The interpreter's casts to float8e4nv done by torch (round to nearest even), as the GPU does them."""
    if CUDA:
        return
    import triton.language as tl
    from triton.runtime import interpreter
    convert = interpreter._convert_float
    torch_of = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}

    def rounded(data, src, dst, rounding_mode):
        if dst != tl.float8e4nv or src not in torch_of:
            return convert(data, src, dst, rounding_mode)
        x = torch.frombuffer(bytearray(np.ascontiguousarray(data).tobytes()), dtype=torch_of[src])
        return x.float().to(KV_FP8_DTYPE).view(torch.uint8).numpy().reshape(data.shape)

    monkeypatch.setattr(interpreter, "_convert_float", rounded)


def f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def fp8_batch(seqs, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
              seed: int = 0) -> PagedBatch:
    """PagedBatch with its caches stored as FP8 under K_SCALE / V_SCALE: stored values up to about ±30 for K (the
    softmax neither flat nor one-hot at head_dim 64), V across the whole E4M3 range with a few clamped to ±448 and
    some subnormal."""
    batch = PagedBatch(seqs, num_heads, num_kv_heads, head_dim, block_size, torch.float32, seed)
    batch.k_cache = reference.quantize_kv(batch.k_cache * 8 * K_SCALE, K_SCALE, KV_FP8_DTYPE)
    batch.v_cache = reference.quantize_kv(batch.v_cache * 120 * V_SCALE, V_SCALE, KV_FP8_DTYPE)
    batch.q = batch.q.to(dtype)
    return batch


def expected(batch: PagedBatch) -> torch.Tensor:
    return reference.paged_attention(batch.q.float(), batch.k_cache, batch.v_cache, batch.block_tables,
                                     batch.query_start_loc, batch.seq_lens, batch.scale, f32(K_SCALE), f32(V_SCALE))


def attention_bound(batch: PagedBatch, dtype: torch.dtype) -> float:
    """|kernel - reference| for the same FP8 entries, per output element:
        p rounded to `dtype` before p·v, the output rounded once:        2 u max|v|
        p·v summed in another float32 order (at most max_ctx terms):      max_ctx eps max|v|
        scores q·k (head_dim float32 terms, 2 more roundings folding the scales) moving by Δs ≤ (head_dim + 2) eps
        S, S = scale · k_scale · max|q| max|k8| (Euclidean norms of rows, bounding Σ_d |q_d k8_d|); softmax moves
        Σ|Δp| by ≤ 2 max|Δs|:                                             2 (head_dim + 2) eps S max|v|
    where max|v| = v_scale · max|v8| (u: UNIT_ROUNDOFF; 2 u is 1e-3 in float16)."""
    head_dim, max_ctx = batch.q.shape[2], max(batch.seq_lens)
    v_max = V_SCALE * batch.v_cache.float().abs().max().item()
    q_norm = batch.q.float().norm(dim=-1).max().item()
    k_norm = batch.k_cache.float().norm(dim=-1).max().item()
    s_max = batch.scale * K_SCALE * q_norm * k_norm
    return (2 * UNIT_ROUNDOFF[dtype] + max_ctx * EPS + 2 * (head_dim + 2) * EPS * s_max) * v_max


def run(batch: PagedBatch, **kwargs) -> torch.Tensor:
    return batch.run(k_scale=f32(K_SCALE), v_scale=f32(V_SCALE), **kwargs).float().cpu()


def assert_within(actual: torch.Tensor, wanted: torch.Tensor, bound: float) -> None:
    err = (actual - wanted).abs().max().item()
    assert err <= bound, f"differs by {err:.3e}, over the bound {bound:.3e}"


def test_reference_stores_x_over_scale_rounded_to_e4m3_and_clamped():
    x = torch.tensor([[[0.0, 1.0, -2.5, 0.3]], [[1e4, -1e4, 447.0 * 0.5, 1e-4]]])   # [2 tokens, 1 head, 4]
    k_cache = torch.zeros(1, 4, 1, 4, dtype=KV_FP8_DTYPE)
    v_cache = torch.zeros_like(k_cache)
    reference.store_kv(x, x, k_cache, v_cache, torch.tensor([2, 0]), k_scale=0.5, v_scale=2.0)
    want_k = (x / 0.5).clamp(-KV_FP8_MAX, KV_FP8_MAX).to(KV_FP8_DTYPE)
    assert torch.equal(k_cache[0, [2, 0]].view(torch.uint8), want_k.view(torch.uint8))
    assert k_cache[0, 0, 0].float().tolist() == [448.0, -448.0, 448.0, 0.0]     # 447 rounds up; 2e-4 under 2^-10
    assert v_cache[0, 2, 0].float().tolist() == [0.0, 0.5, -1.25, 0.15625]      # 0.15 to E4M3: 0.15625


def test_reference_reads_each_entry_times_its_scale_and_round_trips_within_half_an_e4m3_step():
    batch = PagedBatch(MIXED, num_heads=4, num_kv_heads=2, head_dim=32, block_size=4, dtype=torch.float32)
    exact_k, exact_v = batch.k_cache.clone(), batch.v_cache.clone()
    k8 = reference.quantize_kv(exact_k, K_SCALE, KV_FP8_DTYPE)
    v8 = reference.quantize_kv(exact_v, V_SCALE, KV_FP8_DTYPE)
    read_k, read_v = reference.dequantize_kv(k8, K_SCALE), reference.dequantize_kv(v8, V_SCALE)
    assert torch.equal(read_k, k8.float() * f32(K_SCALE))
    # E4M3 keeps 3 mantissa bits: relative error ≤ 2^-4 for normals (|x| / scale ≥ 2^-6), 2^-10 · scale absolute below
    normal = (exact_k / K_SCALE).abs() >= 2 ** -6
    assert ((read_k - exact_k).abs() <= 2 ** -4 * exact_k.abs())[normal].all()
    assert ((read_k - exact_k).abs() <= 2 ** -10 * K_SCALE)[~normal].all()
    got = reference.paged_attention(batch.q, k8, v8, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                                    batch.scale, K_SCALE, V_SCALE)
    want = reference.paged_attention(batch.q, read_k, read_v, batch.block_tables, batch.query_start_loc,
                                     batch.seq_lens, batch.scale)
    assert torch.equal(got, want)


def test_a_cache_in_the_model_dtype_ignores_the_scales():
    batch = PagedBatch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=4, dtype=torch.float32)
    plain = batch.expected()
    args = (batch.q, batch.k_cache, batch.v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
            batch.scale)
    assert torch.equal(reference.paged_attention(*args, k_scale=0.5, v_scale=3.0), plain)
    assert torch.equal(batch.run(k_scale=0.5, v_scale=3.0).cpu(), batch.run().cpu())
    k, k_cache = torch.randn(3, 2, 64), batch.k_cache.clone()
    reference.store_kv(k, k, k_cache, k_cache.clone(), torch.tensor([0, 5, 9]), k_scale=0.5, v_scale=3.0)
    assert torch.equal(k_cache.view(-1, 2, 64)[[0, 5, 9]], k)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [40, 64])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_extend_and_decode_over_an_fp8_cache_match_the_float32_reference(dtype, group, head_dim, block_size):
    batch = fp8_batch(MIXED, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                      dtype=dtype)
    assert_within(run(batch), expected(batch), attention_bound(batch, dtype))


@pytest.mark.parametrize("num_kv_splits", [1, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_over_an_fp8_cache_with_and_without_key_splits(dtype, num_kv_splits):
    batch = fp8_batch([(0, 1), (5, 1), (40, 1), (70, 1)], num_heads=4, num_kv_heads=1, head_dim=64, block_size=8,
                      dtype=dtype)
    assert_within(run(batch, num_kv_splits=num_kv_splits), expected(batch), attention_bound(batch, dtype))


def test_long_extends_over_an_fp8_cache_span_several_query_and_key_tiles():
    batch = fp8_batch([(6, 45), (14, 40), (3, 1)], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
                      dtype=torch.float32)
    assert_within(run(batch), expected(batch), attention_bound(batch, torch.float32))


def test_a_wrong_scale_is_far_outside_the_bound():
    """The bound is tight enough to see a scale applied twice, or not at all."""
    batch = fp8_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=4, dtype=torch.float32)
    bound = attention_bound(batch, torch.float32)
    got = run(batch)
    for k_scale, v_scale in ((K_SCALE ** 2, V_SCALE), (K_SCALE, 1.0)):
        wrong = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables,
                                          batch.query_start_loc, batch.seq_lens, batch.scale, k_scale, v_scale)
        assert (got - wrong).abs().max().item() > 100 * bound


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_store_kv_writes_the_reference_fp8_bytes(dtype):
    gen = torch.Generator().manual_seed(1)
    k = (torch.randn(9, 2, 40, generator=gen) * 60 * K_SCALE).to(dtype)     # some past 448 · scale: clamped
    v = (torch.randn(9, 2, 40, generator=gen) * 60 * V_SCALE).to(dtype)
    slots = torch.randperm(24, generator=gen)[:9]
    want_k, want_v = torch.zeros(6, 4, 2, 40, dtype=KV_FP8_DTYPE), torch.zeros(6, 4, 2, 40, dtype=KV_FP8_DTYPE)
    reference.store_kv(k, v, want_k, want_v, slots, K_SCALE, V_SCALE)
    k_cache, v_cache = torch.zeros_like(want_k, device=DEVICE), torch.zeros_like(want_v, device=DEVICE)
    padded = torch.cat([slots, torch.tensor([-1])]).to(DEVICE)                # a CUDA-graph padding token
    attention.store_kv(torch.cat([k, k[:1]]).to(DEVICE), torch.cat([v, v[:1]]).to(DEVICE), k_cache, v_cache, padded,
                       k_scale=K_SCALE, v_scale=V_SCALE)
    assert torch.equal(k_cache.cpu().view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.cpu().view(torch.uint8), want_v.view(torch.uint8))


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_store_kv_quantizes_the_rotated_k_and_v_as_the_reference_stores_them(dtype, qk_norm):
    """The FP8 entries are reference.store_kv of the kernel's own rotated k (written back into k) and of v."""
    tokens, q_heads, k_heads, dim = 5, 4, 2, 64
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (q_heads + 2 * k_heads) * dim, generator=gen).to(dtype).to(DEVICE)
    emb = torch.outer(torch.arange(64).float(), 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim)).repeat(1, 2)
    cos, sin = emb.cos().to(dtype).to(DEVICE), emb.sin().to(dtype).to(DEVICE)
    positions = torch.tensor([0, 3, 17, 63, 5], device=DEVICE)
    slots = torch.tensor([7, -1, 0, 11, 2], device=DEVICE)
    norms = None
    if qk_norm:
        norms = (torch.rand(dim, generator=gen).to(dtype).to(DEVICE), torch.rand(dim, generator=gen).to(dtype)
                 .to(DEVICE), 1e-6)
    k_cache = torch.zeros(3, 4, k_heads, dim, dtype=KV_FP8_DTYPE, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    q = qkv[:, :q_heads * dim].view(tokens, q_heads, dim)
    k = qkv[:, q_heads * dim:(q_heads + k_heads) * dim].view(tokens, k_heads, dim)
    v = qkv[:, (q_heads + k_heads) * dim:].view(tokens, k_heads, dim)
    k_scale, v_scale = f32(0.0061), f32(0.083)          # the rotated k over a wide E4M3 range, a few clamped
    fused.rotary_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slots, qk_norm=norms, k_scale=k_scale,
                          v_scale=v_scale)
    want_k, want_v = torch.zeros_like(k_cache).cpu(), torch.zeros_like(v_cache).cpu()
    keep = (slots >= 0).cpu()
    reference.store_kv(k.cpu()[keep], v.cpu()[keep], want_k, want_v, slots.cpu()[keep], k_scale, v_scale)
    assert torch.equal(k_cache.cpu().view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.cpu().view(torch.uint8), want_v.view(torch.uint8))
    assert want_k.view(torch.uint8).any() and want_v.view(torch.uint8).any()
