"""GPU micro-benchmark of the small-batch projection kernel (worker/kernels/gemv.py) against cuBLAS.

At Llama-3.1-8B's projection shapes and 1, 2 and 4 rows of x (the engine uses it
up to KernelConfig.gemv_row_limit rows), times F.linear (cuBLAS, as the engine ran
before) and the Triton kernel under its default config and under each candidate config. Each timing is
one CUDA graph of `--iters` calls that cycle over enough copies of the weight (>= 256 MB in all) that no
call finds its W in L2, as in a decode step where 16 GB of other weights pass between two uses of one.
Bandwidth = bytes of W / time, also given as a share of the device's measured copy bandwidth.

    python3 -m bench.kernels_gemv --out gemv.json            # cuBLAS vs the default config
    python3 -m bench.kernels_gemv --sweep --out gemv.json    # and every candidate config
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import logging

import torch
import torch.nn.functional as F
import triton

from bench.decode_step import copy_bandwidth
from bench.kernels_lora import graph_time_us
from worker.kernels import gemv

logger = logging.getLogger(__name__)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}   # launches per Llama-3.1-8B step
ROWS = (1, 2, 4)


def candidates(rows: int) -> list[tuple[int, int, int, int]]:
    block_m = triton.next_power_of_2(rows)
    ks = {1: (256, 512, 1024), 2: (128, 256, 512), 4: (128, 256)}[block_m]
    return [(block_m, n, k, w) for n, k, w in itertools.product((2, 4, 8, 16), ks, (4, 8))]


@contextlib.contextmanager
def projection_timer(n: int, k: int, rows: int, iters: int, copy_gbps: float):
    """(x, time_of, entry): x [rows, k] bf16; time_of(call) times call(w) in one CUDA graph of `iters` calls
    cycling over copies of a bf16 W [n, k] (>= 256 MB in all, so none is in L2); entry(us) gives the time
    with W's bandwidth. The copies are freed on exit."""
    w_bytes = n * k * 2
    copies = max(2, -(-(256 << 20) // w_bytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)

    def time_of(call) -> float:
        return graph_time_us([lambda w=w: call(w) for w in weights], iters)

    def entry(us: float) -> dict:
        gbps = w_bytes / us / 1e3
        return {"us": round(us, 2), "GBps": round(gbps, 1), "of_copy": round(gbps / copy_gbps, 3)}

    try:
        yield x, time_of, entry
    finally:
        weights.clear()
        torch.cuda.empty_cache()


def run_shape(name: str, rows: int, iters: int, sweep: bool, copy_gbps: float) -> dict:
    n, k = SHAPES[name]
    default = gemv.default_config(rows, n, k)
    with projection_timer(n, k, rows, iters, copy_gbps) as (x, time_of, entry):
        result = {"shape": name, "rows": rows, "n": n, "k": k, "weight_bytes": n * k * 2,
                  "cublas": entry(time_of(lambda w: F.linear(x, w))),
                  "default_config": list(default), "default": entry(time_of(lambda w: gemv.gemv(x, w)))}
        if sweep:
            timings = [(cfg, time_of(lambda w, cfg=cfg: gemv.gemv(x, w, config=cfg))) for cfg in candidates(rows)]
            best_cfg, best_us = min(timings, key=lambda t: t[1])
            result["best_config"], result["best"] = list(best_cfg), entry(best_us)
            result["sweep"] = [[list(cfg), round(us, 2)] for cfg, us in timings]
    logger.info("%s rows=%d: cublas %s, default %s %s, best %s %s", name, rows, result["cublas"],
                default, result["default"], result.get("best_config"), result.get("best"))
    return result


def step_totals(results: list[dict]) -> dict:
    """Per row count: the projections' time in one Llama-3.1-8B decode step under each variant."""
    totals = {}
    for rows in ROWS:
        sel = [r for r in results if r["rows"] == rows]
        totals[rows] = {variant: round(sum(PER_STEP[r["shape"]] * r[variant]["us"] for r in sel) / 1e3, 3)
                        for variant in ("cublas", "default", "best") if all(variant in r for r in sel)}
    return totals


def projection_parser(doc: str, rows_help: str | None = None) -> argparse.ArgumentParser:
    """The projection benches' common options: --out, --iters, --sweep, and --rows where rows_help is given."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    if rows_help:
        parser.add_argument("--rows", type=int, nargs="+", default=[32], help=rows_help)
    parser.add_argument("--iters", type=int, default=32, help="calls per timed CUDA graph")
    parser.add_argument("--sweep", action="store_true", help="also time every candidate config")
    return parser


def time_projections(bench: str, args: argparse.Namespace, row_counts, run_shape, step_totals, shapes=SHAPES,
                     extra: dict | None = None, what: str = "projections") -> None:
    """Time every shape at each row count (run_shape(name, rows, iters, sweep, copy GB/s) -> result), writing
    {device, copy bandwidth, **extra, results, step_totals(results)} to args.out after each shape (a cut-off
    run keeps what it has); print the per-step totals of `what` at the end."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit(f"bench.{bench} needs a CUDA device")
    copy_gbps = copy_bandwidth() / 1e9
    results = []
    for rows in row_counts:
        for name in shapes:
            results.append(run_shape(name, rows, args.iters, args.sweep, copy_gbps))
            payload = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": round(copy_gbps, 1),
                       **(extra or {}), "results": results, "step_ms": step_totals(results)}
            with open(args.out, "w") as f:
                json.dump(payload, f, indent=1)
    for rows, totals in payload["step_ms"].items():
        print(f"rows={rows}: {what} per decode step (ms): {totals}")


def main() -> None:
    args = projection_parser(__doc__).parse_args()
    time_projections("kernels_gemv", args, ROWS, run_shape,
                     lambda results: step_totals(results) if len(results) == len(ROWS) * len(SHAPES) else None)


if __name__ == "__main__":
    main()
