"""GPU micro-benchmark of the MoE block at one or two tokens (worker/kernels/moe_gemv.py) against its memory floor.

At Qwen3-30B-A3B's shape (E=128, top-8, H=2048, I=768) and Mixtral's (E=8, top-2, H=4096, I=14336), bf16, times
route + the two fused GEMVs (and, with `lora`, the two shrinks and the expands inside the GEMVs: one rank-16
adapter on gate, up and down of every expert) as one CUDA graph of `--iters` calls cycling over several layers'
weights, each with its own routing, so no call finds its experts in L2. The floor is the bytes of the experts
the call's tokens are routed to (and their LoRA A and B) at the copy bandwidth measured in the same run.

    python3 -m bench.kernels_moe_gemv --out moe_gemv.json            # the default configs
    python3 -m bench.kernels_moe_gemv --sweep --out moe_gemv.json    # and every candidate config
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging

import torch

from bench.decode_step import copy_bandwidth
from bench.kernels_lora import graph_time_us
from worker.lora.weights import MoELoRAWeights
from worker.kernels import fused_moe as moe
from worker.kernels.moe_gemv import small_batch_moe
from worker.kernels.moe_lora import MoELoRAStep, MoELoRAWorkspace

logger = logging.getLogger(__name__)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral": (8, 2, 4096, 14336)}   # E, K, H, I
RANK = 16
GATE_UP = [(n, k, w) for n, k, w in itertools.product((1, 2, 4), (512, 1024, 2048), (4, 8))]
DOWN = [(n, k, w) for n, k, w in itertools.product((1, 2, 4), (64, 128, 256, 512), (4, 8))]


def lora_weights(e: int, h: int, i: int, dtype) -> MoELoRAWeights:
    def rand(*shape):
        return (torch.randn(*shape, device="cuda") * shape[-1] ** -0.5).to(dtype)
    return MoELoRAWeights(rand(1, e, 2 * RANK, h), rand(1, e, 2 * i, RANK), rand(1, e, RANK, i), rand(1, e, h, RANK),
                          torch.full((1, 3), 0.5, device="cuda"), torch.zeros(1, dtype=torch.int32, device="cuda"))


def run_shape(name: str, tokens: int, bandwidth: float, sweep: bool, iters: int) -> list[dict]:
    e, k, h, i = SHAPES[name]
    dtype = torch.bfloat16
    layer_bytes = 3 * e * h * i * 2
    layers = max(2, min(8, -(-3 * 2 ** 30 // layer_bytes)))
    gate_up = [torch.randn(e, 2 * i, h, device="cuda", dtype=dtype) * h ** -0.5 for _ in range(layers)]
    down = [torch.randn(e, h, i, device="cuda", dtype=dtype) * i ** -0.5 for _ in range(layers)]
    logits = [torch.randn(tokens, e, device="cuda", dtype=dtype) for _ in range(layers)]
    x = torch.randn(tokens, h, device="cuda", dtype=dtype)
    ws = moe.MoEWorkspace(tokens, e, k, h, i, dtype, torch.device("cuda"))
    weights = lora_weights(e, h, i, dtype)
    step = MoELoRAStep(weights, torch.zeros(tokens, dtype=torch.int32, device="cuda"),
                       torch.full((1,), RANK, dtype=torch.int32, device="cuda"), RANK,
                       MoELoRAWorkspace(tokens, e, k, RANK, 1, torch.device("cuda")))
    out = torch.empty_like(x)
    experts = sum(len(set(logits[layer].float().topk(k, dim=1).indices.flatten().tolist()))
                  for layer in range(layers)) / layers
    floor_bytes = {False: experts * 3 * h * i * 2, True: experts * (3 * h * i + RANK * (3 * h + 3 * i)) * 2}
    rows = []
    configs = [None] + ([(g, None) for g in GATE_UP]
                        + [(None, d) for d in DOWN] if sweep else [])
    for with_lora in (False, True):
        for config in configs if not with_lora else [None]:      # the sweep without LoRA; LoRA at the defaults
            chosen = {} if config is None else {key: c for key, c in zip(("gate_up", "down"), config) if c}

            def call(layer, lora=step if with_lora else None, chosen=chosen):
                moe.route(logits[layer], k, True, ws)
                small_batch_moe(x, gate_up[layer], down[layer], ws.topk_weights[:tokens], ws.topk_ids[:tokens],
                                False, ws.act, out, lora, configs=chosen)
            try:
                us = graph_time_us([lambda layer=layer: call(layer) for layer in range(layers)], iters)
            except Exception as exc:        # a config that does not compile (registers, shared memory)
                logger.warning("%s %s: %s", name, chosen, exc)
                continue
            floor_us = 1e6 * floor_bytes[with_lora] / bandwidth
            rows.append({"shape": name, "tokens": tokens, "lora": with_lora, "config": chosen or "default",
                         "us": us, "floor_us": floor_us, "over_floor": us / floor_us})
            logger.info("%s T=%d lora=%s %s: %.1f us (%.2f x floor %.1f)", name, tokens, with_lora, chosen or "default",
                        us, us / floor_us, floor_us)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--sweep", action="store_true",
                        help="every candidate config of each kernel, one at a time (without LoRA)")
    parser.add_argument("--iters", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bandwidth = copy_bandwidth()
    results = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9, "runs": []}
    for name in args.shapes:
        for tokens in args.tokens:
            results["runs"] += run_shape(name, tokens, bandwidth, args.sweep, args.iters)
            torch.cuda.empty_cache()
    best = {}
    for row in results["runs"]:
        key = f'{row["shape"]} T={row["tokens"]} lora={row["lora"]}'
        if row["config"] == "default":
            best.setdefault(key, {})["default_us"] = row["us"]
        if row["us"] < best.setdefault(key, {}).get("best_us", float("inf")):
            best[key].update(best_us=row["us"], best_config=row["config"], best_over_floor=row["over_floor"])
    results["summary"] = best
    print(json.dumps(best, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
