"""bench.kernels_lora_decode's candidate configs, byte count and per-step totals (the timing needs a GPU)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench import kernels_lora_decode as bench  # noqa: E402
from worker.kernels import lora_expand as expand_module, lora_shrink as shrink_module, reference  # noqa: E402


def _reference_delta(x, a, b, meta, scalings, offsets):
    """float32 xa and delta of the case (reference.py)."""
    ns = len(offsets) - 1
    xa = reference.lora_shrink(x, a, meta["seg_indptr"], meta["seg_lora_slots"], meta["ranks"], ns)
    y = torch.zeros(x.shape[0], offsets[-1], device=x.device)
    reference.lora_expand(y, xa, b, meta["seg_indptr"], meta["seg_lora_slots"], meta["ranks"], scalings, offsets)
    return xa, y


def _decode_case(device: str, tokens: int = 3, in_dim: int = 48, offsets=(0, 20, 28), rank: int = 4):
    """Decode batch (one token per segment) on distinct slots of rank `rank`, one base-only row."""
    torch.manual_seed(0)
    ns, slots = len(offsets) - 1, tokens + 1
    x = torch.randn(tokens, in_dim, device=device)
    a = torch.randn(slots, ns * rank, in_dim, device=device)
    b = torch.randn(slots, offsets[-1], rank, device=device)
    weights = [2, -1, 0][:tokens]
    meta = dict(seg_indptr=list(range(tokens + 1)), seg_lora_slots=weights, ranks=[rank, 2, rank, rank][:slots])
    return x, a, b, meta, torch.rand(slots, ns, device=device) + 0.5, list(offsets)


def test_every_shrink_and_expand_candidate_computes_the_lora_delta():
    """Each block config the sweep can make a default gives the reference's xa and delta (tiny shapes;
    the interpreter on CPU), K and column tiles cut to the shape as on the GPU by masks."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, a, b, meta, scalings, offsets = _decode_case(device)
    dev = {k: torch.tensor(v, dtype=torch.int32, device=device) for k, v in meta.items()}
    ns, tokens = len(offsets) - 1, x.shape[0]
    want_xa, want_y = _reference_delta(x, a, b, meta, scalings, offsets)
    shrink_kinds = {(c["BLOCK_N"], c["num_warps"]): c for c in bench.SHRINK_CANDIDATES}
    expand_kinds = {c["num_warps"]: c for c in bench.EXPAND_CANDIDATES}
    assert len(shrink_kinds) == 8 and len(expand_kinds) == 2
    for shrink in shrink_kinds.values():
        xa = shrink_module.lora_shrink(x, a, dev["seg_indptr"], dev["seg_lora_slots"], dev["ranks"], ns, tokens, 1,
                                       config={**shrink, "BLOCK_K": 32})
        rows = [t for t, w in enumerate(meta["seg_lora_slots"]) if w >= 0]
        torch.testing.assert_close(xa[rows], want_xa[rows], atol=1e-4, rtol=1e-4)
    for expand in expand_kinds.values():
        y = torch.full((tokens, offsets[-1]), float("nan"), device=device)
        expand_module.lora_expand(y, want_xa, b, dev["seg_indptr"], dev["seg_lora_slots"], dev["ranks"], scalings,
                                  offsets, tokens, 1, accumulate=False, config={**expand, "BLOCK_N": 16})
        torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)


def test_candidates_are_distinct_and_keep_the_register_tile_bounded():
    for candidates in (bench.SHRINK_CANDIDATES, bench.EXPAND_CANDIDATES):
        keys = [tuple(sorted(c.items())) for c in candidates]
        assert len(set(keys)) == len(keys) >= 10
    assert all(c["BLOCK_N"] * c["BLOCK_K"] <= 16384 for c in bench.SHRINK_CANDIDATES)
    assert all(c["BLOCK_M"] == 1 for c in bench.SHRINK_CANDIDATES + bench.EXPAND_CANDIDATES)   # decode rows


def test_passing_the_kernels_own_config_changes_nothing():
    """A config passed in replaces the kernel's own choice for that call only: passing default_config()'s
    gives the same bits as passing none, both the reference's delta, and the next call without one is as
    before."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x, a, b, meta, scalings, offsets = _decode_case(device)
    dev = {k: torch.tensor(v, dtype=torch.int32, device=device) for k, v in meta.items()}
    ns, tokens, rank = len(offsets) - 1, x.shape[0], a.shape[1] // (len(offsets) - 1)
    want_xa, want_y = _reference_delta(x, a, b, meta, scalings, offsets)
    results = []
    for shrink, expand in [(None, None), (shrink_module.default_config(1, x.shape[1]),
                                          expand_module.default_config(1, rank)), (None, None)]:
        xa = shrink_module.lora_shrink(x, a, dev["seg_indptr"], dev["seg_lora_slots"], dev["ranks"], ns, tokens, 1,
                                       config=shrink)
        y = torch.zeros(tokens, offsets[-1], device=device)
        expand_module.lora_expand(y, xa, b, dev["seg_indptr"], dev["seg_lora_slots"], dev["ranks"], scalings,
                                  offsets, tokens, 1, config=expand)
        results.append((xa, y))
    rows = [t for t, w in enumerate(meta["seg_lora_slots"]) if w >= 0]
    for xa, y in results:
        assert torch.equal(xa, results[0][0]) and torch.equal(y, results[0][1])
        torch.testing.assert_close(xa[rows], want_xa[rows], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(y, want_y, atol=1e-4, rtol=1e-4)


def test_lora_bytes_count_each_rows_a_and_b_rows_at_its_rank():
    # qkv at 32 rows: A is 3 slices x 16 rank rows x 4096, B is 6144 x 16, bf16
    assert bench.lora_bytes(32, 4096, 6144, 3) == 32 * (3 * 16 * 4096 + 6144 * 16) * 2
    # the four shapes of one layer: about 84 MB / 32 layers per adapter
    per_layer = sum(bench.lora_bytes(1, k, offsets[-1], len(offsets) - 1) for k, offsets in bench.SHAPES.values())
    assert per_layer * bench.LAYERS == 32 * (6 * 16 * 4096 + 16 * 14336 + 16 * (6144 + 4096 + 28672 + 4096)) * 2


def test_step_totals_weigh_each_shape_by_the_layers_and_give_the_adapters_margin():
    results = [{"shape": name, "rows": 32, "gemm": {"us": 10.0 * (i + 1)}, "lora": {"us": 2.0},
                "inline": {"us": 10.0 * (i + 1) + 4}, "beside": {"us": 10.0 * (i + 1) + 3}}
               for i, name in enumerate(bench.SHAPES)]
    results[0]["beside_best"] = {"us": 1.0}
    results.append({"shape": "qkv", "rows": 8, "gemm": {"us": 1.0}})
    totals = bench.step_totals(results)
    assert list(totals) == [32]                                     # 8 rows lack three shapes
    assert totals[32] == pytest.approx({"gemm": 3.2, "lora": 0.256, "inline": 3.712, "beside": 3.584,
                                        "inline_over_gemm": 0.512, "beside_over_gemm": 0.384})
    for i, r in enumerate(results[:4]):
        r["unjoined"] = {"us": 10.0 * (i + 1) + 1}
    assert bench.step_totals(results)[32]["unjoined_over_gemm"] == pytest.approx(0.128)
    for i, r in enumerate(results[:4]):
        r["compare"] = {"own": {"us": 5.0}, "pair": {"us": 4.0 + i}}
    assert bench.step_totals(results)[32]["compare_beside"] == pytest.approx({"own": 0.64, "pair": 32 * 22 / 1e3})


def test_the_checked_in_pairs_are_configs_the_kernels_take():
    """bench/configs/lora_decode_pairs.json (the --compare file of BENCHMARKS' run) names shrink and expand
    configs with exactly the keys the kernels' own default_config returns."""
    import json
    from pathlib import Path
    pairs = json.loads((Path(bench.__file__).parent / "configs" / "lora_decode_pairs.json").read_text())
    assert len(pairs) >= 2
    for pair in pairs.values():
        assert pair["shrink"] is None or pair["shrink"].keys() == shrink_module.default_config(1, 4096).keys()
        assert pair["expand"] is None or pair["expand"].keys() == expand_module.default_config(1, 16).keys()
