"""GPU micro-benchmark of a decode projection with its LoRA, every row with its own adapter, as a step runs it.

At Llama-3.1-8B's LoRA projection shapes (qkv, o, gate_up, down) and `--rows` decode rows, each on its own
rank-16 adapter (slots of rank 16), times per shape:
- `gemm`: the base projection alone through kernels/ops.linear under KernelConfig's row limits: the GEMV
  up to gemv_row_limit rows, then cuBLAS; with `--skinny` kernels/skinny_gemm.py up to skinny_row_limit, as
  the engine routes them by default;
- `lora`: lora_shrink then lora_expand into y, without the GEMM (the adapter bytes' own bandwidth);
- `inline`: the GEMM, then the shrink and the expand into y (the eager path);
- `beside`: the shrink and the expand into a float32 delta on a second, high-priority stream, forked before
  the GEMM and joined after it (the decode-graph path of layers/linear.py; the next kernel's add of the delta
  is not counted);
- `unjoined`: as `beside`, but the compute stream never waits for the side stream (one join after all the
  calls): not a correct step (the next kernel needs the delta), the bound on what the joins cost.
Each timing is one CUDA graph of `--iters` calls cycling over enough copies of W and of the slot pool
(>= 256 MB in all) that no call finds its bytes in L2, as in a decode step. With `--sweep`, `inline` and
`beside` are also timed over the kernels' block configs, coordinate-wise: every expand candidate under the
default shrink, then every shrink candidate under the best expand. With `--compare FILE` (JSON: {name:
{"shrink": config or null, "expand": config or null}}), `beside` is timed under the kernels' own configs and
under each named pair, interleaved over `--repeat` rounds, and the medians kept: the check of a sweep's pick
against noise. Bandwidth = bytes that must be read / time.

    python3 -m bench.kernels_lora_decode --out lora_decode.json [--sweep] [--rows 32] [--skinny]
    python3 -m bench.kernels_lora_decode --out cmp.json --compare pairs.json --repeat 5 --rows 8 16 32
"""
from __future__ import annotations

import functools
import itertools
import json
import logging
import statistics

import torch

from bench.kernels_gemv import projection_parser, time_projections
from bench.kernels_lora import graph_time_us
from worker.config import KernelConfig
from worker.kernels.lora_expand import lora_expand
from worker.kernels.lora_shrink import lora_shrink
from worker.kernels.choices import KernelChoices
from worker.kernels.ops import linear as project

logger = logging.getLogger(__name__)

SHAPES = {"qkv": (4096, (0, 4096, 5120, 6144)), "o": (4096, (0, 4096)), "gate_up": (4096, (0, 14336, 28672)),
          "down": (14336, (0, 4096))}
LAYERS = 32                      # launches of each shape per Llama-3.1-8B decode step
RANK = 16
SWEPT = ("inline", "beside")     # modes --sweep times over the block configs
MODES = (*SWEPT, "unjoined")

SHRINK_CANDIDATES = [dict(BLOCK_M=1, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=3)
                     for n, k, w in itertools.product((2, 4, 8, 16), (512, 1024, 2048, 4096), (4, 8))
                     if n * k <= 16384]
EXPAND_CANDIDATES = [dict(BLOCK_M=1, BLOCK_N=n, BLOCK_R=16, BLOCK_R_HIGH=16, num_warps=w, num_stages=2)
                     for n, w in itertools.product((64, 128, 256, 512, 1024), (4, 8))]


def lora_bytes(rows: int, k: int, n: int, num_slices: int, rank: int = RANK) -> int:
    """Adapter bytes a decode step of `rows` rows on distinct adapters must read for one projection (bf16)."""
    return rows * (num_slices * rank * k + n * rank) * 2


def run_shape(name: str, rows: int, iters: int, sweep: bool, copy_gbps: float, skinny: bool = False,
              compare: dict | None = None, repeat: int = 3) -> dict:
    k, offsets = SHAPES[name]
    n, num_slices = offsets[-1], len(offsets) - 1
    num_slots = max(rows, 1)
    w_bytes, a_bytes = n * k * 2, lora_bytes(rows, k, n, num_slices)
    pool_bytes = lora_bytes(num_slots, k, n, num_slices)
    copies = max(2, -(-(256 << 20) // (w_bytes + pool_bytes)))
    dev = torch.device("cuda")
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
    pools = [(torch.randn(num_slots, num_slices * RANK, k, device=dev, dtype=torch.bfloat16) * k ** -0.5,
              torch.randn(num_slots, n, RANK, device=dev, dtype=torch.bfloat16) * 0.1) for _ in range(copies)]
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    slots = torch.randperm(num_slots, device=dev)[:rows].to(torch.int32)
    ranks = torch.full((num_slots,), RANK, dtype=torch.int32, device=dev)
    scalings = torch.full((num_slots, num_slices), 2.0, device=dev)
    seg_indptr = torch.arange(rows + 1, device=dev, dtype=torch.int32)
    side = torch.cuda.Stream(priority=-1)
    kernels = KernelChoices.resolve(KernelConfig() if skinny else KernelConfig(skinny_row_limit=0), dev)

    def gemm(i: int, beside_lora: bool = False) -> torch.Tensor:
        return project(x, weights[i], None, kernels, beside_lora)

    def lora_inline(i: int, y: torch.Tensor, shrink: dict | None, expand: dict | None) -> None:
        a, b = pools[i]
        xa = lora_shrink(x, a, seg_indptr, slots, ranks, num_slices, rows, 1, config=shrink)
        lora_expand(y, xa, b, seg_indptr, slots, ranks, scalings, offsets, rows, 1, config=expand)

    def join() -> None:
        torch.cuda.current_stream().wait_stream(side)

    def beside(i: int, shrink: dict | None, expand: dict | None, joined: bool = True) -> None:
        a, b = pools[i]
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            xa = lora_shrink(x, a, seg_indptr, slots, ranks, num_slices, rows, 1, config=shrink)
            delta = torch.empty(rows, n, dtype=torch.float32, device=dev)
            lora_expand(delta, xa, b, seg_indptr, slots, ranks, scalings, offsets, rows, 1, accumulate=False,
                        config=expand)
        gemm(i, beside_lora=True)               # as layers/linear.py launches it (a GEMV then launches late)
        if joined:
            join()

    y_lora = torch.zeros(rows, n, device=dev, dtype=torch.bfloat16)
    calls = {"gemm": lambda i, *_: gemm(i), "lora": lambda i, *cfg: lora_inline(i, y_lora, *cfg),
             "inline": lambda i, *cfg: lora_inline(i, gemm(i), *cfg), "beside": beside,
             "unjoined": lambda i, *cfg: beside(i, *cfg, joined=False)}

    def time_of(variant: str, shrink: dict | None = None, expand: dict | None = None) -> float:
        """One call of `variant` under the shrink and expand configs (None: the kernels' own)."""
        return graph_time_us([lambda i=i: calls[variant](i, shrink, expand) for i in range(copies)], iters,
                             finish=join if variant == "unjoined" else None)

    def entry(us: float, num_bytes: int) -> dict:
        gbps = num_bytes / us / 1e3
        return {"us": round(us, 2), "GBps": round(gbps, 1), "of_copy": round(gbps / copy_gbps, 3)}

    result = {"shape": name, "rows": rows, "n": n, "k": k, "weight_bytes": w_bytes, "lora_bytes": a_bytes,
              "gemm": entry(time_of("gemm"), w_bytes), "lora": entry(time_of("lora"), a_bytes)}
    if compare:
        pairs = {"own": {"shrink": None, "expand": None}, **compare}
        times: dict[str, list[float]] = {name: [] for name in pairs}
        for _ in range(repeat):
            for pair_name, pair in pairs.items():
                times[pair_name].append(time_of("beside", pair["shrink"], pair["expand"]))
        result["compare"] = {pair_name: entry(statistics.median(us), w_bytes + a_bytes)
                             for pair_name, us in times.items()}
    for mode in MODES:
        result[mode] = entry(time_of(mode), w_bytes + a_bytes)
        if not sweep or mode not in SWEPT:
            continue
        expand_times = [(cfg, time_of(mode, None, cfg)) for cfg in EXPAND_CANDIDATES]
        best_expand = min(expand_times, key=lambda t: t[1])[0]
        shrink_times = [(cfg, time_of(mode, cfg, best_expand)) for cfg in SHRINK_CANDIDATES]
        best_shrink, best_us = min(shrink_times, key=lambda t: t[1])
        result[f"{mode}_best"] = {**entry(best_us, w_bytes + a_bytes), "shrink": best_shrink, "expand": best_expand}
        result[f"{mode}_sweep"] = {"expand": [[c, round(us, 2)] for c, us in expand_times],
                                   "shrink": [[c, round(us, 2)] for c, us in shrink_times]}
    weights.clear()
    pools.clear()
    torch.cuda.empty_cache()
    logger.info("%s rows=%d: %s", name, rows, {v: result[v]["us"] for v in
                                                ("gemm", "lora", *MODES, *(f"{m}_best" for m in SWEPT)) if v in result})
    return result


def step_totals(results: list[dict]) -> dict:
    """Per row count with every shape timed: the LoRA projections of one decode step under each variant (ms),
    and what the adapters add over the GEMMs alone, in line and beside them."""
    totals = {}
    for rows in sorted({r["rows"] for r in results}):
        sel = [r for r in results if r["rows"] == rows]
        if {r["shape"] for r in sel} != set(SHAPES):
            continue
        variants = ("gemm", "lora", *MODES, *(f"{m}_best" for m in SWEPT))
        ms = {v: round(sum(LAYERS * r[v]["us"] for r in sel) / 1e3, 3) for v in variants if all(v in r for r in sel)}
        ms.update({f"{v}_over_gemm": round(ms[v] - ms["gemm"], 3) for v in variants[2:] if v in ms})
        if all("compare" in r for r in sel):
            ms["compare_beside"] = {name: round(sum(LAYERS * r["compare"][name]["us"] for r in sel) / 1e3, 3)
                                    for name in sel[0]["compare"]}
        totals[rows] = ms
    return totals


def main() -> None:
    parser = projection_parser(__doc__, rows_help="decode rows, each on its own adapter")
    parser.add_argument("--skinny", action="store_true",
                        help="3-32 rows on kernels/skinny_gemm.py (the engine's default), not cuBLAS")
    parser.add_argument("--compare", help="JSON file of named (shrink, expand) config pairs to time `beside` under")
    parser.add_argument("--repeat", type=int, default=3, help="interleaved rounds of --compare (medians kept)")
    args = parser.parse_args()
    compare = None
    if args.compare:
        with open(args.compare) as f:
            compare = json.load(f)
    time_projections("kernels_lora_decode", args, args.rows,
                     functools.partial(run_shape, skinny=args.skinny, compare=compare, repeat=args.repeat),
                     step_totals, shapes=SHAPES, extra={"gemm": "skinny" if args.skinny else "cublas"},
                     what="LoRA projections")


if __name__ == "__main__":
    main()
