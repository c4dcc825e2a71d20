"""Decode-step time of a mixture-of-experts model with expert LoRA, against the batch-1 memory floor.

    python -m bench.moe_decode --model bench/configs/qwen3-30b-a3b --out moe.json
    python -m bench.moe_decode --model bench/configs/qwen3-30b-a3b --num-layers 24 --out moe.json   # 80 GB cards

Random bf16 weights (`--load-format dummy`); adapters of rank 16 on q, k, v, o and every expert's gate, up
and down (PEFT target_parameters layout, bench/make_adapters.py). Runs: batch 1 without and with an adapter,
batch 32 without and with 8 distinct adapters, each with CUDA graphs and eagerly. Step times are the wall time
of Engine.step() and, with graphs, the decode graph's replay alone (bench/decode_step.py's timing). Every
request has its own prompt, so a batch's tokens route to different experts as real traffic does (with one
prompt for all, a batch of 32 reads the 8 experts of one token).

The batch-1 floor is the bytes that step must read at the copy bandwidth measured in the same run: the
attention and norm weights of every layer, the router, the top-k experts the token is routed to, the LM
head and one embedding row (with an adapter: its attention LoRA and its top-k experts' LoRA too).
`--num-layers` drops layers from the config (the 48-layer model's 61 GB of weights leave little room on an
80 GB card); the ratios do not depend on the layer count much, the absolute times do.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import tempfile
from pathlib import Path

import torch

from bench.decode_step import copy_bandwidth, kernel_profile, time_decode
from bench.make_adapters import make_adapter
from worker.config import CacheConfig, KernelConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.arch import ArchConfig

logger = logging.getLogger(__name__)
RANK = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "experts")
RUNS = {"b1_base": (1, [None]), "b1_lora16": (1, ["a0"]), "b32_base": (32, [None]),
        "b32_8lora16": (32, [f"a{i}" for i in range(8)])}
RATIOS = {   # name: (numerator run, field, denominator run, field)
    "b1_base_step_over_floor": ("graphs_b1_base", "step_ms_median", "graphs_b1_base", "floor_ms"),
    "b1_base_replay_over_floor": ("graphs_b1_base", "replay_ms", "graphs_b1_base", "floor_ms"),
    "b1_lora16_over_b1_base": ("graphs_b1_lora16", "step_ms_median", "graphs_b1_base", "step_ms_median"),
    "b32_8lora16_over_b32_base": ("graphs_b32_8lora16", "step_ms_median", "graphs_b32_base", "step_ms_median"),
    "b1_eager_over_graphs": ("eager_b1_base", "step_ms_median", "graphs_b1_base", "step_ms_median"),
    "b32_eager_over_graphs": ("eager_b32_base", "step_ms_median", "graphs_b32_base", "step_ms_median"),
    "b32_8lora16_eager_over_graphs": ("eager_b32_8lora16", "step_ms_median", "graphs_b32_8lora16", "step_ms_median"),
}


def batch1_floor_bytes(arch: ArchConfig, lora_rank: int = 0) -> int:
    """Bytes a batch-1 decode step must read (bf16), with an adapter of `lora_rank` (0: none)."""
    h, i, k, e = arch.hidden_size, arch.moe_intermediate_size, arch.num_experts_per_tok, arch.num_experts
    attention = h * (arch.q_size + 2 * arch.kv_size) + arch.q_size * h + 2 * h
    experts = k * 3 * h * i + e * h                                 # chosen experts and the router
    per_layer = attention + experts
    if lora_rank:
        per_layer += lora_rank * (2 * h + arch.q_size + 2 * arch.kv_size + arch.q_size + h)   # q, k, v, o
        per_layer += k * lora_rank * (2 * h + 2 * i + 2 * i + 2 * h)                         # gate, up, down
    return 2 * (arch.num_layers * per_layer + arch.vocab_size * h + h)


def model_dir(source: str, num_layers: int | None, tmp: Path) -> str:
    """`source`, or a copy of its config with `num_layers` layers."""
    if num_layers is None:
        return source
    config = json.loads((Path(source) / "config.json").read_text())
    config["num_hidden_layers"] = num_layers
    (tmp / "model").mkdir()
    (tmp / "model" / "config.json").write_text(json.dumps(config))
    return str(tmp / "model")


def build_engine(model: str, eager: bool, lora_side_stream: bool = True, quantization: str | None = None) -> Engine:
    return Engine(WorkerConfig(
        ModelConfig(model, dtype="bfloat16", load_format="dummy", max_model_len=2048, quantization=quantization),
        cache=CacheConfig(kv_cache_memory_bytes=4 << 30),
        lora=LoRAConfig(max_loras=8, max_lora_rank=RANK),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=2048),
        kernels=KernelConfig(lora_side_stream=lora_side_stream),
        device="cuda", enforce_eager=eager))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench/configs/qwen3-30b-a3b")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--modes", nargs="+", choices=["graphs", "eager"], default=["graphs", "eager"])
    parser.add_argument("--lora-in-line", action="store_true",
                        help="attention LoRA in line with its GEMVs instead of on a second stream (KernelConfig)")
    parser.add_argument("--profile", action="store_true", help="per-kernel device time of every run's graph steps")
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="quantize the weights to FP8 at load (bench/configs/qwen3-30b-a3b-fp8 needs none)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    bandwidth = copy_bandwidth()
    results: dict = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9,
                     "num_layers": args.num_layers, "lora_in_line": args.lora_in_line, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir(args.model, args.num_layers, Path(tmp))
        arch = ArchConfig.from_dir(model)
        adapters = [str(make_adapter(Path(tmp) / f"a{i}", arch, RANK, TARGETS, seed=i, device="cuda"))
                    for i in range(8)]
        for mode in args.modes:
            engine = build_engine(model, eager=mode == "eager", lora_side_stream=not args.lora_in_line,
                                  quantization=args.quantization)
            for i, path in enumerate(adapters):
                engine.add_adapter(f"a{i}", path)
            for name, (batch, names) in RUNS.items():
                result = time_decode(engine, batch, names, args.steps, distinct=True)
                if batch == 1:
                    result["floor_ms"] = 1e3 * batch1_floor_bytes(arch, RANK if names[0] else 0) / bandwidth
                results["runs"][f"{mode}_{name}"] = result
                logger.info("%s %s: %s", mode, name, result)
            if args.profile and mode == "graphs":
                for name in RUNS:
                    profile = kernel_profile(engine, *RUNS[name], distinct=True)
                    results.setdefault("profile", {})[name] = profile
                    logger.info("profile %s: %s", name, json.dumps(profile["kernels"][:12]))
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    runs = results["runs"]
    results["ratios"] = {name: runs[a][fa] / runs[b][fb] for name, (a, fa, b, fb) in RATIOS.items()
                         if a in runs and b in runs and fa in runs[a] and fb in runs[b]}
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
