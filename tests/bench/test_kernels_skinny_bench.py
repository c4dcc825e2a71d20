"""bench.kernels_skinny's candidate configs and its per-step totals (the timing itself needs a GPU)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench import kernels_skinny as bench  # noqa: E402
from worker.kernels import reference, skinny_gemm as sg  # noqa: E402


@pytest.mark.parametrize("shape", bench.SHAPES)
@pytest.mark.parametrize("rows", [8, 32, 64])
def test_candidates_fit_shared_memory_and_cut_k_only_while_programs_are_few(shape, rows):
    n, k = bench.SHAPES[shape]
    configs = bench.candidates(n, k, rows)
    assert len(set(configs)) == len(configs) >= 4
    block_m = max(16, rows)
    for cfg in configs:
        assert 1 <= cfg.num_stages <= 5 and cfg.num_stages * (cfg.block_n + block_m) * cfg.block_k * 2 <= sg.SMEM_BYTES
        programs = -(-n // cfg.block_n) * cfg.split_k
        assert cfg.split_k == 1 or (96 <= programs <= 640 and k // cfg.split_k >= 2 * cfg.block_k)
    assert any(cfg.split_k > 1 for cfg in configs) == (shape != "lm_head")     # 1002+ column tiles: never cut


def test_a_candidate_of_every_kind_computes_the_projection():
    """One config per (column tile, K parts) kind the sweep times, on a tiny shape (interpreter on CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, w = torch.randn(5, 96, device=device), torch.randn(80, 96, device=device)
    kinds = {(c.block_n, c.split_k): c for c in bench.candidates(4096, 4096)}
    counters = sg.new_counters(x.device)
    for cfg in kinds.values():
        small = sg.Config(min(cfg.block_n, 32), 32, cfg.split_k, cfg.num_warps, cfg.num_stages)
        torch.testing.assert_close(sg.skinny_gemm(x, w, None, counters, small), reference.linear(x, w),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", bench.SHAPES)
def test_occupancy_candidates_fit_their_programs_per_sm(shape):
    n, k = bench.SHAPES[shape]
    found = bench.occupancy_candidates(n, k, 32)
    assert len({cfg for _, cfg in found}) == len(found) >= 20
    assert {per_sm for per_sm, _ in found} >= {1, 2, 3}
    for per_sm, cfg in found:
        smem = cfg.num_stages * (cfg.block_n + 32) * cfg.block_k * 2
        assert 2 <= cfg.num_stages <= 8 and smem <= sg.SMEM_BYTES
        assert per_sm * (smem + (4 << 10)) <= bench.SM_SHARED_BYTES < (per_sm + 1) * (smem + (4 << 10))


def test_step_totals_weigh_each_shape_by_its_launches_per_step():
    """Variants are totalled where every shape has them; row counts missing a shape get no total."""
    results = [{"shape": name, "rows": 32, "cublas": {"us": 10.0 * (i + 1)}, "default": {"us": 1.0}}
               for i, name in enumerate(bench.SHAPES)]
    results[0]["best"] = {"us": 0.5}
    results.append({"shape": "qkv", "rows": 16, "cublas": {"us": 1.0}})
    assert bench.step_totals(results) == {32: {"cublas": (32 * (10 + 20 + 30 + 40) + 50) / 1e3,
                                               "default": (32 * 4 + 1) / 1e3}}
