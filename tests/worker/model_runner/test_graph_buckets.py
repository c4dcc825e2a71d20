"""CUDA-graph bucket sizes: decode batch sizes and mixed-batch token counts (pure functions, no GPU)."""
from __future__ import annotations

import pytest

from worker.model_runner.cuda_graph import graph_buckets, mixed_token_buckets


def test_decode_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(1) == [1]


@pytest.mark.parametrize("max_tokens", [10, 24, 100, 512, 1000, 1024, 2048])
def test_mixed_buckets_end_at_the_cap_and_pad_past_256_tokens_by_at_most_an_eighth(max_tokens):
    buckets = mixed_token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
    for tokens in range(1, max_tokens + 1):
        bucket = next(b for b in buckets if b >= tokens)
        assert bucket - tokens <= max(32, tokens // 8), (tokens, bucket)


def test_no_mixed_buckets_when_mixed_graphs_are_off():
    assert mixed_token_buckets(0) == []
