"""bench.kernels_gemv's candidate configs and its per-step totals (the timing itself needs a GPU)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench import kernels_gemv  # noqa: E402
from worker.kernels import gemv, reference  # noqa: E402


@pytest.mark.parametrize("rows", kernels_gemv.ROWS)
def test_every_candidate_config_is_valid_for_its_rows(rows):
    """Each candidate the sweep times computes the projection (tiny shape, interpreter on CPU)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(rows, 64, device=device)
    w = torch.randn(12, 64, device=device)
    configs = kernels_gemv.candidates(rows)
    assert len(set(configs)) == len(configs) == 24 - 8 * (rows == 4)
    for cfg in configs[:: max(1, len(configs) // 4)]:
        assert cfg[0] >= rows
        small = (cfg[0], cfg[1], min(cfg[2], 64), cfg[3])    # same BLOCK_M / BLOCK_N, K tile cut to the shape
        torch.testing.assert_close(gemv.gemv(x, w, config=small), reference.linear(x, w), atol=1e-5, rtol=1e-5)


def test_step_totals_weigh_each_shape_by_its_launches_per_step():
    results = [{"shape": name, "rows": rows, "cublas": {"us": 10.0 * (i + 1)}, "default": {"us": 1.0}}
               for rows in kernels_gemv.ROWS for i, name in enumerate(kernels_gemv.SHAPES)]
    totals = kernels_gemv.step_totals(results)
    per_layer = 32 * (10 + 20 + 30 + 40) + 1 * 50       # qkv, o, gate_up, down x 32 layers, LM head once
    assert totals[1] == {"cublas": per_layer / 1e3, "default": (32 * 4 + 1) / 1e3}
    assert "best" not in totals[2]                       # not swept: no best column
