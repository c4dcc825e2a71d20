"""GPU micro-benchmark of the decode projection with LoRA in one launch (worker/kernels/lora_gemm.py).

At Llama-3.1-8B's projection shapes and a decode batch of `--rows` rows, each with its own rank-16 adapter
(32 slots of rank 16), times per shape:
- `cublas`: F.linear alone (the base projection as the engine runs it from 3 rows); `gemv`: kernels/gemv.py
  (from 1 to 2 rows, as the engine runs them);
- `base`: lora_gemm without adapters, default config (and with `--sweep`, every candidate config);
- `unfused_inline`: cuBLAS, then lora_shrink and lora_expand in line (the eager path);
- `unfused_side`: lora_shrink + lora_expand into a float32 delta on a second stream beside cuBLAS, joined
  after (the decode-graph path before this kernel, less the next kernel's add of the delta);
- `fused`: lora_gemm with the adapters, default config (with `--sweep`: the best base configs again);
- `fused_no_rows`: the same launch with every row's slot -1 (shrink tickets and the wait, no adapter bytes).
Each timing is one CUDA graph of `--iters` calls cycling over enough copies of W and of the slot pool
(>= 256 MB in all) that no call finds its bytes in L2. Bandwidth = bytes that must be read / time.

    python3 -m bench.kernels_lora_gemm --out lora_gemm.json [--sweep] [--rows 32]
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging

import torch
import torch.nn.functional as F

from bench.decode_step import copy_bandwidth
from bench.kernels_lora import graph_time_us
from worker.kernels import gemv, lora_gemm as lg
from worker.kernels.lora_expand import lora_expand
from worker.kernels.lora_shrink import lora_shrink

logger = logging.getLogger(__name__)

SHAPES = {"qkv": (4096, (0, 4096, 5120, 6144)), "o": (4096, (0, 4096)), "gate_up": (4096, (0, 14336, 28672)),
          "down": (14336, (0, 4096)), "lm_head": (4096, (0, 128256))}
PER_STEP = {"qkv": 32, "o": 32, "gate_up": 32, "down": 32, "lm_head": 1}   # launches per Llama-3.1-8B step
NUM_SLOTS, RANK = 32, 16


SMEM_BUDGET = 200 << 10     # bytes of shared memory the pipeline stages may take (an H100 SM has 227 KB)


def candidates(n: int, k: int, rows: int = 32) -> list[lg.Config]:
    """Column tiles of 64 or 128, K steps of 128 or 256, as many stages (up to 5) as fit SMEM_BUDGET, K parts
    giving 96-640 programs (1 when the column tiles alone are that many)."""
    out = []
    block_m = max(16, 1 << (rows - 1).bit_length())
    for block_n, block_k in itertools.product((64, 128), (128, 256)):
        stages = min(5, SMEM_BUDGET // ((block_n + block_m) * block_k * 2))
        tiles = -(-n // block_n)
        splits = [s for s in (1, 2, 4, 8) if 96 <= tiles * s <= 640 and k // s >= 2 * block_k] or [1]
        out += [lg.Config(block_n, block_k, s, 4, stages) for s in splits]
    return out


def run_shape(name: str, rows: int, iters: int, sweep: bool, copy_gbps: float) -> dict:
    k, offsets = SHAPES[name]
    n, num_slices = offsets[-1], len(offsets) - 1
    with_lora = name != "lm_head"
    w_bytes = n * k * 2
    lora_bytes = rows * (num_slices * RANK * k + n * RANK) * 2 if with_lora else 0   # each row's own A and B
    pool_bytes = NUM_SLOTS * (num_slices * RANK * k + n * RANK) * 2 if with_lora else 0
    copies = max(2, -(-(256 << 20) // (w_bytes + pool_bytes)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(NUM_SLOTS, device="cuda")[:rows].to(torch.int32) if rows <= NUM_SLOTS else \
        torch.arange(rows, device="cuda", dtype=torch.int32) % NUM_SLOTS
    ranks = torch.full((NUM_SLOTS,), RANK, dtype=torch.int32, device="cuda")
    scalings = torch.full((NUM_SLOTS, num_slices), 2.0, device="cuda")
    pools = [(torch.randn(NUM_SLOTS, num_slices * RANK, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5,
              torch.randn(NUM_SLOTS, n, RANK, device="cuda", dtype=torch.bfloat16) * 0.1)
             for _ in range(copies if with_lora else 0)]
    seg_indptr = torch.arange(rows + 1, device="cuda", dtype=torch.int32)
    side = torch.cuda.Stream()

    def time_of(call) -> float:
        return graph_time_us([lambda i=i: call(i) for i in range(copies)], iters)

    def entry(us: float, extra: int = 0) -> dict:
        gbps = (w_bytes + extra) / us / 1e3
        return {"us": round(us, 2), "GBps": round(gbps, 1), "of_copy": round(gbps / copy_gbps, 3)}

    def row_lora(i: int) -> lg.RowLoRA:
        return lg.RowLoRA(pools[i][0], pools[i][1], slots, ranks, scalings, offsets)

    def unfused(i: int, on_side: bool) -> None:
        a, b = pools[i]
        if not on_side:
            y = F.linear(x, weights[i])
            xa = lora_shrink(x, a, seg_indptr, slots, ranks, num_slices, rows, 1)
            lora_expand(y, xa, b, seg_indptr, slots, ranks, scalings, offsets, rows, 1)
            return
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            xa = lora_shrink(x, a, seg_indptr, slots, ranks, num_slices, rows, 1)
            delta = torch.empty(rows, n, dtype=torch.float32, device="cuda")
            lora_expand(delta, xa, b, seg_indptr, slots, ranks, scalings, offsets, rows, 1, accumulate=False)
        F.linear(x, weights[i])
        torch.cuda.current_stream().wait_stream(side)

    default = lg.default_config(rows, n, k)
    result = {"shape": name, "rows": rows, "n": n, "k": k, "weight_bytes": w_bytes, "lora_bytes": lora_bytes,
              "default_config": vars(default),
              "cublas": entry(time_of(lambda i: F.linear(x, weights[i]))),
              "base": entry(time_of(lambda i: lg.lora_gemm(x, weights[i]))),
              "base_sweep": [], "fused_sweep": []}
    if rows <= gemv.MAX_ROWS:
        result["gemv"] = entry(time_of(lambda i: gemv.gemv(x, weights[i])))
    if sweep:
        for cfg in candidates(n, k, rows):
            us = time_of(lambda i, cfg=cfg: lg.lora_gemm(x, weights[i], cfg=cfg))
            result["base_sweep"].append([vars(cfg), round(us, 2)])
        best = min(result["base_sweep"], key=lambda t: t[1])
        result["best_base_config"], result["best_base"] = best[0], entry(best[1])
    if with_lora:
        result["unfused_inline"] = entry(time_of(lambda i: unfused(i, False)), lora_bytes)
        result["unfused_side"] = entry(time_of(lambda i: unfused(i, True)), lora_bytes)
        result["fused"] = entry(time_of(lambda i: lg.lora_gemm(x, weights[i], lora=row_lora(i))), lora_bytes)
        no_rows = torch.full_like(slots, -1)
        result["fused_no_rows"] = entry(time_of(lambda i: lg.lora_gemm(
            x, weights[i], lora=lg.RowLoRA(pools[i][0], pools[i][1], no_rows, ranks, scalings, offsets))))
        if sweep:
            for cfg_dict, _ in sorted(result["base_sweep"], key=lambda t: t[1])[:4]:
                cfg = lg.Config(**cfg_dict)
                us = time_of(lambda i, cfg=cfg: lg.lora_gemm(x, weights[i], lora=row_lora(i), cfg=cfg))
                result["fused_sweep"].append([cfg_dict, round(us, 2)])
            best = min(result["fused_sweep"], key=lambda t: t[1])
            result["best_fused_config"], result["best_fused"] = best[0], entry(best[1], lora_bytes)
    del weights, pools
    torch.cuda.empty_cache()
    logger.info("%s rows=%d: %s", name, rows, {key: result[key] for key in result
                                                if key in ("cublas", "gemv", "base", "best_base", "unfused_inline",
                                                           "unfused_side", "fused", "fused_no_rows", "best_fused")})
    return result


def step_totals(results: list[dict]) -> dict:
    """Per row count: one Llama-3.1-8B decode step's projections under each variant (ms); variants missing
    for the LM head (no LoRA there) take its cuBLAS time."""
    totals = {}
    for rows in sorted({r["rows"] for r in results}):
        sel = [r for r in results if r["rows"] == rows]
        if len(sel) != len(SHAPES):
            continue
        totals[rows] = {}
        for variant in ("cublas", "gemv", "base", "best_base", "unfused_inline", "unfused_side", "fused",
                        "fused_no_rows", "best_fused"):
            if all(variant in r or r["shape"] == "lm_head" for r in sel):
                totals[rows][variant] = round(sum(PER_STEP[r["shape"]] * r.get(variant, r["cublas"])["us"]
                                                  for r in sel) / 1e3, 3)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--rows", type=int, nargs="+", default=[32], help="decode batch sizes")
    parser.add_argument("--iters", type=int, default=32, help="calls per timed CUDA graph")
    parser.add_argument("--sweep", action="store_true", help="also time every candidate config")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels_lora_gemm needs a CUDA device")
    copy_gbps = copy_bandwidth() / 1e9
    results = []
    for rows in args.rows:
        for name in SHAPES:
            results.append(run_shape(name, rows, args.iters, args.sweep, copy_gbps))
            payload = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": round(copy_gbps, 1),
                       "results": results, "step_ms": step_totals(results)}
            with open(args.out, "w") as f:      # rewritten after each shape: a cut-off run keeps what it has
                json.dump(payload, f, indent=1)
    for rows, totals in payload["step_ms"].items():
        print(f"rows={rows}: projections per decode step (ms): {totals}")


if __name__ == "__main__":
    main()
