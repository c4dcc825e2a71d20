"""Where the host time of a step goes: Engine.step() under cProfile on the GPU path.

Decode steps replay CUDA graphs and cost the host little; so do steps with a prefill in them up to the
largest mixed-batch graph (`WorkerConfig.mixed_graph_max_tokens`), and larger ones run eagerly, one
Python-side launch per kernel. This runs `--decoding` requests (each on its own adapter) and, every
step, adds one new request with a `--prompt-len` prompt (its own adapter too, resident), so every step
is a mixed prefill + decode step. It reports the steps' wall times from mixed-batch graphs and the same
number of decode-only (graph) steps; then, on a second engine built with mixed_graph_max_tokens=0, the same
mixed steps eagerly and the functions that took the most host time in them (in a second set of such steps:
the profiler slows what it watches).

    python -m bench.host_profile --out host_profile.json
"""
from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.decode_step import build_engine
from bench.make_adapters import make_adapter
from worker.engine import Engine
from worker.ipc.messages import SamplingParams
from worker.arch import ArchConfig


def timed_steps(engine, steps: int, add_prefill: bool, prompt_len: int, adapters: list[str], tag: str) -> list[float]:
    walls = []
    for i in range(steps):
        if add_prefill:
            engine.add_request(f"{tag}{i}", [(7 * i + k) % 1000 + 5 for k in range(prompt_len)],
                               SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                               adapters[i % len(adapters)])
        t0 = time.perf_counter()
        engine.step()
        walls.append(1e3 * (time.perf_counter() - t0))
    return walls


def top(profile: cProfile.Profile, key: str, n: int) -> list[str]:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats(key).print_stats(n)
    return [line for line in out.getvalue().splitlines() if line.strip()][-n - 1:]


def start(engine: Engine, adapters: list[tuple[str, str]], args: argparse.Namespace) -> list[str]:
    """Register the adapters ((name, path) each), start `--decoding` requests, one per adapter, and warm up
    (adapters loaded, kernels compiled) with mixed steps; returns the adapters left for the prompts added
    each step."""
    for name, path in adapters:
        engine.add_adapter(name, path)
    params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
    for i in range(args.decoding):
        engine.add_request(f"d{i}", list(range(100, 100 + args.prompt_len)), params, adapters[i][0])
    extra = [name for name, _ in adapters[args.decoding:]]
    timed_steps(engine, 10, True, args.prompt_len, extra, "warm")
    for _ in range(5):
        engine.step()
    return extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench/configs/llama-3.1-8b")
    parser.add_argument("--decoding", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    arch = ArchConfig.from_dir(args.model)
    results: dict = {"device": torch.cuda.get_device_name(), "config": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [(f"a{i}", str(make_adapter(Path(tmp) / f"a{i}", arch, 16, seed=i, device="cuda")))
                    for i in range(args.decoding + 4)]
        engine = build_engine(args.model, 32, 16, eager=False)
        extra = start(engine, adapters, args)
        decode = timed_steps(engine, args.steps, False, args.prompt_len, extra, "x")
        mixed_graph = timed_steps(engine, args.steps, True, args.prompt_len, extra, "g")
        replays = dict(engine.runner.graph_runner.replays)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        engine = build_engine(args.model, 32, 16, eager=False, mixed_graph_max_tokens=0)   # mixed steps eager
        extra = start(engine, adapters, args)
        mixed = timed_steps(engine, args.steps, True, args.prompt_len, extra, "m")
        profile = cProfile.Profile()        # a second set of eager mixed steps: cProfile slows what it watches
        profile.enable()
        timed_steps(engine, args.steps, True, args.prompt_len, extra, "p")
        profile.disable()
        torch.cuda.synchronize()
        results.update(decode_step_ms_median=statistics.median(decode),
                       mixed_graph_step_ms_median=statistics.median(mixed_graph),
                       mixed_step_ms_median=statistics.median(mixed),
                       eager_over_graph=statistics.median(mixed) / statistics.median(mixed_graph),
                       mixed_graph_step_ms=[round(w, 2) for w in mixed_graph],
                       mixed_step_ms=[round(w, 2) for w in mixed],
                       graph_replays=replays, top_tottime=top(profile, "tottime", 40),
                       top_cumulative=top(profile, "cumulative", 60))
    text = json.dumps(results, indent=1)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
