"""kernels/ops.py's attention on both of its paths, on the CPU: the Triton kernels (rotary + K/V write in one
launch, then paged attention; run by the interpreter) against the torch references, through the same ForwardBatch
the model hands it: a prefill, an extend over a cached prefix and a decode step in one batch, Qwen3's q/k norms on
and off, and a deferred qkv LoRA delta (which the reference receives already added).

Tolerance: each output is a softmax-weighted mean of at most L value rows, its scores dot products of D terms; the
two paths sum in other orders (and the kernel's softmax runs in base 2), so they differ by at most a few roundings
per term: atol = 16 · (D + L) · eps32 · max|v| (the q/k norms and the rotation are a few elementwise roundings more,
inside that); the K/V written into the cache: rotation roundings only, 8 · eps32 · max|k|.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from tests.fp32_bounds import EPS  # noqa: E402
from worker.batch import ForwardBatch  # noqa: E402
from worker.kernels.ops import reference_attention, triton_attention  # noqa: E402
from worker.layers.rotary import RotaryEmbedding  # noqa: E402

SEQS = [(0, 5), (6, 3), (9, 1)]          # (cached tokens, new tokens): prefill, extend, decode
HQ, HK, D, BLOCK = 4, 2, 16, 4


def step(seed: int):
    """(q, k, v, kv caches, batch, cos, sin) of one step over SEQS, the cached positions' K/V random."""
    gen = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in SEQS]
    blocks = [-(-n // BLOCK) for n in lens]
    pool = torch.randperm(sum(blocks) + 2, generator=gen).int()
    tables = torch.full((len(SEQS), max(blocks)), -1, dtype=torch.int32)
    taken = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = pool[taken:taken + n]
        taken += n
    positions = torch.tensor([p for c, n in SEQS for p in range(c, c + n)])
    slots = torch.tensor([int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK
                          for i, (c, n) in enumerate(SEQS) for p in range(c, c + n)])
    starts = [0]
    for _, n in SEQS:
        starts.append(starts[-1] + n)
    tokens = starts[-1]
    cache = (torch.randn(len(pool), BLOCK, HK, D, generator=gen), torch.randn(len(pool), BLOCK, HK, D, generator=gen))
    batch = ForwardBatch(num_tokens=tokens, num_seqs=len(SEQS), max_query_len=max(n for _, n in SEQS),
                         input_ids=torch.zeros(tokens, dtype=torch.int64), positions=positions,
                         kv_slot_mapping=slots, query_start_loc=torch.tensor(starts, dtype=torch.int32),
                         seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables,
                         logits_indices=torch.zeros(0, dtype=torch.int64), query_start_loc_host=starts,
                         seq_lens_host=lens)
    qkv = torch.randn(tokens, (HQ + 2 * HK) * D, generator=gen)
    rotary = RotaryEmbedding(D, 64, 10000.0, None, torch.float32)
    return qkv, cache, batch, rotary.cos, rotary.sin, gen


def split(qkv: torch.Tensor):
    q, k, v = qkv.split([HQ * D, HK * D, HK * D], dim=-1)
    return q.reshape(-1, HQ, D), k.reshape(-1, HK, D), v.reshape(-1, HK, D)


@pytest.mark.parametrize("with_delta", [False, True], ids=["plain", "deferred-delta"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3-qk-norm"])
def test_the_triton_path_equals_the_reference_path(qk_norm, with_delta):
    qkv, cache, batch, cos, sin, gen = step(seed=3)
    norms = (torch.rand(D, generator=gen) + 0.5, torch.rand(D, generator=gen) + 0.5, 1e-6) if qk_norm else None
    delta = torch.randn(qkv.shape, generator=gen) * 0.1 if with_delta else None
    scale = D ** -0.5

    ref_cache = tuple(c.clone() for c in cache)
    ref_qkv = qkv + delta if delta is not None else qkv.clone()          # the in-line expand's result
    expected = reference_attention(*split(ref_qkv), None, ref_cache, batch, cos, sin, scale, norms)

    tri_cache = tuple(c.clone() for c in cache)
    out = triton_attention(*split(qkv.clone()), delta, tri_cache, batch, cos, sin, scale, norms, False)

    context = max(batch.seq_lens_host)
    v_max = max(ref_cache[1].abs().max().item(), 1.0)
    torch.testing.assert_close(out, expected, rtol=0, atol=16 * (D + context) * EPS * v_max)
    k_max = ref_cache[0].abs().max().item()
    torch.testing.assert_close(tri_cache[0], ref_cache[0], rtol=0, atol=8 * EPS * k_max)
    torch.testing.assert_close(tri_cache[1], ref_cache[1], rtol=0, atol=0)        # values are copied, not rotated


def test_a_wrong_slot_mapping_is_caught():
    """The comparison sees the K/V write: the kernel path with its slots shifted by one writes other cache rows."""
    qkv, cache, batch, cos, sin, _ = step(seed=4)
    ref_cache = tuple(c.clone() for c in cache)
    reference_attention(*split(qkv.clone()), None, ref_cache, batch, cos, sin, D ** -0.5, None)
    shifted = dataclasses.replace(batch, kv_slot_mapping=batch.kv_slot_mapping + 1)
    tri_cache = tuple(c.clone() for c in cache)
    triton_attention(*split(qkv.clone()), None, tri_cache, shifted, cos, sin, D ** -0.5, None, False)
    assert not torch.allclose(tri_cache[1], ref_cache[1])
