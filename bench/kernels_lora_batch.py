"""GPU micro-benchmark of the LoRA kernels of large decode batches: one segment per row, or rows grouped by adapter.

At Llama-3.1-8B's LoRA projection shapes (qkv, o, gate_up, down), rank-16 slots, `--rows` decode rows spread
evenly over `--adapters` adapters (0 = every row its own adapter), rows sorted by slot as the scheduler
orders them, times per shape:
- `gemm`: the base projection alone (kernels/ops.linear under the engine's kernel choices);
- `per_row`: lora_shrink then lora_expand into y with one segment per row (max_seg_len 1: the GEMV-style
  programs, each row reading its adapter's A and B on its own);
- `grouped`: the same with one segment per adapter, padded to a fixed segment count as a decode graph pads
  it (min(rows, adapters + 2)), max_seg_len = rows (the row-tile programs of kernels/row_tiles.py: each tile
  reads its adapter's A and B once for all its rows), under the kernels' own configs;
- `engine`: the grouped rows as a decode graph runs them (layers/linear.py with a tile map): 16-row tiles from
  the host's tile map, the kernels' grouped_config (split-K shrink);
- `grouped_best` (with `--sweep`): the best of the candidate configs, expand first, then shrink;
- `mapped` (with `--sweep`): grouped rows whose 16-row tiles come from the host's tile map (tiles.host_tile_map),
  no search per program, the shrink split over 1-8 ranges of K: the best of split x BLOCK_K x expand BLOCK_N,
  with its shrink and expand also timed alone.
Each timing is one CUDA graph of `--iters` calls cycling over enough copies of W and of the slot pool that
no call finds its bytes in L2. `lora_floor_us`: the adapters' A and B bytes at the measured copy bandwidth.
The grouped and per-row deltas are compared (max abs difference relative to the largest value).

    python3 -m bench.kernels_lora_batch --out lora_batch.json --rows 32 64 128 256 512 --adapters 1 8 64 0 [--sweep]
"""
from __future__ import annotations

import itertools
import json
import logging

import torch

from bench.decode_step import copy_bandwidth
from bench.kernels_gemv import projection_parser
from bench.kernels_lora import graph_time_us
from bench.kernels_lora_decode import LAYERS, RANK, SHAPES
from worker.config import KernelConfig
from worker.kernels.lora_expand import grouped_config as expand_grouped_config
from worker.kernels.lora_expand import lora_expand
from worker.kernels.lora_shrink import grouped_config as shrink_grouped_config
from worker.kernels.lora_shrink import lora_shrink
from worker.kernels.row_tiles_host import host_tile_map, max_tiles
from worker.kernels.choices import KernelChoices
from worker.kernels.ops import linear as project

logger = logging.getLogger(__name__)

SHRINK_CANDIDATES = [dict(BLOCK_M=m, BLOCK_N=16, BLOCK_K=k, num_warps=w, num_stages=3)
                     for m, k, w in itertools.product((16, 32, 64), (128, 256, 512), (4,)) if m * k <= 16384]
EXPAND_CANDIDATES = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_R=16, BLOCK_R_HIGH=16, num_warps=w, num_stages=2)
                     for m, n, w in itertools.product((16, 32, 64), (64, 128, 256), (4, 8))]
VARIANTS = ("gemm", "per_row", "grouped", "engine", "grouped_best", "mapped")
MAP_BLOCK_M = 16                 # row tiles of the host's tile map
SPLITS = (1, 2, 4, 8)
MAP_SHRINK = [dict(BLOCK_M=MAP_BLOCK_M, BLOCK_N=16, BLOCK_K=k, num_warps=4, num_stages=3) for k in (128, 256)]
MAP_EXPAND = [dict(BLOCK_M=MAP_BLOCK_M, BLOCK_N=n, BLOCK_R=16, BLOCK_R_HIGH=16, num_warps=w, num_stages=2)
              for n, w in itertools.product((128, 256, 512, 1024), (4, 8))]


def segments(rows: int, adapters: int) -> tuple[list[int], list[int]]:
    """Rows spread evenly over `adapters` slots (0: one slot per row), sorted by slot -> (slot of each row,
    grouped seg_indptr). Rows [a, a, b, b, c] give seg_indptr [0, 2, 4, 5]."""
    n = rows if adapters == 0 else min(adapters, rows)
    row_slots = sorted(i % n for i in range(rows))
    indptr = [0] + [i + 1 for i in range(rows) if i + 1 == rows or row_slots[i + 1] != row_slots[i]]
    return row_slots, indptr


def run_case(name: str, rows: int, adapters: int, iters: int, sweep: bool, copy_gbps: float) -> dict:
    k, offsets = SHAPES[name]
    n, num_slices = offsets[-1], len(offsets) - 1
    row_slots, grouped_indptr = segments(rows, adapters)
    num_slots = len(grouped_indptr) - 1
    dev = torch.device("cuda")
    a_bytes, b_bytes = num_slices * RANK * k * 2, n * RANK * 2
    w_bytes, pool_bytes = n * k * 2, num_slots * (a_bytes + b_bytes)
    copies = max(2, -(-(256 << 20) // (w_bytes + pool_bytes)))
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
    pools = [(torch.randn(num_slots, num_slices * RANK, k, device=dev, dtype=torch.bfloat16) * k ** -0.5,
              torch.randn(num_slots, n, RANK, device=dev, dtype=torch.bfloat16) * 0.1) for _ in range(copies)]
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    ranks = torch.full((num_slots,), RANK, dtype=torch.int32, device=dev)
    scalings = torch.full((num_slots, num_slices), 2.0, device=dev)
    i32 = dict(device=dev, dtype=torch.int32)
    per_row = (torch.arange(rows + 1, **i32), torch.tensor(row_slots, **i32), rows, 1)
    num_segs = min(rows, num_slots + 2)          # a decode graph's fixed segment count (padding segments empty)
    pad = num_segs - num_slots
    grouped = (torch.tensor(grouped_indptr + [rows] * pad, **i32),
               torch.tensor(list(range(num_slots)) + [-1] * pad, **i32), num_segs, rows)
    kernels = KernelChoices.resolve(KernelConfig(), dev)
    y = torch.zeros(rows, n, device=dev, dtype=torch.bfloat16)

    num_tiles = max_tiles(rows, num_segs, MAP_BLOCK_M)
    tile_map = torch.tensor(host_tile_map(grouped_indptr + [rows] * pad, MAP_BLOCK_M, num_tiles), **i32)
    shrink_cfg, split_k = shrink_grouped_config(k, n)
    engine = (shrink_cfg, expand_grouped_config(RANK), split_k, tile_map)      # what a grouped decode graph runs

    last: dict[str, torch.Tensor] = {}     # the latest shrink's xa, for timing the expand alone

    def lora(i: int, out: torch.Tensor, segs: tuple, shrink: dict | None, expand: dict | None, split_k: int = 1,
             tiles: torch.Tensor | None = None, part: str = "both") -> None:
        a, b = pools[i]
        indptr, slots, num_segments, max_seg_len = segs
        if part != "expand" or "xa" not in last:
            last["xa"] = lora_shrink(x, a, indptr, slots, ranks, num_slices, num_segments, max_seg_len, config=shrink,
                                  split_k=split_k, tile_map=tiles)
        if part != "shrink":
            lora_expand(out, last["xa"], b, indptr, slots, ranks, scalings, offsets, num_segments, max_seg_len,
                        config=expand, tile_map=tiles)

    def time_of(fn) -> float:
        return graph_time_us([lambda i=i: fn(i) for i in range(copies)], iters)

    def entry(us: float) -> dict:
        return {"us": round(us, 2), "per_layer_step_ms": round(LAYERS * us / 1e3, 3)}

    floor_us = pool_bytes / copy_gbps / 1e3
    result = {"shape": name, "rows": rows, "adapters": num_slots, "lora_bytes": pool_bytes,
              "lora_floor_us": round(floor_us, 2),
              "gemm": entry(time_of(lambda i: project(x, weights[i], None, kernels))),
              "per_row": entry(time_of(lambda i: lora(i, y, per_row, None, None))),
              "grouped": entry(time_of(lambda i: lora(i, y, grouped, None, None))),
              "engine": entry(time_of(lambda i: lora(i, y, grouped, *engine)))}
    ref, got = torch.zeros_like(y), torch.zeros_like(y)
    lora(0, ref, per_row, None, None)
    lora(0, got, grouped, None, None)
    result["grouped_vs_per_row"] = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
    got.zero_()
    lora(0, got, grouped, *engine)
    result["engine_vs_per_row"] = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
    if sweep:
        expand_times = [(c, time_of(lambda i, c=c: lora(i, y, grouped, None, c))) for c in EXPAND_CANDIDATES]
        best_expand = min(expand_times, key=lambda t: t[1])[0]
        shrink_times = [(c, time_of(lambda i, c=c: lora(i, y, grouped, c, best_expand))) for c in SHRINK_CANDIDATES]
        best_shrink, best_us = min(shrink_times, key=lambda t: t[1])
        result["grouped_best"] = {**entry(best_us), "shrink": best_shrink, "expand": best_expand}
        mapped = []
        for split_k, shrink, expand in itertools.product(SPLITS, MAP_SHRINK, MAP_EXPAND):
            if k // split_k < shrink["BLOCK_K"]:
                continue
            us = time_of(lambda i, c=(shrink, expand, split_k): lora(i, y, grouped, c[0], c[1], c[2], tile_map))
            mapped.append((us, split_k, shrink, expand))
        us, split_k, shrink, expand = min(mapped, key=lambda t: t[0])
        last.clear()      # the expand alone reads the xa of the shrink timed just before it
        shrink_us = time_of(lambda i: lora(i, y, grouped, shrink, expand, split_k, tile_map, "shrink"))
        expand_us = time_of(lambda i: lora(i, y, grouped, shrink, expand, split_k, tile_map, "expand"))
        result["mapped"] = {**entry(us), "split_k": split_k, "shrink": shrink, "expand": expand,
                            "shrink_us": round(shrink_us, 2), "expand_us": round(expand_us, 2),
                            "by_split": {s_: round(min(t[0] for t in mapped if t[1] == s_), 2)
                                         for s_ in sorted({t[1] for t in mapped})}}
        got = torch.zeros_like(y)
        lora(0, got, grouped, shrink, expand, split_k, tile_map)
        result["mapped_vs_per_row"] = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
    weights.clear()
    pools.clear()
    torch.cuda.empty_cache()
    logger.info("%s rows=%d adapters=%d: floor %.1f us, %s", name, rows, num_slots, floor_us,
                {v: result[v]["us"] for v in VARIANTS if v in result})
    return result


def step_totals(results: list[dict]) -> dict:
    """Per (rows, adapters) with every shape timed: one decode step's projections (ms, 32 layers) and LoRA."""
    totals = {}
    for rows, adapters in sorted({(r["rows"], r["adapters"]) for r in results}):
        sel = [r for r in results if (r["rows"], r["adapters"]) == (rows, adapters)]
        if {r["shape"] for r in sel} != set(SHAPES):
            continue
        ms = {v: round(sum(r[v]["per_layer_step_ms"] for r in sel), 3)
              for v in VARIANTS if all(v in r for r in sel)}
        ms["lora_floor"] = round(sum(LAYERS * r["lora_floor_us"] for r in sel) / 1e3, 3)
        totals[f"{rows}x{adapters}"] = ms
    return totals


def main() -> None:
    parser = projection_parser(__doc__, rows_help="decode rows")
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 64, 0],
                        help="adapters the rows are spread over (0: every row its own)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels_lora_batch needs a CUDA device")
    copy_gbps = copy_bandwidth() / 1e9
    results = []
    for rows, adapters in itertools.product(args.rows, args.adapters):
        if adapters > rows:
            continue
        for name in SHAPES:
            results.append(run_case(name, rows, adapters, args.iters, args.sweep, copy_gbps))
            payload = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": round(copy_gbps, 1),
                       "results": results, "step_ms": step_totals(results)}
            with open(args.out, "w") as f:
                json.dump(payload, f, indent=1)
    for key, totals in payload["step_ms"].items():
        print(f"rows x adapters = {key}: per decode step (ms): {totals}")


if __name__ == "__main__":
    main()
