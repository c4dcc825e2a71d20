"""TritonLoRA.linear in line (LoRABatchInfo.overlap False: no side stream, nothing deferred) through a real Linear
on the CPU, its shrink and expand run by the Triton interpreter on float32 tensors: the projection equals the
float32 reference of tests/worker/layers/test_linear.py, as ReferenceLoRA's does, with the segments searched per
program (tile_map None) and read from the host's tile map (the grouped decode graphs' rows, the shrink split over
K when the input is wide enough).

The backend object is built directly: choose_backend refuses "triton" on the CPU by design.

Tolerance: test_linear's bound, n · eps · Σ|terms| per output with n = in_features + R + 2 (tests/fp32_bounds.py);
a split-K shrink only sums the same products in another order.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from tests.worker.layers.test_linear import (ADAPTER_MIXES, CPU, OUT, SLICES, assert_within_bound,  # noqa: E402
                                             batch_info, lora_weights, reference)
from worker.kernels.lora_shrink import grouped_config  # noqa: E402
from worker.kernels.row_tiles_host import TILE_ROWS, host_tile_map, max_tiles  # noqa: E402
from worker.layers.linear import Linear  # noqa: E402
from worker.layers.lora.reference_backend import ReferenceLoRA  # noqa: E402
from worker.layers.lora.triton_backend import TritonLoRA  # noqa: E402

TRITON = dataclasses.replace(CPU, lora=TritonLoRA())


def with_tile_map(info, num_tokens: int):
    """`info` as a grouped graph hands it over: the host's map of TILE_ROWS-row tiles over its segments, and
    max_seg_len the graph's size (at least 2: a map is for segments longer than one token)."""
    num_tiles = max_tiles(num_tokens, info.num_segments, TILE_ROWS)
    tiles = torch.tensor(host_tile_map(info.seg_indptr_host, TILE_ROWS, num_tiles), dtype=torch.int32)
    return dataclasses.replace(info, tile_map=tiles, max_seg_len=max(2, num_tokens))


def projection(kernels, in_features: int, weight, bias, lora) -> Linear:
    linear = Linear(in_features, SLICES, True, torch.float32, kernels)
    linear.load_shard("weight", None, weight)
    linear.load_shard("bias", None, bias)
    linear.lora = lora
    return linear


@pytest.mark.parametrize("tile_map", [False, True], ids=["searched-tiles", "host-tile-map"])
@pytest.mark.parametrize("mix", list(ADAPTER_MIXES))
@pytest.mark.parametrize("num_tokens", [1, 9, 40])
def test_in_line_triton_projection_equals_the_float32_reference(num_tokens, mix, tile_map):
    in_features = 32
    gen = torch.Generator().manual_seed(num_tokens * 10 + len(mix))
    weight, bias = torch.randn(OUT, in_features, generator=gen) / in_features ** 0.5, torch.randn(OUT, generator=gen)
    ranks = [8, 4, 16]
    lora = lora_weights(ranks, in_features, gen)
    segments = ADAPTER_MIXES[mix](num_tokens, gen)
    info = batch_info([w for w, _ in segments], [n for _, n in segments], ranks)
    if tile_map:
        info = with_tile_map(info, num_tokens)
    assert not info.overlap
    x = torch.randn(num_tokens, in_features, generator=gen)

    y = projection(TRITON, in_features, weight, bias, lora)(x, info)
    assert isinstance(y, torch.Tensor) and y.shape == (num_tokens, OUT)    # in line: never Deferred
    assert_within_bound(y, x, weight, bias, lora, info)
    by_reference = projection(CPU, in_features, weight, bias, lora)(x, info)
    assert type(CPU.lora) is ReferenceLoRA
    assert_within_bound(by_reference, x, weight, bias, lora, info)
    if any(w >= 0 for w, _ in segments):     # guards the comparison: the adapters move y far past the bound
        assert (y - reference(x, weight, bias)).abs().max() > 1e-2


def test_in_line_triton_projection_with_a_split_k_shrink_equals_the_float32_reference():
    """2,048 input features: the grouped shrink cuts K in two (float32 partial sums the expand adds up)."""
    in_features, num_tokens = 2048, 24
    assert grouped_config(in_features, OUT)[1] == 2
    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(OUT, in_features, generator=gen) / in_features ** 0.5, torch.randn(OUT, generator=gen)
    ranks = [16, 4, 8]
    lora = lora_weights(ranks, in_features, gen)
    info = with_tile_map(batch_info([1, 1, -1, 0, 2], [5, 3, 6, 8, 2], ranks), num_tokens)
    x = torch.randn(num_tokens, in_features, generator=gen)
    y = projection(TRITON, in_features, weight, bias, lora)(x, info)
    assert_within_bound(y, x, weight, bias, lora, info)
    assert (y - reference(x, weight, bias)).abs().max() > 1e-2
