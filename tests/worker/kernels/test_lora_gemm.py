"""The GEMM with the LoRA expand in its epilogue (kernels/lora_gemm.py) against a float32 reference.

Without CUDA the kernel runs in the Triton interpreter on small fp16/fp32 shapes (the interpreter does not emulate bf16
dots); with CUDA it compiles and bf16 is added. Scenarios, slots and slices are those of the shrink/expand tests.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tests.worker.kernels.test_lora_kernels import (DEVICE, DTYPES, IN_DIM, NUM_SLOTS, SCENARIOS,  # noqa: E402
                                                    SLICE_WIDTHS, _make_batch, _offsets, _per_token_xa,
                                                    _per_token_y, _randn)
from worker.kernels.lora_gemm import lora_gemm  # noqa: E402
from worker.kernels.lora_shrink import lora_shrink  # noqa: E402
from worker.kernels.row_tiles_host import TILE_ROWS, host_tile_map, max_tiles  # noqa: E402

# Bound: y's reference is a float32 sum of IN_DIM + R products; the kernel's float32 sums differ from it by the
# order of summation only (|error| <= (IN_DIM + R) * eps32 * sum |terms|), far below one rounding into the output
# dtype, which is the tolerance: half an ulp of the output dtype at the largest magnitude, doubled for the
# base/delta split (xa is rounded to the input dtype before the expand, as lora_shrink stores it).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# the scenarios whose segments are longer than one row (a decode step of single-row segments keeps its GEMV)
FUSED = ["decode-merged-uniform-ranks4+16", "prefill-distinct-ranks4+16", "prefill-identical",
         "prefill-zipf-ranks4+16", "prefill-uniform-R128", "mixed-graph-padded", "mixed-70-segments"]
CONFIGS = {"16x32x32": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, BLOCK_R=16, num_warps=4, num_stages=1),
           "32x64x16": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=16, BLOCK_R=16, num_warps=4, num_stages=1)}


def _reference(x, w, bias, xa, b, scalings, batch, offsets) -> torch.Tensor:
    """float32: x @ w^T + bias, plus each row's scaled delta; NaN on rows in no segment (the kernel leaves them)."""
    base = x.float() @ w.float().T + (0.0 if bias is None else bias.float())
    y = _per_token_y(base, xa, b, scalings, batch, offsets)
    for t, slot in enumerate(batch.token_lora_slots()):
        if slot is None:
            y[t] = float("nan")
    return y


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    magnitude = expected.nan_to_num().abs().max().item()
    torch.testing.assert_close(actual.float(), expected, rtol=tol, atol=tol * magnitude, equal_nan=True)


# (tiles, config, bias): searched tiles at two tile shapes, the host's map at its TILE_ROWS rows
VARIANTS = {"searched-16x32x32": (False, "16x32x32", False), "searched-32x64x16-bias": (False, "32x64x16", True),
            "host-tile-map-bias": (True, "16x32x32", True)}
CASES = [(dtype, widths, scenario) for dtype in DTYPES for widths in SLICE_WIDTHS
         for scenario in FUSED if dtype == torch.float32 or widths == "qkv"]    # every case at float32


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype,widths,scenario", CASES, ids=[f"{d}-{w}-{s}" for d, w, s in CASES])
def test_fused_gemm_matches_the_base_product_plus_each_segments_delta(dtype, widths, scenario, variant):
    tile_map, config, bias = VARIANTS[variant]
    cfg = CONFIGS[config]
    widths = SLICE_WIDTHS[widths]
    if tile_map and cfg["BLOCK_M"] != TILE_ROWS:
        pytest.skip("the host's tile map is cut in TILE_ROWS rows")
    gen = torch.Generator().manual_seed(3)
    batch = _make_batch(SCENARIOS[scenario], gen)
    ns, R, out_dim = len(widths), batch.max_rank, sum(widths)
    x = _randn(batch.num_tokens, IN_DIM, gen=gen).to(dtype)
    w = _randn(out_dim, IN_DIM, gen=gen, scale=IN_DIM ** -0.5).to(dtype)
    b_vec = _randn(out_dim, gen=gen).to(dtype) if bias else None
    a = _randn(NUM_SLOTS, ns * R, IN_DIM, gen=gen, scale=IN_DIM ** -0.5).to(dtype)
    b = _randn(NUM_SLOTS, out_dim, R, gen=gen, scale=R ** -0.5).to(dtype)
    scalings = (torch.rand(NUM_SLOTS, ns, generator=gen) + 0.5).to(DEVICE)
    meta = batch.device_metadata()
    max_seg_len = max(batch.max_seg_len, 2)
    tiles = None
    if tile_map:
        num_tiles = max_tiles(batch.num_tokens, batch.num_segments, TILE_ROWS)
        tiles = torch.tensor(host_tile_map(batch.seg_indptr, TILE_ROWS, num_tiles), dtype=torch.int32, device=DEVICE)
    xa = lora_shrink(x, a, *meta, ns, batch.num_segments, max_seg_len, tile_map=tiles,
                     config=dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=4, num_stages=1))
    out = torch.full((batch.num_tokens, out_dim), float("nan"), dtype=dtype, device=DEVICE)

    y = lora_gemm(x, w, b_vec, xa, b, *meta, scalings, _offsets(widths), batch.num_segments, max_seg_len, out=out,
                  config=cfg, tile_map=tiles)

    assert y is out
    expected = _reference(x, w, b_vec, _per_token_xa(x, a, batch, ns).to(dtype), b, scalings, batch,
                          _offsets(widths))
    _assert_close(y, expected, dtype)


def test_base_only_segments_get_the_base_product_alone():
    """Every segment base only: y is x @ w^T exactly as a float32 GEMM gives it (xa is never read: NaN there)."""
    gen = torch.Generator().manual_seed(5)
    batch = _make_batch(SCENARIOS["prefill-identical"], gen)
    batch.slots = [-1] * len(batch.slots)
    widths = SLICE_WIDTHS["qkv"]
    x = _randn(batch.num_tokens, IN_DIM, gen=gen)
    w = _randn(sum(widths), IN_DIM, gen=gen)
    xa = torch.full((batch.num_tokens, len(widths) * batch.max_rank), float("nan"), device=DEVICE)
    b = _randn(NUM_SLOTS, sum(widths), batch.max_rank, gen=gen)
    scalings = torch.ones(NUM_SLOTS, len(widths), device=DEVICE)
    y = lora_gemm(x, w, None, xa, b, *batch.device_metadata(), scalings, _offsets(widths), batch.num_segments,
                  batch.max_seg_len, config=CONFIGS["16x32x32"])
    _assert_close(y, x @ w.T, torch.float32)
