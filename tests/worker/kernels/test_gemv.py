"""The small-batch projection kernel against the float32 reference (float32 and float16 on CPU; bfloat16 and
Llama-3.1-8B shapes on the GPU), and against cuBLAS's F.linear there."""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.kernels import gemv, reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rand(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) / shape[-1] ** 0.25).to(dtype=dtype, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("n, k", [(96, 64), (37, 200), (8, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_reference(dtype, rows, n, k, bias):
    x, w = rand(rows, k, dtype=dtype), rand(n, k, dtype=dtype, seed=1)
    b = rand(n, dtype=dtype, seed=2) if bias else None
    y = gemv.gemv(x, w, b)
    assert y.shape == (rows, n) and y.dtype == dtype
    torch.testing.assert_close(y, reference.linear(x, w, b), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("cfg", [(1, 2, 32, 1), (4, 16, 64, 2), (2, 4, 128, 4)])
def test_gemv_any_config_gives_the_same_result(cfg):
    """Configs only change the summation order: every one agrees with the reference (odd N and K tails)."""
    rows = min(cfg[0], 2)
    x, w, b = rand(rows, 150, dtype=torch.float32), rand(41, 150, dtype=torch.float32, seed=1), None
    torch.testing.assert_close(gemv.gemv(x, w, b, config=cfg), reference.linear(x, w, b), atol=1e-5, rtol=1e-5)


def test_gemv_row_strided_input_and_empty_batch():
    """x may be a row-strided view (a slice of a wider activation); zero rows give an empty result."""
    wide = rand(3, 256, dtype=torch.float32)
    x, w = wide[:, 64:192], rand(24, 128, dtype=torch.float32, seed=1)
    torch.testing.assert_close(gemv.gemv(x, w), reference.linear(x, w), atol=1e-5, rtol=1e-5)
    assert gemv.gemv(wide[:0, :128], w).shape == (0, 24)


@pytest.mark.skipif(DEVICE != "cuda", reason="real shapes in bfloat16 need a GPU")
@pytest.mark.parametrize("rows", [1, 2, 4])
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)])
def test_gemv_llama_shapes_bf16(rows, n, k):
    """Each output within half a bf16 ulp (2^-8 relative) of the float32 sum, plus float32 summation error;
    and close to cuBLAS's F.linear."""
    x, w = rand(rows, k, dtype=torch.bfloat16), rand(n, k, dtype=torch.bfloat16, seed=1)
    exact = x.float() @ w.float().T
    y = gemv.gemv(x, w)
    assert ((y.float() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-4).all()
    torch.testing.assert_close(y, F.linear(x, w), atol=1.6e-2, rtol=1.6e-2)
