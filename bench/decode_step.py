"""Decode-step time of the GPU path against the memory floor, with and without adapters, graphs vs eager.

    python -m bench.decode_step --model bench/configs/llama-3.1-8b --out decode.json

The memory floor of a step is the bytes it must read (base weights, plus the weights of the adapters
in the batch) divided by the device copy bandwidth measured in the same run. Step times are the wall
time of Engine.step() (host work included) and, for graph runs, the replay alone timed with CUDA events.
--profile adds each kernel's device time per step (torch.profiler), graph and eager. "graphs-sync" runs
are the same steps with async scheduling off (each step's tokens read back before the next is scheduled);
"graphs-inline" runs have the LoRA kernels in line on the compute stream instead of beside the base GEMMs;
"graphs-cublas" runs send every projection to cuBLAS: batch 1 instead of the small-batch GEMV (kernels/gemv.py),
batch 32 instead of the skinny kernel (kernels/skinny_gemm.py); "graphs-nopdl" runs launch every kernel only
once the one before it has ended (kernels/pdl.py). Each of the last three is the engine built with one
KernelConfig choice off (MODE_KERNELS). "graphs-large" (only when named) is a serving batch: 256 rows of the base
model, of one adapter, and over 64 adapters (an engine of 256 sequences and 64 slots), profiled with --profile;
"graphs-large-inline" the adapter runs with the LoRA kernels in line.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.make_adapters import ALL_TARGETS, make_adapter
from worker.config import CacheConfig, KernelConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams
from worker.arch import ArchConfig
from worker.models.builder import lora_targets

logger = logging.getLogger(__name__)
# run name -> (batch size, adapter of each sequence, cycled); adapters a0..a31 are rank 16
RUNS = {"b1_base": (1, [None]), "b32_base": (32, [None]), "b1_lora16": (1, ["a0"]),
        "b32_32lora16": (32, [f"a{i}" for i in range(32)])}
LARGE_RUNS = {"b256_base": (256, [None]), "b256_lora16": (256, ["a0"]),
              "b256_64lora16": (256, [f"a{i}" for i in range(64)])}
ALL_RUNS = {**RUNS, **LARGE_RUNS}
MODE_RUNS = {"graphs": list(RUNS), "eager": ["b1_base", "b32_base"],
             "graphs-sync": ["b1_base", "b32_32lora16"],    # sync: what async scheduling buys, beside it
             "graphs-inline": ["b1_lora16", "b32_32lora16"],   # what the LoRA side stream buys
             "graphs-cublas": list(RUNS),        # what the small-batch GEMV and the skinny kernel buy
             "graphs-nopdl": list(RUNS),         # what programmatic dependent launch buys
             "graphs-large": list(LARGE_RUNS),   # a serving batch: 256 rows, 64 slots (ratios within the mode)
             "graphs-large-inline": list(LARGE_RUNS)[1:]}   # the side stream at 256 rows (against graphs-large)
# the engine's kernel choices per mode (the other modes: KernelConfig's defaults)
MODE_KERNELS = {"graphs-inline": KernelConfig(lora_side_stream=False),
                "graphs-large-inline": KernelConfig(lora_side_stream=False),
                "graphs-cublas": KernelConfig(gemv_row_limit=0, skinny_row_limit=0),
                "graphs-nopdl": KernelConfig(programmatic_launch=False)}
PROFILED = {"graphs": ["b1_base", "b32_base", "b32_32lora16"], "eager": ["b1_base", "b32_base", "b32_32lora16"],
            "graphs-large": MODE_RUNS["graphs-large"], "graphs-large-inline": MODE_RUNS["graphs-large-inline"]}
LARGE = {"max_seqs": 256, "max_loras": 64, "kv_bytes": 20 << 30}   # the graphs-large engine


def copy_bandwidth(num_bytes: int = 4 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    return 2 * num_bytes / seconds


def build_engine(model: str, max_seqs: int, max_loras: int, eager: bool, async_scheduling: bool = True,
                 kernels: KernelConfig = KernelConfig(), mixed_graph_max_tokens: int = 1024,
                 kv_bytes: int = 6 << 30, quantization: str | None = None) -> Engine:
    return Engine(WorkerConfig(
        ModelConfig(model, dtype="bfloat16", load_format="dummy", max_model_len=4096, quantization=quantization),
        cache=CacheConfig(kv_cache_memory_bytes=kv_bytes),
        lora=LoRAConfig(max_loras=max_loras, max_lora_rank=16),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=4096), kernels=kernels,
        device="cuda", enforce_eager=eager, async_scheduling=async_scheduling,
        mixed_graph_max_tokens=mixed_graph_max_tokens))


def start_requests(engine: Engine, batch: int, adapters: list[str | None], prefix: str,
                   prompt_len: int = 128, distinct: bool = False) -> list[str]:
    """Add `batch` requests (adapters cycled) and step until every one has its first token (prefilled), then
    5 decode steps; returns their ids.

    No request may finish before the caller is done with it (the caller aborts them): while the last
    adapters load, the first requests admitted keep decoding, and a batch that shrank would be timed (and
    its graph replayed) with fewer rows than `batch`."""
    params = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - prompt_len, ignore_eos=True)
    request_ids = [f"{prefix}{i}" for i in range(batch)]
    for i, request_id in enumerate(request_ids):
        first = 100 + (1000 * i if distinct else 0)     # distinct: other tokens per request (MoE routing differs)
        engine.add_request(request_id, list(range(first, first + prompt_len)), params, adapters[i % len(adapters)])
    started: set[str] = set()
    while len(started) < batch:                        # prefill (and any adapter loads)
        for out in engine.step():
            if out.finished:
                raise RuntimeError(f"request {out.request_id} ended while starting: {out.finish_reason} {out.error}")
            started.add(out.request_id)
    for _ in range(5):
        engine.step()
    return request_ids


def abort_all(engine: Engine, request_ids: list[str]) -> None:
    for request_id in request_ids:
        engine.abort_request(request_id)


def time_decode(engine: Engine, batch: int, adapters: list[str | None], steps: int, distinct: bool = False) -> dict:
    request_ids = start_requests(engine, batch, adapters, "b", distinct=distinct)
    wall = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - t0)
    assert engine.num_running == batch, "a request stopped before the timing ended"
    result = {"batch": batch, "step_ms_median": 1e3 * statistics.median(wall),
              "step_ms_mean": 1e3 * statistics.fmean(wall)}
    graph_runner = engine.runner.graph_runner
    if graph_runner is not None:
        lora = "grouped" if graph_runner.last_replay == "grouped" else any(adapters)
        result.update(graph="grouped" if lora == "grouped" else "decode", replay_ms=replay_ms(engine, batch, lora))
    abort_all(engine, request_ids)
    return result


def replay_ms(engine: Engine, batch: int, lora: bool | str, iters: int = 50) -> float:
    """GPU time of the decode graph alone (the last step's inputs, replayed), timed with CUDA events:
    the step's wall time minus this is host work and sampling."""
    # the last step must have filled every row this graph reads (rows past a smaller batch's bucket are stale)
    assert engine.num_running == batch, "the last step did not run the whole batch"
    graph = engine.runner.graph_runner.decode_graph(batch, lora)
    torch.cuda.synchronize()     # an error of the engine's last (launched, never waited) step surfaces here
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def kernel_profile(engine: Engine, batch: int, adapters: list[str | None], steps: int = 5,
                   distinct: bool = False) -> dict:
    """Device time per step of each kernel (by name) over `steps` decode steps, largest first."""
    from torch.profiler import ProfilerActivity, profile
    request_ids = start_requests(engine, batch, adapters, "p", distinct=distinct)   # the profile sees decode steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    assert engine.num_running == batch, "a request stopped before the profile ended"
    abort_all(engine, request_ids)
    return per_kernel_summary(prof, steps)


def per_kernel_summary(prof, steps: int, top: int = 30) -> dict:
    """A profile's device time per step of each kernel (by name, largest first), and their sums."""
    per_kernel: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            entry = per_kernel.setdefault(event.name[:90], [0.0, 0])
            entry[0] += event.time_range.elapsed_us() / 1e3 / steps
            entry[1] += 1 / steps
    rows = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])
    return {"kernel_ms_per_step": sum(ms for ms, _ in per_kernel.values()),
            "launches_per_step": sum(n for _, n in per_kernel.values()),
            "kernels": [{"name": name, "ms": ms, "count": n} for name, (ms, n) in rows[:top]]}


def weight_bytes(engine: Engine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def adapter_bytes(arch: ArchConfig, rank: int) -> int:
    """Bytes of a bf16 adapter of `rank` as make_adapter writes it by default: every module of ALL_TARGETS that
    a layer has (on a dense model, all seven projections of every layer)."""
    table = lora_targets(arch)
    return 2 * sum(rank * (target.in_features + fan_out) for layer in range(arch.num_layers)
                   for target in table.at(layer) for module, fan_out in zip(target.modules, target.out_features)
                   if module in ALL_TARGETS)


def _against_graphs(mode: str, names: dict[str, str]) -> dict:
    """RATIOS entries of a mode's step time over the default graphs mode's, one per run: {run: ratio name}."""
    return {name: (f"{mode}_{run}", "step_ms_median", f"graphs_{run}", "step_ms_median") for run, name in names.items()}


RATIOS = {   # name: (numerator run, its field, denominator run, its field)
    "b1_base_step_over_floor": ("graphs_b1_base", "step_ms_median", "graphs_b1_base", "floor_ms"),
    "b256_lora16_over_b256_base":
        ("graphs-large_b256_lora16", "step_ms_median", "graphs-large_b256_base", "step_ms_median"),
    "b256_64lora16_over_b256_base":
        ("graphs-large_b256_64lora16", "step_ms_median", "graphs-large_b256_base", "step_ms_median"),
    "b256_lora16_replay_over_b256_base_replay":
        ("graphs-large_b256_lora16", "replay_ms", "graphs-large_b256_base", "replay_ms"),
    "b256_64lora16_replay_over_b256_base_replay":
        ("graphs-large_b256_64lora16", "replay_ms", "graphs-large_b256_base", "replay_ms"),
    **{f"{run}_inline_over_side_stream": (f"graphs-large-inline_{run}", "step_ms_median", f"graphs-large_{run}",
                                          "step_ms_median") for run in ("b256_lora16", "b256_64lora16")},
    "b1_lora16_over_b1_base": ("graphs_b1_lora16", "step_ms_median", "graphs_b1_base", "step_ms_median"),
    "b32_32lora16_over_floor_with_adapters":
        ("graphs_b32_32lora16", "step_ms_median", "graphs_b32_32lora16", "floor_ms"),
    **_against_graphs("eager", {"b1_base": "b1_eager_over_graphs", "b32_base": "b32_eager_over_graphs"}),
    "b1_base_replay_over_floor": ("graphs_b1_base", "replay_ms", "graphs_b1_base", "floor_ms"),
    "b1_lora16_replay_over_b1_base_replay": ("graphs_b1_lora16", "replay_ms", "graphs_b1_base", "replay_ms"),
    "b32_32lora16_replay_over_floor_with_adapters":
        ("graphs_b32_32lora16", "replay_ms", "graphs_b32_32lora16", "floor_ms"),
    **_against_graphs("graphs-sync", {"b1_base": "b1_sync_over_async",
                                      "b32_32lora16": "b32_32lora16_sync_over_async"}),
    **_against_graphs("graphs-inline", {run: f"{run}_inline_over_side_stream"
                                        for run in ("b1_lora16", "b32_32lora16")}),
    **_against_graphs("graphs-cublas", {run: f"{run}_cublas_over_{'gemv' if run.startswith('b1_') else 'skinny'}"
                                        for run in ("b1_base", "b1_lora16", "b32_base", "b32_32lora16")}),
    **_against_graphs("graphs-nopdl", {run: f"{run}_nopdl_over_pdl"
                                       for run in ("b1_base", "b1_lora16", "b32_base", "b32_32lora16")}),
}


def ratios(runs: dict) -> dict:
    """The issue's ratios, each where both of its runs were made."""
    return {name: runs[a][fa] / runs[b][fb] for name, (a, fa, b, fb) in RATIOS.items() if a in runs and b in runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench/configs/llama-3.1-8b")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default=None)
    parser.add_argument("--quantization", choices=["fp8"], default=None,
                        help="quantize the weights to FP8 at load (an FP8 config such as "
                             "bench/configs/llama-3.1-8b-fp8-dynamic needs none)")
    parser.add_argument("--profile", action="store_true", help="also record per-kernel device time per step")
    parser.add_argument("--modes", nargs="+", choices=list(MODE_RUNS),
                        default=[mode for mode in MODE_RUNS if not mode.startswith("graphs-large")],
                        help="engine modes to time (default: all but graphs-large*); ratios are given where their "
                             "runs were made")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    arch = ArchConfig.from_dir(args.model)
    bandwidth = copy_bandwidth()
    results: dict = {"device": torch.cuda.get_device_name(), "copy_bandwidth_GBps": bandwidth / 1e9, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        num_adapters = 64 if any(mode.startswith("graphs-large") for mode in args.modes) else 32
        adapters = [str(make_adapter(Path(tmp) / f"a{i}", arch, 16, seed=i, device="cuda"))
                    for i in range(num_adapters)]
        for mode in args.modes:
            sizes = LARGE if mode.startswith("graphs-large") else {"max_seqs": 32, "max_loras": 32}
            engine = build_engine(args.model, sizes["max_seqs"], sizes["max_loras"], eager=mode == "eager",
                                  async_scheduling=mode != "graphs-sync",
                                  kernels=MODE_KERNELS.get(mode, KernelConfig()),
                                  kv_bytes=sizes.get("kv_bytes", 6 << 30), quantization=args.quantization)
            for i, path in enumerate(adapters[:sizes["max_loras"]]):
                engine.add_adapter(f"a{i}", path)
            base = weight_bytes(engine)
            results["weight_bytes"] = base
            for name in MODE_RUNS[mode]:
                batch, names = ALL_RUNS[name]
                result = time_decode(engine, batch, names, args.steps)
                n_adapters = len({n for n in names if n})
                floor_ms = 1e3 * (base + n_adapters * adapter_bytes(arch, 16)) / bandwidth
                result.update(floor_ms=floor_ms, step_over_floor=result["step_ms_median"] / floor_ms)
                results["runs"][f"{mode}_{name}"] = result
                logger.info("%s %s: %s", mode, name, result)
                if args.out:          # after every run, so a run that dies keeps the figures before it
                    Path(args.out).write_text(json.dumps({**results, "ratios": ratios(results["runs"])}, indent=2))
            if args.profile:
                for name in PROFILED.get(mode, []):
                    batch, names = ALL_RUNS[name]
                    results.setdefault("profile", {})[f"{mode}_{name}"] = kernel_profile(engine, batch, names)
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    results["ratios"] = ratios(results["runs"])
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
