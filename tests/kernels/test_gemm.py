"""The skinny GEMM kernel against its float32 reference (interpreter on CPU; bf16 at model shapes on a GPU)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.kernels import reference  # noqa: E402
from worker.kernels.gemm import skinny_gemm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rand(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * shape[-1] ** -0.5).to(dtype=dtype, device=DEVICE)


def check(rows, n, k, dtype, bias):
    x, w = rand(rows, k, dtype=dtype, seed=rows), rand(n, k, dtype=dtype, seed=n + k)
    b = rand(n, dtype=dtype, seed=3) if bias else None
    y = skinny_gemm(x, w, b)
    ref = reference.linear(x, w, b)
    assert y.dtype == dtype and y.shape == (rows, n)
    torch.testing.assert_close(y.float(), ref, rtol=TOL[dtype], atol=TOL[dtype] * ref.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n, k", [(48, 256), (40, 300), (7, 64)])   # whole tiles, ragged N and K, N < one tile
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_gemm_matches_reference(dtype, rows, n, k, bias):
    check(rows, n, k, dtype, bias)


def test_skinny_gemm_on_a_strided_row_view():
    x = rand(4, 2 * 128, dtype=torch.float32, seed=5)[:, :128]      # rows strided by twice their length
    w = rand(32, 128, dtype=torch.float32, seed=6)
    torch.testing.assert_close(skinny_gemm(x, w), reference.linear(x, w), rtol=1e-5, atol=1e-5)


def test_more_than_sixteen_rows_is_refused():
    with pytest.raises(AssertionError, match="at most 16 rows"):
        skinny_gemm(torch.zeros(17, 8, device=DEVICE), torch.zeros(8, 8, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 2, 8, 16])
@pytest.mark.parametrize("n, k", [(4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336)],
                         ids=["o", "qkv", "gate_up", "down"])
def test_skinny_gemm_at_llama_8b_shapes_bf16(rows, n, k):
    check(rows, n, k, torch.bfloat16, bias=False)
