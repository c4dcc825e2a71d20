"""Triton paged attention and K/V store against the float32 torch references.

Without CUDA the kernels run in the Triton interpreter on tiny shapes; on a GPU the same cases run
compiled (plus bf16), and the `gpu` cases check real Llama-8B shapes and CUDA-graph replay.
"""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.kernels import attention, reference  # noqa: E402  (after TRITON_INTERPRET is set)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if CUDA else [])
TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}   # atol = rtol
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]


class PagedBatch:
    """Random paged KV pool and queries for sequences given as (cached tokens, new tokens) pairs;
    each sequence's blocks are drawn from a shuffled pool, block tables are -1 padded."""

    def __init__(self, seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                 block_size: int, dtype: torch.dtype, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.seq_lens = [cached + new for cached, new in seqs]
        self.query_start_loc = [0]
        for _, new in seqs:
            self.query_start_loc.append(self.query_start_loc[-1] + new)
        blocks_per_seq = [-(-n // block_size) for n in self.seq_lens]
        num_blocks = sum(blocks_per_seq) + 3                          # a few blocks no sequence owns
        pool = torch.randperm(num_blocks, generator=gen).int()
        self.block_tables = torch.full((len(seqs), max(blocks_per_seq) + 2), -1, dtype=torch.int32)
        taken = 0
        for i, n in enumerate(blocks_per_seq):
            self.block_tables[i, :n] = pool[taken:taken + n]
            taken += n
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen).to(dtype)
        self.v_cache = torch.randn(shape, generator=gen).to(dtype)
        self.q = torch.randn(self.query_start_loc[-1], num_heads, head_dim, generator=gen).to(dtype)
        self.scale = head_dim ** -0.5
        self.max_query_len = max(new for _, new in seqs)

    def expected(self) -> torch.Tensor:
        return reference.paged_attention(self.q.float().cpu(), self.k_cache.float(), self.v_cache.float(),
                                         self.block_tables, self.query_start_loc, self.seq_lens, self.scale)

    def run(self, **kwargs) -> torch.Tensor:
        return attention.paged_attention(
            self.q.to(DEVICE), self.k_cache.to(DEVICE), self.v_cache.to(DEVICE), self.block_tables.to(DEVICE),
            torch.tensor(self.query_start_loc, dtype=torch.int32, device=DEVICE),
            torch.tensor(self.seq_lens, dtype=torch.int32, device=DEVICE), self.scale,
            len(self.seq_lens), self.max_query_len, **kwargs)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float(), atol=tol, rtol=tol)


# (cached, new): prefill, extend over a cached prefix, decode, one-token prompt, decode at a block boundary
MIXED = [(0, 11), (6, 5), (12, 1), (0, 1), (15, 1)]


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("head_dim", [40, 64])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_prefill_extend_decode_batch_matches_reference(dtype, group, head_dim, block_size):
    batch = PagedBatch(MIXED, num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                       dtype=dtype)
    assert_close(batch.run(), batch.expected(), dtype)


@pytest.mark.parametrize("num_kv_splits", [2, 4, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_kv_splits_match_reference(dtype, num_kv_splits):
    # contexts shorter than one split leave later splits empty; the longest spans several key tiles
    batch = PagedBatch([(0, 1), (5, 1), (40, 1), (70, 1)], num_heads=4, num_kv_heads=1, head_dim=64,
                       block_size=8, dtype=dtype)
    assert_close(batch.run(num_kv_splits=num_kv_splits), batch.expected(), dtype)


@pytest.mark.parametrize("config", [(16, 16, 4, 1), (32, 32, 4, 2), (64, 16, 8, 1)], ids=str)
@pytest.mark.parametrize("group", [2, 4])
def test_any_tile_config_gives_the_reference_result(group, config):
    """A config passed in (what the attention bench sweeps) only changes how queries and keys are tiled."""
    batch = PagedBatch(MIXED + [(6, 40)], num_heads=2 * group, num_kv_heads=2, head_dim=64, block_size=8,
                       dtype=torch.float32)
    assert_close(batch.run(config=config), batch.expected(), torch.float32)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_long_extends_span_several_query_and_key_tiles(group):
    # prefixes 6 and 14 put query tiles' first rows just before key-tile edges, where the causal mask starts
    batch = PagedBatch([(6, 45), (14, 40), (0, 50), (3, 1)], num_heads=2 * group, num_kv_heads=2, head_dim=64,
                       block_size=8, dtype=torch.float32)
    assert_close(batch.run(), batch.expected(), torch.float32)


def test_strided_q_is_read_and_out_buffer_is_filled_in_place():
    batch = PagedBatch(MIXED, num_heads=4, num_kv_heads=2, head_dim=64, block_size=4, dtype=torch.float32)
    num_tokens = batch.q.shape[0]
    qkv = torch.randn(num_tokens, 8, 64, device=DEVICE)                  # q is heads [0, 4) of a fused qkv
    qkv[:, :4] = batch.q.to(DEVICE)
    batch.q = qkv[:, :4]
    out = torch.full((num_tokens + 2, 4, 64), 7.0, device=DEVICE)       # 2 padding rows past the batch
    result = batch.run(out=out[:num_tokens])
    assert result.data_ptr() == out.data_ptr()
    assert_close(out[:num_tokens], batch.expected(), torch.float32)
    assert bool((out[num_tokens:] == 7.0).all())


def test_padding_sequences_without_tokens_write_nothing():
    # CUDA-graph padding: trailing sequences with no new tokens and an empty context
    batch = PagedBatch([(5, 1), (9, 1)], num_heads=2, num_kv_heads=1, head_dim=64, block_size=4,
                       dtype=torch.float32)
    batch.query_start_loc += [2, 2]
    batch.seq_lens += [0, 0]
    batch.block_tables = torch.cat([batch.block_tables, torch.full((2, batch.block_tables.shape[1]), -1,
                                                                   dtype=torch.int32)])
    expected = reference.paged_attention(batch.q, batch.k_cache, batch.v_cache, batch.block_tables[:2],
                                         batch.query_start_loc[:3], batch.seq_lens[:2], batch.scale)
    for splits in (1, 2):
        assert_close(batch.run(num_kv_splits=splits), expected, torch.float32)


@pytest.mark.parametrize("seqs", [MIXED, [(2, 1)] * 66 + [(4, 20)]], ids=["mixed", "67-sequences"])
def test_mixed_graph_padding_leaves_padding_rows_alone(seqs):
    """A mixed-batch CUDA graph's shapes: token rows past the last sequence (in no sequence, never
    written), sequences with no new tokens past the real ones, and the graph's token count as the
    max_query_len bound. 67 sequences take two vector steps of kernels/row_tiles.py's tile lookup."""
    batch = PagedBatch(seqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=4, dtype=torch.float32)
    expected = batch.expected()
    num_tokens, pad_seqs, pad_tokens = batch.q.shape[0], 5, 7
    batch.q = torch.cat([batch.q, torch.randn(pad_tokens, 4, 64)])
    batch.query_start_loc += [num_tokens] * pad_seqs
    batch.seq_lens += [0] * pad_seqs
    batch.block_tables = torch.cat([batch.block_tables, torch.full((pad_seqs, batch.block_tables.shape[1]), -1,
                                                                   dtype=torch.int32)])
    batch.max_query_len = num_tokens + pad_tokens
    out = torch.full(batch.q.shape, 7.0, device=DEVICE)
    batch.run(out=out)
    assert_close(out[:num_tokens], expected, torch.float32)
    assert bool((out[num_tokens:] == 7.0).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_matches_reference_for_shuffled_slots(dtype):
    gen = torch.Generator().manual_seed(1)
    k_cache = torch.randn(6, 4, 2, 40, generator=gen).to(dtype)
    v_cache = torch.randn(6, 4, 2, 40, generator=gen).to(dtype)
    k = torch.randn(9, 2, 40, generator=gen).to(dtype)
    v = torch.randn(9, 2, 40, generator=gen).to(dtype)
    slots = torch.randperm(24, generator=gen)[:9]
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reference.store_kv(k, v, expected_k, expected_v, slots)
    k_dev, v_dev = k_cache.to(DEVICE), v_cache.to(DEVICE)
    attention.store_kv(k.to(DEVICE), v.to(DEVICE), k_dev, v_dev, slots.to(DEVICE))
    assert torch.equal(k_dev.cpu(), expected_k) and torch.equal(v_dev.cpu(), expected_v)


def test_store_kv_skips_negative_slots():
    k_cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    v_cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    k = torch.ones(3, 1, 16, device=DEVICE)
    attention.store_kv(k, 2 * k, k_cache, v_cache, torch.tensor([5, -1, 0], device=DEVICE))
    written = torch.zeros(8, dtype=torch.bool)
    written[[5, 0]] = True
    assert torch.equal(k_cache.view(8, 16).cpu(), written[:, None].float().expand(8, 16))
    assert torch.equal(v_cache.view(8, 16).cpu(), 2 * written[:, None].float().expand(8, 16))


@pytest.mark.parametrize("batch_size,context", [(1, 4096), (8, 1000), (64, 2048)], ids=["1x4096", "8x1000", "64x2048"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_decode_at_llama_8b_shapes(head_dim, dtype, batch_size, context):
    # contexts differ per sequence so splits end at different places
    seqs = [(context - 1 - 7 * i, 1) for i in range(batch_size)]
    batch = PagedBatch(seqs, num_heads=32, num_kv_heads=8, head_dim=head_dim, block_size=16, dtype=dtype)
    assert_close(batch.run(), batch.expected(), dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_mixed_batch_at_llama_8b_shapes(dtype):
    # a 2048-token prefill chunk, a long extend, and 40 decodes up to 4096 context
    seqs = [(0, 2048), (1500, 300)] + [(4095 - 97 * i, 1) for i in range(40)]
    batch = PagedBatch(seqs, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype)
    assert_close(batch.run(), batch.expected(), dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_decode_replays_in_cuda_graph_with_new_metadata():
    first = PagedBatch([(100 + 50 * i, 1) for i in range(16)], 32, 8, 128, 16, torch.bfloat16, seed=1)
    second = PagedBatch([(3000 - 90 * i, 1) for i in range(16)], 32, 8, 128, 16, torch.bfloat16, seed=2)
    # persistent buffers sized for the larger batch, refilled before each replay
    k_cache = torch.zeros(max(first.k_cache.shape[0], second.k_cache.shape[0]), *first.k_cache.shape[1:],
                          dtype=torch.bfloat16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    q = torch.empty(16, 32, 128, dtype=torch.bfloat16, device=DEVICE)
    block_tables = torch.full((16, 200), -1, dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.arange(17, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.ones(16, dtype=torch.int32, device=DEVICE)
    out = torch.empty_like(q)

    def fill(batch: PagedBatch) -> None:
        k_cache[:batch.k_cache.shape[0]] = batch.k_cache.to(DEVICE)
        v_cache[:batch.v_cache.shape[0]] = batch.v_cache.to(DEVICE)
        q.copy_(batch.q)
        block_tables.fill_(-1)
        block_tables[:, :batch.block_tables.shape[1]] = batch.block_tables.to(DEVICE)
        seq_lens.copy_(torch.tensor(batch.seq_lens, dtype=torch.int32))

    def step() -> None:
        attention.paged_attention(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, first.scale,
                                  num_seqs=16, max_query_len=1, out=out)

    fill(first)
    step()                                                   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for batch in (first, second):
        fill(batch)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, batch.expected(), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_paged_attention_never_syncs_with_the_host():
    batch = PagedBatch(MIXED, 8, 2, 128, 16, torch.bfloat16)
    args = (batch.q.to(DEVICE), batch.k_cache.to(DEVICE), batch.v_cache.to(DEVICE), batch.block_tables.to(DEVICE),
            torch.tensor(batch.query_start_loc, dtype=torch.int32, device=DEVICE),
            torch.tensor(batch.seq_lens, dtype=torch.int32, device=DEVICE), batch.scale, len(MIXED),
            batch.max_query_len)
    attention.paged_attention(*args)                          # compile (may sync) outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attention.paged_attention(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
