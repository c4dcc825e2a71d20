"""RMSNorm at its interface (`RMSNorm(dim, eps, dtype, kernels)`, `.forward(x, residual)`), on the CPU, against a
float64 reference of its semantics: with a residual, residual <- x + residual in place (x's dtype) and v = residual,
else v = x; out = weight * round(v / sqrt(mean(v^2) + eps)).

Tolerance, relative to |out|: the mean of D squares in float32 is within D·eps of exact (tests/fp32_bounds.py),
halved by the square root, with four more float32 roundings (the mean's division, eps added, the reciprocal square
root, the product): (D + 4)·eps. bfloat16 adds two roundings of the result to 8 bits (round(...) and the product
with the weight): 2·2^-8 more."""
from __future__ import annotations

import pytest
import torch

from tests.fp32_bounds import EPS
from worker.kernels.choices import KernelChoices
from worker.layers.norm import RMSNorm

RMS_EPS = 1e-5


def rtol(dtype: torch.dtype, dim: int) -> float:
    return (dim + 4) * EPS + (2 * 2.0 ** -8 if dtype == torch.bfloat16 else 0.0)


def reference(v: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    v64 = v.double()
    return weight.double() * v64 / torch.sqrt(v64.pow(2).mean(-1, keepdim=True) + RMS_EPS)


def make_norm(dim: int, dtype: torch.dtype, gen: torch.Generator) -> RMSNorm:
    norm = RMSNorm(dim, RMS_EPS, dtype, KernelChoices())
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(dim, generator=gen))
    return norm


@pytest.mark.parametrize("scale", [3.0, 1e-3], ids=["eps-negligible", "eps-dominant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens, dim", [(1, 64), (7, 128), (33, 4096)])
def test_rms_norm_equals_the_reference(num_tokens, dim, dtype, scale):
    """At scale 1e-3, mean(x^2) ~ 1e-6 is below eps = 1e-5: eps sets the result."""
    gen = torch.Generator().manual_seed(dim)
    norm = make_norm(dim, dtype, gen)
    x = (scale * torch.randn(num_tokens, dim, generator=gen)).to(dtype)
    expected = reference(x, norm.weight)
    out = norm(x)
    assert out.dtype == dtype and out.shape == x.shape
    err = ((out.double() - expected).abs() / expected.abs().clamp_min(1e-30)).max().item()
    assert err <= rtol(dtype, dim), f"{err:.2e} relative, over {rtol(dtype, dim):.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_residual_normalises_the_sum_and_leaves_it_in_the_residual(dtype):
    gen = torch.Generator().manual_seed(3)
    norm = make_norm(64, dtype, gen)
    x = torch.randn(5, 64, generator=gen).to(dtype)
    residual = (10 * torch.randn(5, 64, generator=gen)).to(dtype)
    total = x + residual                                     # in x's dtype, as the layer adds
    out = norm(x, residual)
    assert torch.equal(residual, total)
    expected = reference(total, norm.weight)
    err = ((out.double() - expected).abs() / expected.abs().clamp_min(1e-30)).max().item()
    assert err <= rtol(dtype, 64), f"{err:.2e} relative, over {rtol(dtype, 64):.2e}"
    assert (out.double() - reference(x, norm.weight)).abs().max() > 0.1    # the residual changed the result
