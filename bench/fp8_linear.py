"""GPU micro-benchmark of FP8 projections (kernels/ops.fp8_linear) against bf16 ones (kernels/ops.linear).

At Llama-3.1-8B's projection shapes and 1 to 4096 rows, with per-row and 128 x 128 block scales, times the bf16
projection as the engine runs it, ops.fp8_linear under the default KernelConfig, and every FP8 path that can take
the row count: the weight-only GEMV (kernels/fp8_gemv.py, up to 4 rows) and skinny GEMM (kernels/fp8_skinny.py, up
to 64), and W8A8 (activation quantization plus the Triton GEMM of kernels/fp8_gemm.py, or torch._scaled_mm for
per-row scales). Each timing is one CUDA graph of `--iters` calls cycling over enough copies of the weight (>= 256 MB)
that no call finds its W in L2. The byte floor of a weight is its bytes over the device's measured copy bandwidth;
the paths' times choose KernelConfig.fp8_gemv_row_limit and fp8_skinny_row_limit.

    python3 -m bench.fp8_linear --out fp8_linear.json
"""
from __future__ import annotations

import argparse
import json
import logging

import torch

from bench.decode_step import copy_bandwidth
from bench.kernels_lora import graph_time_us
from worker.config import KernelConfig
from worker.kernels import fp8_gemm, fp8_gemv, fp8_skinny, ops
from worker.kernels.choices import KernelChoices
from worker.kernels.fp8_quant import quantize_fp8

logger = logging.getLogger(__name__)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 2, 8, 32, 128, 256, 1024, 4096)
SCALES = {"row": None, "block": (128, 128)}


def fp8_weights(n: int, k: int, block, copies: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`copies` random FP8 weights [n, k] with float32 scales of the layout `block` asks for."""
    scale_shape = (n,) if block is None else (-(-n // block[0]), -(-k // block[1]))
    return [((torch.randn(n, k, device="cuda") * 8).clamp(-448, 448).to(torch.float8_e4m3fn),
             torch.rand(scale_shape, device="cuda") * 1e-3 + 1e-3) for _ in range(copies)]


def w8a8(x, w, s, block, gemm):
    xq, x_scale = quantize_fp8(x, block[1] if block else None)
    if gemm == "scaled_mm":
        return fp8_gemm.scaled_mm_rowwise(xq, x_scale, w, s, None, x.dtype)
    return fp8_gemm.w8a8_gemm(xq, x_scale, w, s, block, None, x.dtype)


def paths(rows: int, block) -> dict:
    """name -> call(x, w, s) for every FP8 path that takes `rows` rows."""
    out = {}
    if rows <= fp8_gemv.MAX_ROWS:
        out["gemv"] = lambda x, w, s: fp8_gemv.fp8_gemv(x, w, s, block)
    if rows <= fp8_skinny.MAX_ROWS:
        out["skinny"] = lambda x, w, s: fp8_skinny.fp8_skinny_gemm(x, w, s, block)
    out["w8a8_triton"] = lambda x, w, s: w8a8(x, w, s, block, "triton")
    if block is None:
        out["w8a8_scaled_mm"] = lambda x, w, s: w8a8(x, w, s, block, "scaled_mm")
    return out


def run_shape(name: str, scales: str, rows_list, iters: int, copy_gbps: float, kernels: KernelChoices) -> list[dict]:
    n, k = SHAPES[name]
    block = SCALES[scales]
    bf16_bytes, fp8_bytes = n * k * 2, n * k
    bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k ** -0.5
            for _ in range(max(2, -(-(256 << 20) // bf16_bytes)))]
    fp8 = fp8_weights(n, k, block, max(2, -(-(256 << 20) // fp8_bytes)))
    results = []
    for rows in rows_list:
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        calls = iters if rows < 1024 else max(4, iters // 4)
        time_bf16 = graph_time_us([lambda w=w: ops.linear(x, w, None, kernels) for w in bf16], calls)
        time_fp8 = graph_time_us([lambda w=w, s=s: ops.fp8_linear(x, w, s, None, block, None, kernels)
                                  for w, s in fp8], calls)
        each = {path: round(graph_time_us([lambda w=w, s=s, f=f: f(x, w, s) for w, s in fp8], calls), 2)
                for path, f in paths(rows, block).items()}
        entry = {"shape": name, "scales": scales, "rows": rows, "n": n, "k": k, "bf16_us": round(time_bf16, 2),
                 "fp8_us": round(time_fp8, 2), "fp8_over_bf16": round(time_fp8 / time_bf16, 3), "paths": each,
                 "bf16_floor_us": round(bf16_bytes / copy_gbps / 1e3, 2),
                 "fp8_floor_us": round(fp8_bytes / copy_gbps / 1e3, 2)}
        logger.info("%s %s rows=%d: bf16 %.1f us, fp8 %.1f us (floor %.1f) %s", name, scales, rows, time_bf16,
                    time_fp8, entry["fp8_floor_us"], each)
        results.append(entry)
    del bf16, fp8
    torch.cuda.empty_cache()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--iters", type=int, default=32, help="calls per timed CUDA graph (a quarter at >= 1024 rows)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench.fp8_linear needs a CUDA device")
    copy_gbps = copy_bandwidth() / 1e9
    kernels = KernelChoices.resolve(KernelConfig(), torch.device("cuda"))
    results = []
    for scales in SCALES:
        for name in SHAPES:
            results += run_shape(name, scales, args.rows, args.iters, copy_gbps, kernels)
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": round(copy_gbps, 1),
                           "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
