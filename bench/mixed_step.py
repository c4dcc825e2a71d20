"""A mixed step of a serving batch: decode rows beside new prompts, base model against adapters.

    python -m bench.mixed_step --model bench/configs/llama-3.1-8b --out mixed.json [--profile]

A serving run at 256 streams spends much of its time in mixed steps (the prompts of the requests that replace
finished ones, prefilled beside the running decode rows). Each run here keeps `--decode-rows` requests decoding
and adds `--prefills` new prompts of `--prompt-len` tokens (random tokens: no prefix-cache hit) before every
timed step, so every timed step is one mixed step of decode-rows + prefills x prompt-len tokens; the new requests
are aborted after it. Three runs: every request on the base model, every request on one rank-16 adapter, and
requests over 64 adapters (the engine has 64 slots). Scheduling is synchronous, so a step's wall time is its
host work plus its device time; --profile adds each kernel's device time per step. The engine captures mixed
graphs to the server's default limit; `--eager` times the same steps without graphs.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.decode_step import abort_all, build_engine, per_kernel_summary, start_requests
from bench.make_adapters import make_adapter
from worker.config import KernelConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams
from worker.arch import ArchConfig

logger = logging.getLogger(__name__)
RUNS = {"base": [None], "lora16": ["a0"], "64lora16": [f"a{i}" for i in range(64)]}   # adapters, cycled


_PROMPTS = itertools.count()    # every prompt of a bench run its own (no prefix-cache hit across steps or runs)


def add_prompts(engine: Engine, count: int, prompt_len: int, adapters: list[str | None], vocab: int) -> list[str]:
    """`count` new requests of random prompts, none used before in this process (none shares a block with
    another); their ids."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ids = []
    for i in range(count):
        n = next(_PROMPTS)
        rng = random.Random(n)
        ids.append(f"new{n}")
        engine.add_request(ids[-1], [rng.randrange(vocab) for _ in range(prompt_len)], params,
                           adapters[i % len(adapters)])
    return ids


def mixed_steps(engine: Engine, decode_rows: int, adapters: list[str | None], steps: int, prefills: int,
                prompt_len: int, vocab: int) -> list[float]:
    """Wall times of `steps` mixed steps (each checked to be one: every new prompt whole, every row decoding)."""
    running = start_requests(engine, decode_rows, adapters, "d")
    wall = []
    for step in range(steps):
        new = add_prompts(engine, prefills, prompt_len, adapters, vocab)
        t0 = time.perf_counter()
        outputs = engine.step()
        wall.append(time.perf_counter() - t0)
        first_tokens = {o.request_id for o in outputs} & set(new)
        assert len(first_tokens) == prefills, f"step {step} prefilled {len(first_tokens)} of {prefills} prompts"
        abort_all(engine, new)
    assert engine.num_running == decode_rows, "a decode request stopped before the timing ended"
    abort_all(engine, running)
    return wall


def kernel_profile(engine: Engine, decode_rows: int, adapters: list[str | None], prefills: int, prompt_len: int,
                   vocab: int, steps: int = 3) -> dict:
    """Device time per mixed step of each kernel (by name), largest first."""
    from torch.profiler import ProfilerActivity, profile
    running = start_requests(engine, decode_rows, adapters, "p")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            new = add_prompts(engine, prefills, prompt_len, adapters, vocab)
            engine.step()
            abort_all(engine, new)
        torch.cuda.synchronize()
    abort_all(engine, running)
    return per_kernel_summary(prof, steps, top=25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench/configs/llama-3.1-8b")
    parser.add_argument("--decode-rows", type=int, default=192)
    parser.add_argument("--prefills", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--eager", action="store_true", help="an engine without CUDA graphs")
    parser.add_argument("--tile-map-max-tokens", type=int, default=KernelConfig.lora_tile_map_max_tokens,
                        help="KernelConfig.lora_tile_map_max_tokens (mixed graphs above it search their LoRA tiles)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    arch = ArchConfig.from_dir(args.model)
    tokens = args.decode_rows + args.prefills * args.prompt_len
    results: dict = {"device": torch.cuda.get_device_name(), "decode_rows": args.decode_rows,
                     "tile_map_max_tokens": args.tile_map_max_tokens,
                     "prefill_tokens": args.prefills * args.prompt_len, "step_tokens": tokens, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [str(make_adapter(Path(tmp) / f"a{i}", arch, 16, seed=i, device="cuda")) for i in range(64)]
        engine = build_engine(args.model, 256, 64, eager=args.eager, async_scheduling=False, kv_bytes=20 << 30,
                              mixed_graph_max_tokens=WorkerConfig.mixed_graph_max_tokens,   # the server's default
                              kernels=KernelConfig(lora_tile_map_max_tokens=args.tile_map_max_tokens))
        for i, path in enumerate(adapters):
            engine.add_adapter(f"a{i}", path)
        for name in args.runs:
            mixed_steps(engine, args.decode_rows, RUNS[name], 3, args.prefills, args.prompt_len,
                        arch.vocab_size)                                 # first captures' and adapters' costs
            graph_runner = engine.runner.graph_runner
            replays = graph_runner.replays["mixed"] if graph_runner else 0
            wall = mixed_steps(engine, args.decode_rows, RUNS[name], args.steps, args.prefills, args.prompt_len,
                               arch.vocab_size)
            result = {"step_ms_median": 1e3 * statistics.median(wall), "step_ms_min": 1e3 * min(wall),
                      "timed_steps_from_graphs": (graph_runner.replays["mixed"] - replays) if graph_runner else 0}
            if args.profile:
                result["profile"] = kernel_profile(engine, args.decode_rows, RUNS[name], args.prefills,
                                                   args.prompt_len, arch.vocab_size)
            results["runs"][name] = result
            logger.info("%s: %.2f ms (min %.2f) for %d tokens, %d of %d steps from graphs", name,
                        result["step_ms_median"], result["step_ms_min"], tokens, result["timed_steps_from_graphs"],
                        args.steps)
        del engine
        gc.collect()
    base = results["runs"].get("base", {}).get("step_ms_median")
    results["ratios"] = {f"{name}_over_base": run["step_ms_median"] / base
                         for name, run in results["runs"].items() if base and name != "base"}
    print(json.dumps(results["ratios"], indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
