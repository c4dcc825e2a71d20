"""GPU micro-benchmark of the skinny projection kernel (worker/kernels/skinny_gemm.py) against cuBLAS.

At Llama-3.1-8B's projection shapes and `--rows` rows of x (the engine sends it 3-32), times F.linear
(cuBLAS, as the engine ran before), the small-batch GEMV (kernels/gemv.py) where it takes the rows, and the
kernel under its default config (with `--sweep`, under every candidate config). Each timing is one CUDA graph
of `--iters` calls cycling over enough copies of the weight (>= 256 MB in all) that no call finds its W in L2,
as in a decode step. Bandwidth = bytes of W / time, also as a share of the measured copy bandwidth.

    python3 -m bench.kernels_skinny --out skinny.json [--sweep] [--rows 32 8]
"""
from __future__ import annotations

import functools
import itertools
import logging

import torch
import torch.nn.functional as F

from bench.kernels_gemv import PER_STEP, SHAPES, projection_parser, projection_timer, time_projections
from worker.kernels import gemv, skinny_gemm as sg

logger = logging.getLogger(__name__)

VARIANTS = ("cublas", "gemv", "default", "best", "occupancy_best")


def candidates(n: int, k: int, rows: int = 32) -> list[sg.Config]:
    """Column tiles of 64 or 128, K steps of 128 or 256, as many stages (up to 5) as fit sg.SMEM_BYTES, K parts
    giving 96-640 programs (1 when the column tiles alone are that many)."""
    out = []
    block_m = max(16, 1 << (rows - 1).bit_length())
    for block_n, block_k in itertools.product((64, 128), (128, 256)):
        stages = min(5, sg.SMEM_BYTES // ((block_n + block_m) * block_k * 2))
        tiles = -(-n // block_n)
        splits = [s for s in (1, 2, 4, 8) if 96 <= tiles * s <= 640 and k // s >= 2 * block_k] or [1]
        out += [sg.Config(block_n, block_k, s, 4, stages) for s in splits]
    return out


SM_SHARED_BYTES = 227 << 10   # shared memory an H100 SM gives the programs resident on it


def occupancy_candidates(n: int, k: int, rows: int = 32) -> list[tuple[int, sg.Config]]:
    """(programs per SM that the config's shared memory allows, config): column tiles of 32 or 64, K steps of
    64-256, 4 or 8 warps, and the most stages (2-8) that let 1, 2 or 3 programs share an SM; K cut in two below
    96 tiles, as default_config() does. (candidates() gives every program the most stages: one per SM.)"""
    out: dict[sg.Config, int] = {}
    block_m = max(16, 1 << (rows - 1).bit_length())
    for block_n, block_k, target, warps in itertools.product((32, 64), (64, 128, 256), (1, 2, 3), (4, 8)):
        stage_bytes = (block_n + block_m) * block_k * 2
        stages = min(8, min(sg.SMEM_BYTES, SM_SHARED_BYTES // target - (4 << 10)) // stage_bytes)
        split = 2 if -(-n // block_n) < 96 and k >= 4 * block_k else 1
        if stages >= 2:
            out[sg.Config(block_n, block_k, split, warps, stages)] = (SM_SHARED_BYTES
                                                                      // (stages * stage_bytes + (4 << 10)))
    return [(per_sm, cfg) for cfg, per_sm in out.items()]


def run_shape(name: str, rows: int, iters: int, sweep: bool, copy_gbps: float, occupancy: bool = False) -> dict:
    n, k = SHAPES[name]
    default = sg.default_config(rows, n, k)
    with projection_timer(n, k, rows, iters, copy_gbps) as (x, time_of, entry):
        counters = sg.new_counters(x.device)

        def skinny(w: torch.Tensor, cfg: sg.Config | None = None) -> torch.Tensor:
            return sg.skinny_gemm(x, w, None, counters, cfg)

        result = {"shape": name, "rows": rows, "n": n, "k": k, "weight_bytes": n * k * 2,
                  "default_config": vars(default), "cublas": entry(time_of(lambda w: F.linear(x, w))),
                  "default": entry(time_of(skinny))}
        if rows <= gemv.MAX_ROWS:
            result["gemv"] = entry(time_of(lambda w: gemv.gemv(x, w)))
        if sweep:
            timings = [(cfg, time_of(lambda w, cfg=cfg: skinny(w, cfg))) for cfg in candidates(n, k, rows)]
            best_cfg, best_us = min(timings, key=lambda t: t[1])
            result["best_config"], result["best"] = vars(best_cfg), entry(best_us)
            result["sweep"] = [[vars(cfg), round(us, 2)] for cfg, us in timings]
        if occupancy:
            timings = [(per_sm, cfg, time_of(lambda w, cfg=cfg: skinny(w, cfg)))
                       for per_sm, cfg in occupancy_candidates(n, k, rows)]
            per_sm, best_cfg, best_us = min(timings, key=lambda t: t[2])
            result["occupancy_best_config"] = {**vars(best_cfg), "per_sm": per_sm}
            result["occupancy_best"] = entry(best_us)
            result["occupancy_sweep"] = [[{**vars(cfg), "per_sm": p}, round(us, 2)] for p, cfg, us in timings]
    logger.info("%s rows=%d: %s", name, rows, {v: result[v] for v in VARIANTS if v in result})
    return result


def step_totals(results: list[dict]) -> dict:
    """Per row count with every shape timed: one Llama-3.1-8B decode step's projections under each variant (ms)."""
    totals = {}
    for rows in sorted({r["rows"] for r in results}):
        sel = [r for r in results if r["rows"] == rows]
        if {r["shape"] for r in sel} != set(SHAPES):
            continue
        totals[rows] = {v: round(sum(PER_STEP[r["shape"]] * r[v]["us"] for r in sel) / 1e3, 3)
                        for v in VARIANTS if all(v in r for r in sel)}
    return totals


def main() -> None:
    parser = projection_parser(__doc__, rows_help="rows of x (decode batch sizes)")
    parser.add_argument("--occupancy", action="store_true",
                        help="also time configs that fit 1-3 programs per SM (occupancy_candidates)")
    args = parser.parse_args()
    time_projections("kernels_skinny", args, args.rows, functools.partial(run_shape, occupancy=args.occupancy),
                     step_totals)


if __name__ == "__main__":
    main()
