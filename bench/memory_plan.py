"""Startup under the memory plan: does an engine with these flags start, and where does the memory go?

    python -m bench.memory_plan --model bench/configs/llama-3.1-8b --max-num-seqs 256 --out plan.json
    python -m bench.memory_plan --model bench/configs/llama-3.1-8b --pair 0.4 --out pair.json
    python -m bench.memory_plan --model bench/configs/llama-3.1-8b --kv-cache-dtype fp8 --out fp8.json

One engine per process (the plan measures the device from its start). Each run builds an Engine with
`--load-format dummy` at the default --gpu-memory-utilization (or the one given), records the plan's split
(model_runner/memory_plan.py), the memory the CUDA graphs really took against what the plan reserved, the
device's used memory against the budget, then runs a full step of max_num_seqs decode rows with rank-16
adapters (the largest batch the flags allow) to show the server works at that size. `--pair U` starts two
such processes at once, each at utilisation U, as two servers sharing a GPU.
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import re
import tempfile
import time
from pathlib import Path

import torch

from bench.make_adapters import make_adapter
from worker.config import KV_CACHE_DTYPES, CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams
from worker.arch import ArchConfig

PLAN = re.compile(r"memory plan: .*")
GRAPHS = re.compile(r"CUDA graphs took ([\d.]+) GiB")


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def run_one(model: str, max_seqs: int, utilization: float, max_loras: int, tokens: int,
            kv_cache_dtype: str = "auto") -> dict:
    lines = _Lines()
    logging.getLogger().addHandler(lines)
    logging.getLogger().setLevel(logging.INFO)
    start = time.perf_counter()
    result = {"max_num_seqs": max_seqs, "gpu_memory_utilization": utilization, "max_loras": max_loras,
              "max_num_batched_tokens": tokens, "kv_cache_dtype": kv_cache_dtype}
    try:
        engine = Engine(WorkerConfig(
            ModelConfig(model, dtype="bfloat16", load_format="dummy", max_model_len=4096),
            cache=CacheConfig(gpu_memory_utilization=utilization, kv_cache_dtype=kv_cache_dtype),
            lora=LoRAConfig(max_loras=max_loras, max_lora_rank=16),
            scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=tokens), device="cuda"))
    except Exception as e:          # the point of the bench: report what failed
        result.update(started=False, error=repr(e)[:2000], log=[m for m in lines.lines if "memory" in m])
        return result
    free, total = torch.cuda.mem_get_info()
    result.update(started=True, startup_s=round(time.perf_counter() - start, 1), num_kv_blocks=engine.num_kv_blocks,
                  plan=next((m for m in lines.lines if PLAN.match(m)), None),
                  graphs_gib=next((float(g.group(1)) for m in lines.lines if (g := GRAPHS.search(m))), None),
                  device_used_gib=round((total - free) / 2**30, 2), budget_gib=round(total * utilization / 2**30, 2))
    arch = ArchConfig.from_dir(model)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{i}" for i in range(max_loras)]
        for i, name in enumerate(names):
            engine.add_adapter(name, str(make_adapter(Path(tmp) / name, arch, 16, seed=i, device="cuda")))
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        for i in range(max_seqs):
            engine.add_request(f"r{i}", list(range(100, 228)), params, names[i % len(names)])
        steps, finished, peak_rows = 0, 0, 0
        while engine.has_unfinished():
            finished += sum(out.finished for out in engine.step())
            peak_rows = max(peak_rows, len(engine.scheduler.running))
            steps += 1
    torch.cuda.synchronize()
    free, _ = torch.cuda.mem_get_info()
    result.update(requests_finished=finished, steps=steps, most_running=peak_rows,
                  device_used_after_gib=round((total - free) / 2**30, 2),
                  torch_peak_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2))
    return result


def _child(queue, *args) -> None:
    queue.put(run_one(*args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench/configs/llama-3.1-8b")
    parser.add_argument("--max-num-seqs", type=int, nargs="+", default=[256])
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    parser.add_argument("--pair", type=float, default=None, help="start two engines at once at this utilisation")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    results = []
    if args.pair is not None:
        queue = ctx.Queue()
        procs = [ctx.Process(target=_child, args=(queue, args.model, args.max_num_seqs[0], args.pair, args.max_loras,
                                                   args.max_num_batched_tokens, args.kv_cache_dtype))
                 for _ in range(2)]
        for p in procs:
            p.start()
        results = [queue.get() for _ in procs]
        for p in procs:
            p.join()
    else:
        for seqs in args.max_num_seqs:       # one process each: the plan measures the device from its start
            queue = ctx.Queue()
            p = ctx.Process(target=_child, args=(queue, args.model, seqs, args.gpu_memory_utilization,
                                                 args.max_loras, args.max_num_batched_tokens, args.kv_cache_dtype))
            p.start()
            results.append(queue.get())
            p.join()
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps({"device": torch.cuda.get_device_name(), "runs": results}, indent=1))


if __name__ == "__main__":
    main()
