"""Adapter loading under traffic on a GPU: overlap loading + prefetch against blocking loads.

    python -m bench.lora_loading --model bench/configs/llama-3.1-8b --out lora_loading.json

Llama-3.1-8B shape with dummy weights; per adapter rank (16 and 64) `--num-adapters` adapters (names
cycle over `--num-files` distinct files on disk, each name its own adapter to the engine), `--max-loras`
GPU slots and a host cache of `--max-cpu-loras`. For every traffic pattern (distinct, uniform, zipf 1.5)
the same requests and Poisson arrival times are replayed, by wall clock, against an engine with overlap
loading and prefetch and against one with blocking loads, each starting with cold adapter tiers.

Besides the traffic, `--resident-streams` long requests on one more adapter ("hot") are running when
the traffic starts and are aborted when it ends: the batch that adapter loads must not stall.

Reported per run: TTFT p50 of all requests (and apart for requests whose adapter was resident at arrival
and those that had to load it, with the share of it spent queued: arrival to first scheduled step); ITL p50
of the resident streams during the traffic (the judged ITL figure) and of the requests whose adapter was
loaded on the GPU when they arrived; the host-to-GPU copy bandwidth of adapter loads (bytes over copy
time, timed with CUDA events on the copy stream); tier counters. `targets` holds the issue's bars: TTFT p50 at least 35%
lower with overlap, resident-adapter ITL p50 at most 5% worse, copies at 40 GB/s or more.

Per rank, the overlap engine also replays the same arrivals and lengths with every request on the hot
adapter ("no_loads"): the TTFT of traffic that loads nothing, which no loading scheme can beat. Its TTFT
p50 against blocking's gives `ttft_p50_reduction_bound`, the most any overlap scheme could reduce TTFT p50
by on that traffic. The defaults take about 3.5 minutes on an H100 (adapter files, four engine builds,
fourteen runs).
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.make_adapters import make_adapter
from bench.workloads import Workload
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams
from worker.arch import ArchConfig

logger = logging.getLogger(__name__)
PATTERNS = {"distinct": ("distinct", 1.0), "uniform": ("uniform", 1.0), "zipf1.5": ("zipf", 1.5)}
MIN_RESIDENT = 10      # requests with a resident adapter needed to compare their ITL
HOT = "hot"            # the resident streams' adapter
NO_LOADS = "no_loads"  # the floor run: the same arrivals and lengths, every request on HOT


@dataclass
class Timeline:
    """When each request arrived and got each token (seconds from the start of the run)."""
    arrival: dict[str, float] = field(default_factory=dict)
    resident: dict[str, bool] = field(default_factory=dict)      # its adapter was on the GPU at arrival
    tokens: dict[str, list[float]] = field(default_factory=dict)
    scheduled: dict[str, float] = field(default_factory=dict)    # first scheduled into a step
    streams: dict[str, list[float]] = field(default_factory=dict)  # resident streams' token times in the traffic

    def ttft(self, ids) -> list[float]:
        return [self.tokens[i][0] - self.arrival[i] for i in ids if self.tokens.get(i)]

    def queued(self, ids) -> list[float]:
        """Arrival to first scheduled, of each request that got a token."""
        return [self.scheduled[i] - self.arrival[i] for i in ids if self.tokens.get(i)]

    def itl(self, ids) -> list[float]:
        return [b - a for i in ids for a, b in zip(self.tokens.get(i, []), self.tokens.get(i, [])[1:])]


def build_engine(args: argparse.Namespace, rank: int, overlap: bool) -> Engine:
    return Engine(WorkerConfig(
        ModelConfig(args.model, dtype="bfloat16", load_format="dummy", max_model_len=4096),
        cache=CacheConfig(kv_cache_memory_bytes=args.kv_cache_gib << 30),
        lora=LoRAConfig(max_loras=args.max_loras, max_lora_rank=rank, max_cpu_loras=args.max_cpu_loras,
                        enable_lora_overlap_loading=overlap, lora_load_workers=args.load_workers),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=4096),
        device="cuda", enforce_eager=args.eager, async_scheduling=not args.no_async_scheduling))


def register(engine: Engine, names: list[str], files: list[str]) -> None:
    """(Re)register every name: a fresh version each time, so all tiers start cold."""
    for state in engine.adapter_states():
        engine.remove_adapter(state.name)
    for i, name in enumerate(names):
        engine.add_adapter(name, files[i % len(files)])
    engine.add_adapter(HOT, files[0])


def warm_up(engine: Engine, names: list[str], vocab: int, prompt_len: int) -> None:
    """Compile what the runs use: prefill and decode, with and without adapters."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, adapter in enumerate([None, None, names[0], names[1]]):
        engine.add_request(f"warm{i}", [(7 * i + k) % vocab for k in range(prompt_len)], params, adapter)
    while engine.has_unfinished():
        engine.step()


def preload(engine: Engine, adapter: str, vocab: int) -> None:
    """Bring `adapter` onto the GPU with a one-token request."""
    engine.add_request("preload", list(range(1, min(vocab, 17))), SamplingParams(max_tokens=1), adapter)
    while engine.has_unfinished():
        engine.step()


def warm_pinned_memory(engine: Engine, count: int) -> None:
    """Pin (and give back to torch's host allocator, which keeps them) as many slot-sized buffers as the
    runs hold at once, so neither mode pays for pinning fresh memory during its runs."""
    size = engine.runner.lora_pool.layout.num_bytes
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    del buffers


def start_streams(engine: Engine, count: int, prompt: list[int]) -> list[str]:
    """Start `count` long requests on the hot adapter and step until each has its first token."""
    ids = [f"stream{k}" for k in range(count)]
    for request_id in ids:
        params = SamplingParams(temperature=0.0, max_tokens=engine.max_model_len - len(prompt), ignore_eos=True)
        engine.add_request(request_id, prompt, params, HOT)
    started: set[str] = set()
    while len(started) < count:
        started |= {out.request_id for out in engine.step() if out.new_token_ids}
    return ids


def replay(engine: Engine, workload: Workload, seed: int, streams: int) -> Timeline:
    """Start the resident streams, send the workload's requests at their arrival times, step the engine
    until they all finish, then abort the streams."""
    specs, due = workload.requests(seed), workload.arrival_times(seed)
    timeline, sent = Timeline(), 0
    stream_ids = start_streams(engine, streams, specs[0].prompt) if streams else []
    start = time.perf_counter()
    finished = 0
    added: dict[str, float] = {}
    while sent < len(specs) or finished < sent:
        now = time.perf_counter() - start
        if sent < len(specs) and due[sent] <= now:
            residency = {state.name: state.residency for state in engine.adapter_states()}
        while sent < len(specs) and due[sent] <= now:
            spec, request_id = specs[sent], f"r{sent}"
            timeline.arrival[request_id] = due[sent]
            timeline.resident[request_id] = residency[spec.adapter] == "gpu"
            added[request_id] = time.perf_counter() - start
            engine.add_request(request_id, spec.prompt, SamplingParams(temperature=0.0, max_tokens=spec.output_len,
                                                                       ignore_eos=True), spec.adapter)
            sent += 1
        if not engine.has_unfinished():
            time.sleep(min(1e-3, max(0.0, due[sent] - now)))
            continue
        outputs = engine.step()
        now = time.perf_counter() - start
        for out in outputs:
            if out.queue_time is not None and out.request_id in added:
                timeline.scheduled[out.request_id] = added[out.request_id] + out.queue_time
            if out.new_token_ids:
                times = timeline.streams if out.request_id in stream_ids else timeline.tokens
                times.setdefault(out.request_id, []).append(now)
            finished += out.finish_reason is not None and out.request_id not in stream_ids
    for request_id in stream_ids:
        engine.abort_request(request_id)
    return timeline


def summarize(timeline: Timeline, before, after) -> dict:
    ids = list(timeline.arrival)
    stream_itl = [b - a for times in timeline.streams.values() for a, b in zip(times, times[1:])]
    resident = [i for i in ids if timeline.resident[i]]
    loading = [i for i in ids if not timeline.resident[i]]
    copy_s = after.gpu.load_seconds_sum - before.gpu.load_seconds_sum
    copied = after.gpu.loaded_bytes - before.gpu.loaded_bytes
    tiers = {tier: {k: getattr(getattr(after, tier), k) - getattr(getattr(before, tier), k)
                    for k in ("hits", "misses", "loads", "evictions")} for tier in ("host", "gpu")}
    mean_ms = {tier: 1e3 * (getattr(after, tier).load_seconds_sum - getattr(before, tier).load_seconds_sum)
               / max(1, tiers[tier]["loads"]) for tier in ("host", "gpu")}
    return {"requests": len(ids), "resident_at_arrival": len(resident),
            "ttft_p50_ms": 1e3 * statistics.median(timeline.ttft(ids)),
            "ttft_p90_ms": 1e3 * statistics.quantiles(timeline.ttft(ids), n=10)[-1],
            "ttft_p50_resident_ms": 1e3 * statistics.median(timeline.ttft(resident)) if resident else None,
            "ttft_p50_loading_ms": 1e3 * statistics.median(timeline.ttft(loading)) if loading else None,
            "queued_p50_resident_ms": 1e3 * statistics.median(timeline.queued(resident)) if resident else None,
            "queued_p50_loading_ms": 1e3 * statistics.median(timeline.queued(loading)) if loading else None,
            "itl_p50_resident_ms": 1e3 * statistics.median(timeline.itl(resident)) if timeline.itl(resident) else None,
            "itl_p50_streams_ms": 1e3 * statistics.median(stream_itl) if stream_itl else None,
            "stream_itl_samples": len(stream_itl),
            "itl_p50_all_ms": 1e3 * statistics.median(timeline.itl(ids)),
            "h2d_GBps": copied / copy_s / 1e9 if copy_s else None, "h2d_copies": tiers["gpu"]["loads"],
            "disk_read_ms_mean": mean_ms["host"], "h2d_copy_ms_mean": mean_ms["gpu"], "tiers": tiers}


def run_rank(args: argparse.Namespace, arch: ArchConfig, rank: int, tmp: Path) -> dict:
    files = [str(make_adapter(tmp / f"r{rank}-{i}", arch, rank, seed=i, device="cuda")) for i in range(args.num_files)]
    names = [f"a{i}" for i in range(args.num_adapters)]
    results: dict = {}
    for overlap in (True, False):
        mode = "overlap" if overlap else "blocking"
        engine = build_engine(args, rank, overlap)
        warm_pinned_memory(engine, args.max_cpu_loras + 2 * args.load_workers + args.max_loras)
        register(engine, names, files)
        warm_up(engine, names, arch.vocab_size, args.prompt_len)
        runs = [(pattern, names, choice, alpha) for pattern, (choice, alpha) in PATTERNS.items()
                if pattern in args.patterns]
        if overlap:    # the same traffic with nothing to load: every request on the streams' adapter
            runs.append((NO_LOADS, [HOT], "identical", 1.0))
        for pattern, adapters, choice, alpha in runs:
            workload = Workload(num_prompts=args.requests, input_len=(args.prompt_len, args.prompt_len),
                                output_len=(args.output_len, args.output_len), vocab_size=arch.vocab_size,
                                adapters=tuple(adapters), adapter_choice=choice, zipf_alpha=alpha,
                                request_rate=args.rate)
            register(engine, names, files)
            if pattern == NO_LOADS:
                preload(engine, HOT, arch.vocab_size)
            before = engine.lora_stats()
            timeline = replay(engine, workload, args.seed, args.resident_streams)
            result = summarize(timeline, before, engine.lora_stats())
            results.setdefault(pattern, {})[mode] = result
            logger.info("rank %d %s %s: %s", rank, pattern, mode, result)
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    floor = results.pop(NO_LOADS, {}).get("overlap")
    out = {pattern: {**modes, "targets": targets(modes, floor)} for pattern, modes in results.items()}
    return {**out, NO_LOADS: floor} if floor else out


def targets(modes: dict, floor: dict | None = None) -> dict:
    """The issue's bars. ITL is judged on the resident streams; the ratio over requests whose adapter
    was resident at arrival is also given, None when either mode had fewer than MIN_RESIDENT of them
    (distinct traffic has none). `floor`: the no-loads run; no loading can make a TTFT p50 lower than
    its, so 1 - its TTFT p50 / blocking's bounds the reduction any overlap scheme could reach."""
    on, off = modes["overlap"], modes["blocking"]
    reduction = 1 - on["ttft_p50_ms"] / off["ttft_p50_ms"]
    bound = None if floor is None else 1 - floor["ttft_p50_ms"] / off["ttft_p50_ms"]
    judged = min(on["resident_at_arrival"], off["resident_at_arrival"]) >= MIN_RESIDENT
    itl = on["itl_p50_resident_ms"] / off["itl_p50_resident_ms"] if judged else None
    streams = (on["itl_p50_streams_ms"] / off["itl_p50_streams_ms"]
               if on["itl_p50_streams_ms"] and off["itl_p50_streams_ms"] else None)
    rates = [m["h2d_GBps"] for m in (on, off) if m["h2d_GBps"]]
    return {"ttft_p50_reduction": reduction, "ttft_ok": reduction >= 0.35,
            "ttft_p50_reduction_bound": bound, "ttft_bar_reachable": None if bound is None else bound >= 0.35,
            "itl_p50_streams_ratio": streams, "itl_ok": None if streams is None else streams <= 1.05,
            "itl_p50_resident_at_arrival_ratio": itl,
            "h2d_GBps_min": min(rates, default=None), "h2d_ok": bool(rates) and min(rates) >= 40}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="bench/configs/llama-3.1-8b")
    add("--out", default=None)
    add("--ranks", default="16,64")
    add("--patterns", default=",".join(PATTERNS))
    add("--num-adapters", type=int, default=128)
    add("--num-files", type=int, default=4, help="distinct adapter files on disk; names cycle over them")
    add("--max-loras", type=int, default=8)
    add("--max-cpu-loras", type=int, default=32)
    add("--load-workers", type=int, default=4, help="disk-read threads")
    add("--max-num-seqs", type=int, default=32)
    add("--kv-cache-gib", type=int, default=8)
    add("--requests", type=int, default=100, help="requests per run")
    add("--rate", type=float, default=16.0, help="Poisson arrivals per second")
    add("--prompt-len", type=int, default=256)
    add("--output-len", type=int, default=32)
    add("--seed", type=int, default=0)
    add("--eager", action="store_true", help="no CUDA graphs")
    add("--no-async-scheduling", action="store_true", help="file each step's tokens before the next schedule")
    add("--resident-streams", type=int, default=4, help="long requests on a resident adapter during the traffic")
    args = parser.parse_args()
    args.patterns = args.patterns.split(",")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("worker.engine").setLevel(logging.WARNING)     # one line per registered adapter
    arch = ArchConfig.from_dir(args.model)
    started = time.perf_counter()
    results = {"device": torch.cuda.get_device_name(), "config": vars(args), "ranks": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for rank in map(int, args.ranks.split(",")):
            results["ranks"][rank] = run_rank(args, arch, rank, Path(tmp))
    results["seconds"] = time.perf_counter() - started
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
