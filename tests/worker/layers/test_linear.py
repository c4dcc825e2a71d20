"""Linear at its interface (`Linear(...)`, `.load_shard`, `.lora` = LoRAWeights, `.forward(x, lora_info)`), on the CPU:
column- and row-parallel ranks load their share of a checkpoint tensor, and the forward pass equals the float32
reference

    y = x W^T + b + Σ_seg scale[w, s] · x[seg] A[w, s]^T B[w, s]^T      (over segments seg of slot w, slices s)

for LoRA ranks 1 to 16, batches of 1 to 40 tokens and adapter mixes of base-only rows, one adapter, distinct adapters
and adapters drawn at random; a row-parallel projection's ranks add up to it with the bias and each adapter's scaling
applied once.

Tolerance: each output is a sum of n = in_features + R + 2 float32 products (the base dot product, the LoRA shrink
and expand, the bias and the delta added), so two evaluations in other orders differ by at most
n · eps · Σ|terms| (tests/fp32_bounds.py), with Σ|terms| computed per output from |x|, |W|, |b|, |A| and |B|.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.fp32_bounds import EPS
from worker.batch import LoRABatchInfo
from worker.lora.weights import LoRAWeights
from worker.distributed.tensor_parallel import TensorParallel
from worker.config import KernelConfig
from worker.layers.linear import Linear
from worker.models.builder import resolve_kernels

IN, SLICES, R = 32, [16, 8, 8], 16           # a qkv-like projection: three fused slices, slots of rank R
OUT = sum(SLICES)
OFFSETS = (0, 16, 24, 32)
NUM_SLOTS = 3
CPU = resolve_kernels(KernelConfig(), torch.device("cpu"))   # every layer on its torch reference, LoRA too


@dataclass(frozen=True)
class PartialSums(TensorParallel):
    """A rank of a pretend group whose all-reduce returns this rank's partial sum, for the test to add up."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


def lora_weights(ranks: list[int], in_features: int, gen: torch.Generator) -> LoRAWeights:
    """Slots of random adapters of `ranks`, zero-padded to R as the pool holds them (LoRAWeights' layout)."""
    a = torch.zeros(NUM_SLOTS, len(SLICES) * R, in_features)
    b = torch.zeros(NUM_SLOTS, OUT, R)
    for w, r in enumerate(ranks):
        for s in range(len(SLICES)):
            a[w, s * R:s * R + r] = torch.randn(r, in_features, generator=gen) / in_features ** 0.5
            b[w, OFFSETS[s]:OFFSETS[s + 1], :r] = torch.randn(SLICES[s], r, generator=gen)
    scalings = torch.rand(NUM_SLOTS, len(SLICES), generator=gen) + 0.5
    return LoRAWeights(a, b, scalings, OFFSETS)


def batch_info(slots: list[int], seg_lens: list[int], ranks: list[int]) -> LoRABatchInfo:
    """Segments of `seg_lens` tokens on `slots` (-1: base only)."""
    indptr = [0]
    for n in seg_lens:
        indptr.append(indptr[-1] + n)
    token_lora_slots = [w for w, n in zip(slots, seg_lens) for _ in range(n)]
    i32 = torch.int32
    return LoRABatchInfo(len(slots), torch.tensor(indptr, dtype=i32), torch.tensor(slots, dtype=i32),
                         torch.tensor(ranks, dtype=i32), max((ranks[w] for w in slots if w >= 0), default=0),
                         max_seg_len=max(seg_lens), token_lora_slots=torch.tensor(token_lora_slots, dtype=i32),
                         seg_indptr_host=indptr, seg_lora_slots_host=list(slots), ranks_host=list(ranks),
                         token_lora_slots_host=token_lora_slots)


def reference(x, weight, bias, lora: LoRAWeights | None = None, info: LoRABatchInfo | None = None,
              absolute: bool = False) -> torch.Tensor:
    """The module docstring's y in float32; with `absolute`, the same sum over |terms| (float64) instead."""
    if absolute:
        x, weight, bias = x.double().abs(), weight.double().abs(), bias.double().abs()
    y = x @ weight.T + bias
    if lora is None:
        return y
    a, b, scalings = lora.a, lora.b, lora.scalings
    if absolute:
        a, b, scalings = a.double().abs(), b.double().abs(), scalings.double().abs()
    bounds = info.seg_indptr_host
    for seg, w in enumerate(info.seg_lora_slots_host):
        if w < 0:
            continue
        rows, r = slice(bounds[seg], bounds[seg + 1]), info.ranks_host[w]
        for s in range(len(SLICES)):
            a_s, b_s = a[w, s * R:s * R + r], b[w, OFFSETS[s]:OFFSETS[s + 1], :r]     # [r, in], [slice, r]
            y[rows, OFFSETS[s]:OFFSETS[s + 1]] += scalings[w, s] * (x[rows] @ a_s.T) @ b_s.T
    return y


def assert_within_bound(y: torch.Tensor, x, weight, bias, lora: LoRAWeights | None = None,
                        info: LoRABatchInfo | None = None) -> None:
    expected = reference(x, weight, bias, lora, info)
    bound = (x.shape[1] + R + 2) * EPS * reference(x, weight, bias, lora, info, absolute=True)
    excess = ((y - expected).abs().double() - bound).max().item()
    assert excess <= 0, f"an output is {excess:.2e} over its summation-order bound"


ADAPTER_MIXES = {                            # (slot, tokens) per segment for a batch of n tokens
    "base-only": lambda n, g: [(-1, n)],
    "one-adapter": lambda n, g: [(0, n)],
    "distinct": lambda n, g: [(w, c) for w, c in zip([2, 0, 1], _cuts(n, 3))],
    "base-rows-between-adapters": lambda n, g: [(w, c) for w, c in zip([-1, 1, -1, 0, 2], _cuts(n, 5))],
    "random": lambda n, g: [(int(w), c) for w, c in zip(torch.randint(-1, NUM_SLOTS, (n,), generator=g), _cuts(n, n))],
}


def _cuts(n: int, parts: int) -> list[int]:
    """n tokens into at most `parts` non-empty segments, the first ones longer."""
    parts = min(parts, n)
    return [n // parts + (i < n % parts) for i in range(parts)]


@pytest.mark.parametrize("mix", list(ADAPTER_MIXES))
@pytest.mark.parametrize("num_tokens", [1, 9, 40])
@pytest.mark.parametrize("rank", [1, 8, 16])
def test_forward_with_lora_equals_the_float32_reference(rank, num_tokens, mix):
    gen = torch.Generator().manual_seed(rank * 100 + num_tokens)
    linear = Linear(IN, SLICES, True, torch.float32, CPU)
    linear.load_shard("weight", None, torch.randn(OUT, IN, generator=gen) / IN ** 0.5)
    linear.load_shard("bias", None, torch.randn(OUT, generator=gen))
    ranks = [rank, max(1, rank // 2), R]                 # slots of three ranks, each zero-padded to R
    linear.lora = lora_weights(ranks, IN, gen)
    segments = ADAPTER_MIXES[mix](num_tokens, gen)
    info = batch_info([w for w, _ in segments], [n for _, n in segments], ranks)
    x = torch.randn(num_tokens, IN, generator=gen)
    assert_within_bound(linear(x, info), x, linear.weight, linear.bias, linear.lora, info)
    if any(w >= 0 for w, _ in segments):     # guards the comparison: the adapters move y far past the bound
        assert (linear(x, info) - reference(x, linear.weight, linear.bias)).abs().max() > 1e-2


def test_forward_without_lora_info_is_the_base_projection():
    gen = torch.Generator().manual_seed(5)
    linear = Linear(IN, SLICES, True, torch.float32, CPU)
    linear.load_shard("weight", None, torch.randn(OUT, IN, generator=gen))
    linear.load_shard("bias", None, torch.randn(OUT, generator=gen))
    linear.lora = lora_weights([8, 8, 8], IN, gen)
    x = torch.randn(4, IN, generator=gen)
    assert_within_bound(linear(x), x, linear.weight, linear.bias)
    assert torch.equal(linear(x), linear(x, batch_info([-1], [4], [0, 0, 0])))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_column_parallel_rank_loads_its_rows_of_each_fused_slice(rank):
    """Rank 1 of 2 of q|k|v = 16|8|8 rows: q rows [8, 16), k rows [4, 8), v rows [4, 8), fused or slice by slice."""
    tp = TensorParallel(rank=rank, world_size=2)
    shards = [tp.split(size, "slice") for size in SLICES]
    whole, bias = torch.randn(OUT, IN), torch.randn(OUT)
    fused = Linear.column_parallel(IN, SLICES, shards, True, torch.float32, CPU)
    fused.load_shard("weight", None, whole)
    fused.load_shard("bias", None, bias)
    by_slice = Linear.column_parallel(IN, SLICES, shards, True, torch.float32, CPU)
    for s, (part, part_bias) in enumerate(zip(whole.split(SLICES), bias.split(SLICES))):
        by_slice.load_shard("weight", s, part)
        by_slice.load_shard("bias", s, part_bias)
    rows = torch.cat([torch.arange(o + start, o + start + n) for o, (start, n) in zip(OFFSETS, shards)])
    assert rows.tolist()[:8] == list(range(8 * rank, 8 * rank + 8))
    x = torch.randn(3, IN)
    for linear in (fused, by_slice):
        assert torch.equal(linear.weight, whole[rows]) and torch.equal(linear.bias, bias[rows])
        assert_within_bound(linear(x), x, whole[rows], bias[rows])


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_checkpoint_tensor_of_the_wrong_shape_is_refused_on_every_rank(world_size):
    """The whole checkpoint tensor is checked before a rank cuts its share: a q slice of 8 rows where 16 are expected
    would otherwise load silently on rank 0 of 2 (its rows [0, 8) exist) and fail as an indexing error on rank 1."""
    for rank in range(world_size):
        tp = TensorParallel(rank=rank, world_size=world_size)
        column = Linear.column_parallel(IN, SLICES, [tp.split(size, "slice") for size in SLICES], False,
                                        torch.float32, CPU)
        with pytest.raises(ValueError, match=r"shape mismatch: checkpoint \(8, 32\) vs model \(16, 32\)"):
            column.load_shard("weight", 0, torch.randn(8, IN))
        with pytest.raises(ValueError, match=r"shape mismatch: checkpoint \(32, 24\) vs model \(32, 32\)"):
            column.load_shard("weight", None, torch.randn(OUT, 24))
        row = Linear.row_parallel(IN, SLICES, True, torch.float32, CPU, tp)
        with pytest.raises(ValueError, match=r"shape mismatch: checkpoint \(32, 16\) vs model \(32, 32\)"):
            row.load_shard("weight", None, torch.randn(OUT, IN // 2))
        with pytest.raises(ValueError, match=r"shape mismatch: checkpoint \(16,\) vs model \(32,\)"):
            row.load_shard("bias", None, torch.randn(OUT // 2))


@pytest.mark.parametrize("num_tokens", [1, 9])
def test_row_parallel_ranks_add_up_to_the_whole_projection_with_lora(num_tokens):
    """Rank k of 2 holds input columns [16k, 16k + 16) of W and of each adapter's A, B whole, the bias added on rank
    0 only: the ranks' partial sums (LoRA expand added before the all-reduce) add up to the whole projection."""
    gen = torch.Generator().manual_seed(num_tokens)
    weight, bias = torch.randn(OUT, IN, generator=gen) / IN ** 0.5, torch.randn(OUT, generator=gen)
    ranks = [4, 16, 8]
    whole_lora = lora_weights(ranks, IN, gen)
    info = batch_info([1, -1, 0], _cuts(num_tokens, 3), ranks) if num_tokens > 2 else batch_info([1], [1], ranks)
    x = torch.randn(num_tokens, IN, generator=gen)
    partials = []
    for rank in range(2):
        tp = PartialSums(rank=rank, world_size=2)
        linear = Linear.row_parallel(IN, SLICES, True, torch.float32, CPU, tp)
        linear.load_shard("weight", None, weight)
        linear.load_shard("bias", None, bias)
        start, length = tp.split(IN, "in_features")
        assert torch.equal(linear.weight, weight[:, start:start + length]) and torch.equal(linear.bias, bias)
        a = whole_lora.a[..., start:start + length]
        linear.lora = LoRAWeights(a, whole_lora.b, whole_lora.scalings, OFFSETS)
        partials.append(linear(x[:, start:start + length], info))
    assert_within_bound(partials[0] + partials[1], x, weight, bias, whole_lora, info)
