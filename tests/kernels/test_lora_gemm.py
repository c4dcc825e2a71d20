"""The decode projection with LoRA in one launch (worker/kernels/lora_gemm.py) against the float32 reference:
float32 and float16 on CPU (Triton interpreter, small shapes); bfloat16 at Llama-3.1-8B shapes on the GPU,
also replayed from a CUDA graph with the rows' adapters changed between replays."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.kernels import lora_gemm as lg, reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
NUM_SLOTS = 5


def rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) / shape[-1] ** 0.25).to(dtype=dtype, device=DEVICE)


def make(rows: int, n: int, k: int, offsets: tuple[int, ...], slot_rank: int, slots: list[int], ranks: list[int],
         dtype: torch.dtype, bias: bool, seed: int = 0):
    """x, W, bias and a pool of NUM_SLOTS adapter slots; slots past an adapter's rank hold garbage, which the
    kernel must not read."""
    num_slices = len(offsets) - 1
    x, w = rand(rows, k, dtype=dtype, seed=seed), rand(n, k, dtype=dtype, seed=seed + 1)
    b0 = rand(n, dtype=dtype, seed=seed + 2) if bias else None
    a = rand(NUM_SLOTS, num_slices * slot_rank, k, dtype=dtype, seed=seed + 3)
    b = rand(NUM_SLOTS, n, slot_rank, dtype=dtype, seed=seed + 4)
    scalings = (torch.rand(NUM_SLOTS, num_slices, generator=torch.Generator().manual_seed(seed)) + 0.5).to(DEVICE)
    lora = lg.RowLoRA(a, b, torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                      torch.tensor(ranks, dtype=torch.int32, device=DEVICE), scalings, offsets)
    return x, w, b0, lora


def expected(x, w, b0, lora: lg.RowLoRA) -> torch.Tensor:
    return reference.lora_gemm(x, w, b0, lora.a, lora.b, lora.slots.tolist(), lora.ranks.tolist(), lora.scalings,
                               list(lora.slice_offsets))


def check(y, ref, dtype):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    torch.testing.assert_close(y, ref, atol=TOL[dtype], rtol=TOL[dtype])


MIXES = {   # rows' slots (first `rows` used); ranks of the 5 slots given with the slot rank R
    "distinct": [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1],
    "identical": [2] * 17,
    "base-and-adapters": [-1, 3, -1, 0, 0, -1, 4, 1, -1, -1, 2, 2, -1, 3, -1, 4, -1],
    "base-only": [-1] * 17,
}
SHAPES = {  # (n, k, slice offsets): one slice; qkv-like slices that straddle column tiles; gate_up-like
    "one-slice": (72, 64, (0, 72)),
    "qkv": (88, 48, (0, 40, 64, 88)),
    "gate_up": (96, 80, (0, 48, 96)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mix", MIXES)
def test_lora_gemm_matches_reference(dtype, rows, shape, mix):
    n, k, offsets = SHAPES[shape]
    ranks = [16, 8, 3, 0, 16]            # slot 3 is empty (rank 0): a row on it gets no delta
    x, w, b0, lora = make(rows, n, k, offsets, 16, MIXES[mix][:rows], ranks, dtype, bias=shape == "qkv")
    y = lg.lora_gemm(x, w, b0, lora, lg.Config(block_n=32, block_k=32, split_k=2))
    check(y, expected(x, w, b0, lora), dtype)


@pytest.mark.parametrize("cfg", [lg.Config(16, 16, 1), lg.Config(32, 64, 1), lg.Config(64, 16, 3),
                                 lg.Config(32, 32, 4, num_warps=8, num_stages=2)])
@pytest.mark.parametrize("slot_rank, ranks", [(8, [8, 5, 1, 8, 2]), (32, [32, 16, 7, 0, 32]),
                                              (64, [64, 40, 16, 3, 64])])
def test_lora_gemm_configs_and_slot_ranks(cfg, slot_rank, ranks):
    """Tiles, K parts (K tails shorter than a part and than a step) and slot ranks only change the summation
    order; adapters of any rank up to the slot's."""
    n, k, offsets = 88, 112, (0, 40, 64, 88)
    x, w, b0, lora = make(6, n, k, offsets, slot_rank, [4, 0, -1, 2, 1, 3], ranks, torch.float32, bias=True)
    check(lg.lora_gemm(x, w, b0, lora, cfg), expected(x, w, b0, lora), torch.float32)


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_lora_gemm_without_adapters_is_the_projection(split_k, bias):
    x, w, b0, _ = make(5, 70, 100, (0, 70), 16, [-1] * 5, [0] * 5, torch.float32, bias)
    y = lg.lora_gemm(x, w, b0, None, lg.Config(32, 32, split_k))
    check(y, reference.linear(x, w, b0), torch.float32)


def test_lora_gemm_counters_return_to_zero_and_results_repeat():
    """Every launch leaves the ticket and arrival counters at zero for the next; the same inputs give the
    same bits (split parts are added in part order, whichever finishes first)."""
    x, w, b0, lora = make(17, 88, 48, (0, 40, 64, 88), 16, MIXES["distinct"], [16, 8, 3, 0, 16], torch.float32,
                          bias=True)
    cfg = lg.Config(16, 16, 3)
    first = lg.lora_gemm(x, w, b0, lora, cfg)
    for _ in range(2):
        assert torch.equal(lg.lora_gemm(x, w, b0, lora, cfg), first)
        assert not lg.sync_buffer(x.device).any()


def test_lora_gemm_row_strided_input_and_empty_batch():
    wide = rand(4, 160, dtype=torch.float32, seed=7)
    x = wide[:, 16:96]
    _, w, b0, lora = make(4, 96, 80, (0, 48, 96), 16, [1, -1, 0, 4], [16, 8, 3, 0, 16], torch.float32, bias=False)
    check(lg.lora_gemm(x, w, b0, lora, lg.Config(32, 32, 2)), expected(x, w, b0, lora), torch.float32)
    assert lg.lora_gemm(wide[:0, :80], w, None, lora).shape == (0, 96)


def test_default_config_gives_every_sm_work_within_shared_memory():
    """At Llama-3.1-8B shapes: at least 96 programs (o_proj and down_proj cut along K in two, as the sweep chose),
    no K part shorter than 4 loop steps, and the pipeline's stage buffers within an H100 SM's 227 KB at 64 rows."""
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
        cfg = lg.default_config(32, n, k)
        assert -(-n // cfg.block_n) * cfg.split_k >= 96 and k // cfg.split_k >= 4 * cfg.block_k
        assert cfg.num_stages * (cfg.block_n + 64) * cfg.block_k * 2 <= 227 << 10
    assert [lg.default_config(32, n, k).split_k for n, k in [(6144, 4096), (4096, 4096), (4096, 14336)]] == [1, 2, 2]


# ---------------------------------------------------------------------------------------------- GPU only
LLAMA = {"qkv": (4096, (0, 4096, 5120, 6144)), "o": (4096, (0, 4096)), "gate_up": (4096, (0, 14336, 28672)),
         "down": (14336, (0, 4096))}


@pytest.mark.skipif(DEVICE != "cuda", reason="real shapes in bfloat16 need a GPU")
@pytest.mark.parametrize("proj", LLAMA)
@pytest.mark.parametrize("rows, popularity", [(3, "distinct"), (16, "zipf"), (32, "distinct"), (32, "identical"),
                                              (64, "uniform")])
@pytest.mark.parametrize("slot_rank", [16, 64])
def test_lora_gemm_llama_shapes_bf16(proj, rows, popularity, slot_rank):
    """bf16 at Llama-3.1-8B shapes, 32 slots of mixed ranks (8..slot rank), some rows without an adapter,
    against the float32 reference: within bf16 rounding of the output (and of xa, which both round)."""
    k, offsets = LLAMA[proj]
    n = offsets[-1]
    g = torch.Generator().manual_seed(rows)
    num_slots = 32
    if popularity == "distinct":
        slots = torch.randperm(num_slots, generator=g)[:rows].tolist() + list(range(max(0, rows - num_slots)))
    elif popularity == "identical":
        slots = [5] * rows
    elif popularity == "zipf":
        p = 1.0 / torch.arange(1, num_slots + 1) ** 1.5
        slots = torch.multinomial(p / p.sum(), rows, replacement=True, generator=g).tolist()
    else:
        slots = torch.randint(0, num_slots, (rows,), generator=g).tolist()
    slots = [s if i % 5 != 4 else -1 for i, s in enumerate(slots)]
    ranks = [max(8, (slot_rank >> (i % 3))) for i in range(num_slots)]
    num_slices = len(offsets) - 1
    x = rand(rows, k, dtype=torch.bfloat16, seed=1)
    w = rand(n, k, dtype=torch.bfloat16, seed=2)
    a = rand(num_slots, num_slices * slot_rank, k, dtype=torch.bfloat16, seed=3)
    b = rand(num_slots, n, slot_rank, dtype=torch.bfloat16, seed=4) * 0.5
    lora = lg.RowLoRA(a, b, torch.tensor(slots, dtype=torch.int32, device=DEVICE),
                      torch.tensor(ranks, dtype=torch.int32, device=DEVICE),
                      torch.full((num_slots, num_slices), 2.0, device=DEVICE), offsets)
    y = lg.lora_gemm(x, w, None, lora)
    ref = expected(x, w, None, lora)
    scale = ref.float().abs().amax()
    err = (y.float() - ref.float()).abs()
    assert err.amax() <= 2 ** -7 * scale, (err.amax().item(), scale.item())
    assert (err <= 2 ** -8 * ref.float().abs() + 2e-3 * scale).float().mean() > 0.999
    assert not lg.sync_buffer(x.device).any()


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_lora_gemm_replays_from_a_cuda_graph_with_new_adapters():
    """Captured once, replayed 40 times with the rows' slots rewritten in place between replays: each replay
    equals an eager launch on the same slots (same kernel and tiles, so the same bits)."""
    k, offsets = LLAMA["qkv"]
    n = offsets[-1]
    rows, num_slots = 32, 32
    x = rand(rows, k, dtype=torch.bfloat16, seed=1)
    w = rand(n, k, dtype=torch.bfloat16, seed=2)
    a = rand(num_slots, 3 * 16, k, dtype=torch.bfloat16, seed=3)
    b = rand(num_slots, n, 16, dtype=torch.bfloat16, seed=4)
    slots = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    lora = lg.RowLoRA(a, b, slots, torch.full((num_slots,), 16, dtype=torch.int32, device=DEVICE),
                      torch.ones(num_slots, 3, device=DEVICE), offsets)
    lg.lora_gemm(x, w, None, lora)            # compiles, allocates the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = lg.lora_gemm(x, w, None, lora)
    g = torch.Generator().manual_seed(0)
    for i in range(40):
        new = torch.randint(-1, num_slots, (rows,), generator=g, dtype=torch.int32)
        slots.copy_(new)
        graph.replay()
        assert torch.equal(y, lg.lora_gemm(x, w, None, lora)), f"replay {i}"
    assert not lg.sync_buffer(x.device).any()
