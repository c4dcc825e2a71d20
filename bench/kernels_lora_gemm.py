"""GPU micro-benchmark of the fused-GEMM LoRA path (kernels/lora_gemm.py) against today's projection with LoRA.

At Llama-3.1-8B's projection shapes (qkv, o, gate_up, down), rank-16 slots, `--rows` rows cut into `--adapters`
segments of one adapter each (a prefill's sequences, or a decode graph's rows grouped by adapter), times per shape:
- `base`: the projection alone (kernels/ops.linear under the engine's kernel choices: cuBLAS at these sizes);
- `unfused`: the base projection, then lora_shrink and lora_expand into y, in line (the Triton backend's eager
  path; its graphs run the shrink beside the GEMM, which this does not time);
- `fused`: lora_shrink, then lora_gemm (the fused-GEMM backend), at the kernel's default config;
- `fused_base_only`: lora_gemm with every segment base only: its GEMM alone, against `base`;
- `fused_best` (with `--sweep`): the best of CANDIDATES for lora_gemm, with its config.
Each timing is one CUDA graph of `--iters` calls cycling over enough copies of W and of the slot pool that no call
finds its bytes in L2. Bounds beside them: `bytes_floor_us`, W, x and y once plus the slots' A and B at the measured
copy bandwidth; `tflops` of the base product in each timing. `fused_vs_unfused`: max |difference| relative to the
largest value of y.

    python3 -m bench.kernels_lora_gemm --out lora_gemm.json --rows 16 64 256 1024 4096 --adapters 1 8 64 [--sweep]
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
from worker.kernels.choices import KernelChoices
from worker.kernels.lora_expand import lora_expand
from worker.kernels.lora_gemm import lora_gemm
from worker.kernels.lora_shrink import lora_shrink
from worker.kernels.ops import linear as project

logger = logging.getLogger(__name__)

CANDIDATES = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, BLOCK_R=16, num_warps=w, num_stages=s)
              for m, n, k, w, s in itertools.product((16, 64, 128), (64, 128, 256), (32, 64), (4, 8), (3, 4))
              if m * n <= 128 * 128 or w == 8]
VARIANTS = ("base", "unfused", "fused", "fused_base_only", "fused_best")


def segments(rows: int, adapters: int) -> list[int]:
    """seg_indptr of `rows` rows cut into min(adapters, rows) segments of near-equal length, in order:
    10 rows over 3 adapters -> [0, 4, 7, 10]."""
    n = min(adapters, rows)
    return [sum(rows // n + (j < rows % n) for j in range(i)) for i in range(n + 1)]


def run_case(name: str, rows: int, adapters: int, iters: int, sweep: bool, copy_gbps: float) -> dict:
    k, offsets = SHAPES[name]
    n, num_slices = offsets[-1], len(offsets) - 1
    indptr = segments(rows, adapters)
    num_slots = len(indptr) - 1
    dev = torch.device("cuda")
    w_bytes, pool_bytes = n * k * 2, num_slots * (num_slices * RANK * k + n * RANK) * 2
    copies = max(2, -(-(256 << 20) // (w_bytes + pool_bytes)))
    weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k ** -0.5 for _ in range(copies)]
    pools = [(torch.randn(num_slots, num_slices * RANK, k, device=dev, dtype=torch.bfloat16) * k ** -0.5,
              torch.randn(num_slots, n, RANK, device=dev, dtype=torch.bfloat16) * 0.1) for _ in range(copies)]
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    i32 = dict(device=dev, dtype=torch.int32)
    seg_indptr, slots = torch.tensor(indptr, **i32), torch.arange(num_slots, **i32)
    no_adapter = torch.full((num_slots,), -1, **i32)
    ranks = torch.full((num_slots,), RANK, **i32)
    scalings = torch.full((num_slots, num_slices), 2.0, device=dev)
    max_seg_len = max(b - a for a, b in zip(indptr, indptr[1:]))
    kernels = KernelChoices.resolve(KernelConfig(), dev)
    y = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)

    def unfused(i: int, out: torch.Tensor | None = None) -> torch.Tensor:
        a, b = pools[i]
        out = project(x, weights[i], None, kernels) if out is None else out.copy_(project(x, weights[i], None, kernels))
        xa = lora_shrink(x, a, seg_indptr, slots, ranks, num_slices, num_slots, max_seg_len)
        lora_expand(out, xa, b, seg_indptr, slots, ranks, scalings, offsets, num_slots, max_seg_len)
        return out

    def fused(i: int, config: dict | None = None, lora_slots: torch.Tensor = slots) -> torch.Tensor:
        a, b = pools[i]
        xa = lora_shrink(x, a, seg_indptr, lora_slots, ranks, num_slices, num_slots, max_seg_len)
        return lora_gemm(x, weights[i], None, xa, b, seg_indptr, lora_slots, ranks, scalings, offsets, num_slots,
                         max_seg_len, out=y, config=config)

    def time_of(fn) -> float:
        return graph_time_us([lambda i=i: fn(i) for i in range(copies)], iters)

    flops = 2 * rows * k * n

    def entry(us: float) -> dict:
        return {"us": round(us, 2), "tflops": round(flops / us / 1e6, 1),
                "per_layer_step_ms": round(LAYERS * us / 1e3, 3)}

    bytes_floor_us = (w_bytes + rows * (k + n) * 2 + pool_bytes) / copy_gbps / 1e3
    result = {"shape": name, "rows": rows, "adapters": num_slots, "bytes_floor_us": round(bytes_floor_us, 2),
              "base": entry(time_of(lambda i: project(x, weights[i], None, kernels))),
              "unfused": entry(time_of(lambda i: unfused(i, y))),
              "fused": entry(time_of(lambda i: fused(i))),
              "fused_base_only": entry(time_of(lambda i: lora_gemm(
                  x, weights[i], None, x.new_zeros(rows, num_slices * RANK), pools[i][1], seg_indptr, no_adapter,
                  ranks, scalings, offsets, num_slots, max_seg_len, out=y)))}
    want = unfused(0).float()
    result["fused_vs_unfused"] = float((fused(0).float() - want).abs().max() / want.abs().max())
    if sweep:
        timed = []
        for config in CANDIDATES:
            try:
                timed.append((time_of(lambda i, c=config: fused(i, c)), config))
            except Exception as e:      # a tile past the shared memory of the device: skipped, and said
                logger.info("%s rows=%d: config %s failed: %s", name, rows, config, type(e).__name__)
        us, config = min(timed, key=lambda t: t[0])
        result["fused_best"] = {**entry(us), "config": config}
    weights.clear()
    pools.clear()
    torch.cuda.empty_cache()
    logger.info("%s rows=%d adapters=%d: floor %.1f us, %s", name, rows, num_slots, bytes_floor_us,
                {v: result[v]["us"] for v in VARIANTS if v in result})
    return result


def main() -> None:
    parser = projection_parser(__doc__, rows_help="rows of the step")
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 8, 64],
                        help="segments (one adapter each) the rows are cut into")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels_lora_gemm needs a CUDA device")
    copy_gbps = copy_bandwidth() / 1e9
    results = []
    for rows, adapters in itertools.product(args.rows, args.adapters):
        for name in SHAPES:
            results.append(run_case(name, rows, adapters, args.iters, args.sweep, copy_gbps))
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": round(copy_gbps, 1),
                           "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
