"""bench.kernels_lora_gemm's segments and candidate configs (the timing needs a GPU)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench import kernels_lora_gemm as bench  # noqa: E402
from worker.kernels import reference  # noqa: E402
from worker.kernels.lora_gemm import lora_gemm  # noqa: E402


@pytest.mark.parametrize("rows,adapters,indptr", [(10, 3, [0, 4, 7, 10]), (5, 8, [0, 1, 2, 3, 4, 5]),
                                                  (16, 1, [0, 16]), (64, 64, list(range(65)))])
def test_segments_cut_the_rows_into_near_equal_runs(rows, adapters, indptr):
    assert bench.segments(rows, adapters) == indptr


@pytest.mark.parametrize("config", bench.CANDIDATES[::11], ids=lambda c: "{BLOCK_M}x{BLOCK_N}x{BLOCK_K}".format(**c))
def test_candidate_configs_compute_the_reference(config):
    """A sample of the sweep's configs on a tiny shape (the interpreter on the CPU): x @ w^T plus each segment's
    delta, as reference.py's shrink and expand give it in float32."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    rows, k, offsets, rank, slots = 40, 48, [0, 40, 72], 16, 3
    indptr = bench.segments(rows, slots)
    x = torch.randn(rows, k, generator=gen).to(device)
    w = torch.randn(offsets[-1], k, generator=gen).to(device)
    a = torch.randn(slots, 2 * rank, k, generator=gen).to(device)
    b = torch.randn(slots, offsets[-1], rank, generator=gen).to(device)
    scalings = (torch.rand(slots, 2, generator=gen) + 0.5).to(device)
    seg_slots, ranks = [2, -1, 0], [rank, 4, rank]
    xa = reference.lora_shrink(x.cpu(), a.cpu(), indptr, seg_slots, ranks, 2)
    want = x.cpu() @ w.cpu().T
    reference.lora_expand(want, xa, b.cpu(), indptr, seg_slots, ranks, scalings.cpu(), offsets)
    i32 = dict(dtype=torch.int32, device=device)
    longest = max(hi - lo for lo, hi in zip(indptr, indptr[1:]))
    got = lora_gemm(x, w, None, xa.to(device), b, torch.tensor(indptr, **i32), torch.tensor(seg_slots, **i32),
                    torch.tensor(ranks, **i32), scalings, offsets, len(seg_slots), longest, config=config)
    # float32 on both sides, sums of k + rank products in another order: far below 1e-4 of the largest value
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
