"""The skinny projection kernel (worker/kernels/skinny_gemm.py) against the float32 reference: float32 and
float16 on CPU (Triton interpreter, small shapes); bfloat16 at Llama-3.1-8B shapes on the GPU, against cuBLAS too,
and replayed from a CUDA graph."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.kernels import reference, skinny_gemm as sg  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
COUNTERS = sg.new_counters(torch.device(DEVICE))     # shared by every launch here, as by a model's layers
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) / shape[-1] ** 0.25).to(dtype=dtype, device=DEVICE)


def check(y, ref, dtype):
    assert y.shape == ref.shape and y.dtype == ref.dtype
    torch.testing.assert_close(y, ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64])
@pytest.mark.parametrize("n, k", [(72, 64), (37, 200), (96, 48)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_matches_reference(dtype, rows, n, k, bias):
    """Column tiles and K parts that do not divide N and K (masked tails), row counts on both sides of a
    tile's 16 / 32 / 64 rows, with and without bias."""
    x, w = rand(rows, k, dtype=dtype, seed=0), rand(n, k, dtype=dtype, seed=1)
    b = rand(n, dtype=dtype, seed=2) if bias else None
    check(sg.skinny_gemm(x, w, b, COUNTERS, sg.Config(block_n=32, block_k=32, split_k=2)), reference.linear(x, w, b),
          dtype)


@pytest.mark.parametrize("cfg", [sg.Config(16, 16, 1), sg.Config(32, 64, 1), sg.Config(64, 16, 3),
                                 sg.Config(32, 32, 4, num_warps=8, num_stages=2), sg.Config(16, 32, 8)])
def test_any_config_gives_the_same_result(cfg):
    """Tiles and K parts only change the summation order (a K part shorter than a step, parts past K)."""
    x, w, b = rand(6, 112, dtype=torch.float32, seed=3), rand(88, 112, dtype=torch.float32, seed=4), None
    check(sg.skinny_gemm(x, w, b, COUNTERS, cfg), reference.linear(x, w, b), torch.float32)


def test_counters_return_to_zero_and_results_repeat():
    """Every launch leaves the arrival counters at zero for the next; the same inputs give the same bits (the
    parts are added in part order, whichever finishes first)."""
    x, w = rand(17, 96, dtype=torch.float32, seed=5), rand(88, 96, dtype=torch.float32, seed=6)
    cfg = sg.Config(16, 16, 3)
    first = sg.skinny_gemm(x, w, None, COUNTERS, cfg)
    for _ in range(2):
        assert torch.equal(sg.skinny_gemm(x, w, None, COUNTERS, cfg), first)
        assert not COUNTERS.any()


def test_row_strided_input_and_empty_batch():
    wide = rand(4, 160, dtype=torch.float32, seed=7)
    x, w = wide[:, 16:96], rand(96, 80, dtype=torch.float32, seed=8)
    check(sg.skinny_gemm(x, w, None, COUNTERS, sg.Config(32, 32, 2)), reference.linear(x, w), torch.float32)
    assert sg.skinny_gemm(wide[:0, :80], w, None, COUNTERS).shape == (0, 96)


def test_default_config_gives_every_sm_work_within_shared_memory():
    """At Llama-3.1-8B shapes: at least 96 programs (o_proj and down_proj cut along K in two, as the sweep chose),
    no K part shorter than 4 loop steps, and 5 pipeline stages within the shared-memory budget at 64 bf16 rows."""
    for n, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]:
        cfg = sg.default_config(32, n, k)
        assert -(-n // cfg.block_n) * cfg.split_k >= 96 and k // cfg.split_k >= 4 * cfg.block_k
        assert cfg.num_stages * (cfg.block_n + 64) * cfg.block_k * 2 <= sg.SMEM_BYTES
    assert [sg.default_config(32, n, k).split_k for n, k in [(6144, 4096), (4096, 4096), (4096, 14336)]] == [1, 2, 2]


# ---------------------------------------------------------------------------------------------- GPU only
LLAMA = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.mark.skipif(DEVICE != "cuda", reason="real shapes in bfloat16 need a GPU")
@pytest.mark.parametrize("rows", [3, 8, 17, 32, 64])
@pytest.mark.parametrize("n, k", LLAMA)
def test_llama_shapes_bf16(rows, n, k):
    """Each output within half a bf16 ulp (2^-8 relative) of the float32 sum plus float32 summation error, as
    close to it as cuBLAS's F.linear is."""
    x, w = rand(rows, k, dtype=torch.bfloat16, seed=1), rand(n, k, dtype=torch.bfloat16, seed=2)
    exact = x.float() @ w.float().T
    ours, cublas = sg.skinny_gemm(x, w, None, COUNTERS), F.linear(x, w)
    bound = 2 ** -8 * exact.abs() + 1e-5 * exact.abs().amax()
    assert ((ours.float() - exact).abs() <= bound).all()
    assert (ours.float() - exact).abs().mean() <= 1.05 * (cublas.float() - exact).abs().mean() + 1e-6
    assert not COUNTERS.any()


@pytest.mark.skipif(DEVICE != "cuda", reason="float32 at 64 rows needs a GPU (shared memory per stage)")
def test_float32_at_64_rows_fits_shared_memory():
    """float32 tiles take twice the bytes: the launch takes fewer pipeline stages rather than failing."""
    x, w = rand(64, 4096, dtype=torch.float32, seed=1), rand(4096, 4096, dtype=torch.float32, seed=2)
    torch.testing.assert_close(sg.skinny_gemm(x, w, None, COUNTERS), reference.linear(x, w), atol=2e-4, rtol=2e-4)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs need a GPU")
def test_replays_from_a_cuda_graph():
    """Captured once (split along K: the counters reset themselves), replayed 30 times with new rows of x
    written in place: each replay equals an eager launch bit for bit."""
    x = rand(32, 4096, dtype=torch.bfloat16, seed=1)
    w = rand(4096, 4096, dtype=torch.bfloat16, seed=2)
    assert sg.default_config(32, 4096, 4096).split_k > 1
    sg.skinny_gemm(x, w, None, COUNTERS)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = sg.skinny_gemm(x, w, None, COUNTERS)
    for i in range(30):
        x.copy_(rand(32, 4096, dtype=torch.bfloat16, seed=10 + i))
        graph.replay()
        assert torch.equal(y, sg.skinny_gemm(x, w, None, COUNTERS)), f"replay {i}"
    assert not COUNTERS.any()
