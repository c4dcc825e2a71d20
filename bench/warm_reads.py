"""Serving speed while the server reads its --lora-modules adapters into host memory after startup, against after.

    python -m bench.warm_reads --model bench/configs/llama-3.1-8b --adapters /tmp/adapters --num-adapters 1000 \\
        --streams 8 256 --out warm.json -- --max-loras 128 --max-lora-rank 64 --max-num-seqs 256

`--adapters` holds `lora-0` .. `lora-(N-1)` (bench.make_adapters). For each stream count, a fresh `loraplex serve`
(dummy weights, the adapters as --lora-modules, the flags after `--`) is started; the moment /health answers 200
the streams start, each sending ~`--input-len` random-id prompts, `--output-len` tokens with ignore_eos, back to
back for `--seconds`, on adapters drawn zipf(1.0) over the N; they go out from one client process per 64 streams.
Beside them /metrics is polled every 0.1 s: the reads are done when every adapter is in memory
(vllm:num_cpu_loaded_lora_adapters, either tier, = N). Each inter-token gap (a stream's
consecutive chunks) is filed by when it ended: during the reads, or after them (from 2 s after, so the switch is
not straddled); `--start-after-s` past the reads with `--split-s` (a fixed split after the streams start) is the control: the first
stretch of traffic with nothing being read. Reports,
per stream count, TPOT (the mean gap) and gap p50 / p95 during and after and their
ratio, how long the reads took from /health, and the host cache's bytes and the worker's RSS once they are done;
to see when the slow gaps come, the gaps' mean and largest per `--bin-s` of traffic and the largest gaps with the
time they ended. `--py-spy SECONDS` records the worker with py-spy (every thread, idle included) for that long from
/health, as collapsed stacks beside `--out`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from bench.soak import wait_healthy
from bench.workloads import adapter_names, zipf_weights

SETTLE_S = 2.0      # gaps this soon after the reads ended count as neither


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> list[float]:
    times = []
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and '"text"' in line:
                times.append(time.time())
    return times


def _client(base_url: str, streams: int, seconds: float, input_len: int, output_len: int, num_adapters: int,
            vocab: int, seed: int, queue) -> None:
    names, weights = adapter_names("lora", num_adapters), zipf_weights(num_adapters, 1.0)

    async def loop(client: httpx.AsyncClient, rng: random.Random, end: float, out: list) -> None:
        while time.time() < end:
            body = {"model": rng.choices(names, weights)[0], "max_tokens": output_len, "temperature": 0,
                    "ignore_eos": True, "stream": True,
                    "prompt": [rng.randrange(10, vocab - 10) for _ in range(input_len)]}
            out.append(await _stream(client, f"{base_url}/v1/completions", body))

    async def main() -> list:
        end, out = time.time() + seconds, []
        limits = httpx.Limits(max_connections=streams + 4)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
            await asyncio.gather(*(loop(client, random.Random(seed * 1000 + i), end, out) for i in range(streams)))
        return out
    queue.put(asyncio.run(main()))


def _metric(text: str, name: str) -> float:
    found = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    return sum(float(v) for v in found)


def _rss(pid: int) -> int:
    """Resident bytes of `pid` and its children (the worker is a child of the gateway)."""
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


def run_point(args, streams: int, port: int) -> dict:
    modules = [f"lora-{i}={args.adapters}/lora-{i}" for i in range(args.num_adapters)]
    cmd = [sys.executable, "-m", "gateway", "serve", "--model", args.model, "--load-format", "dummy",
           "--port", str(port), "--lora-modules", *modules, *args.serve_args]
    log = open(f"{args.out}.server-{streams}.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        started = time.time()
        wait_healthy(base, server, timeout_s=600, every_s=0.05)
        healthy = time.time()
        profiler = _py_spy(server.pid, args.py_spy, f"{args.out}.py-spy-{streams}.txt") if args.py_spy else None
        time.sleep(args.start_after_s)
        traffic = time.time()
        vocab = json.loads(Path(args.model, "config.json").read_text())["vocab_size"]
        queue = multiprocessing.Queue()
        procs = math.ceil(streams / 64)
        clients = [multiprocessing.Process(target=_client, args=(base, streams // procs + (i < streams % procs),
                   args.seconds, args.input_len, args.output_len, args.num_adapters, vocab, i, queue))
                   for i in range(procs)]
        for c in clients:
            c.start()
        done_at, polls = None, []
        while any(c.is_alive() for c in clients) and queue.qsize() < procs:
            text = httpx.get(f"{base}/metrics", timeout=5).text
            loaded = _metric(text, "vllm:num_cpu_loaded_lora_adapters")     # either tier
            polls.append((time.time() - healthy, loaded))
            if done_at is None and loaded >= args.num_adapters:
                done_at = time.time()
                host_bytes = _metric(text, "loraplex:lora_host_cache_bytes")
                rss = _rss(server.pid)
            time.sleep(0.1)
        requests = [times for _ in clients for times in queue.get()]
        for c in clients:
            c.join()
        if profiler is not None:
            profiler.wait(60)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)
    read_s = None if done_at is None else done_at - healthy
    if args.split_s is not None:           # a control: split at a fixed time instead of at the reads' end
        done_at = traffic + args.split_s
    during, after = [], []
    for times in requests:
        for a, b in zip(times, times[1:]):
            if done_at is None or b < done_at:
                during.append(b - a)
            elif b > done_at + SETTLE_S:
                after.append(b - a)

    def summary(gaps: list[float]) -> dict:
        if len(gaps) < 20:
            return {"gaps": len(gaps)}
        q = statistics.quantiles(gaps, n=100)
        return {"gaps": len(gaps), "tpot_ms": 1e3 * statistics.fmean(gaps), "p50_ms": 1e3 * q[49],
                "p95_ms": 1e3 * q[94], "p99_ms": 1e3 * q[98]}
    point = {"streams": streams, "startup_s": healthy - started,
             "reads_s_after_health": read_s,
             "during": summary(during), "after": summary(after), "loaded_over_time": polls[::10],
             "timeline": _timeline(requests, traffic, healthy, args.bin_s)}
    if done_at is not None:
        point |= {"host_cache_bytes": host_bytes, "server_rss_bytes": rss}
    if "tpot_ms" in point["during"] and "tpot_ms" in point["after"]:
        point["tpot_ratio"] = point["during"]["tpot_ms"] / point["after"]["tpot_ms"]
        point["p95_ratio"] = point["during"]["p95_ms"] / point["after"]["p95_ms"]
    return point


def _timeline(requests: list[list[float]], traffic: float, healthy: float, bin_s: float) -> dict:
    """The gaps by when they ended: per `bin_s` from the traffic's start [start s, gaps, mean ms, max ms], and the
    25 largest [ms, end s after /health]."""
    gaps = [(b - a, b) for times in requests for a, b in zip(times, times[1:])]
    bins: dict[int, list[float]] = {}
    for gap, end in gaps:
        bins.setdefault(int((end - traffic) // bin_s), []).append(gap)
    largest = sorted(gaps, reverse=True)[:25]
    return {"bins": [[k * bin_s, len(v), round(1e3 * statistics.fmean(v), 2), round(1e3 * max(v), 1)]
                     for k, v in sorted(bins.items())],
            "largest": [[round(1e3 * gap, 1), round(end - healthy, 3)] for gap, end in largest]}


def _py_spy(server_pid: int, seconds: float, out: str) -> subprocess.Popen | None:
    """py-spy recording the worker (the gateway's child holding the most memory) for `seconds`, collapsed stacks."""
    children = psutil.Process(server_pid).children(recursive=True)
    if not children:
        print("no worker process to profile", file=sys.stderr)
        return None
    worker = max(children, key=lambda c: c.memory_info().rss)
    return subprocess.Popen(["py-spy", "record", "-p", str(worker.pid), "-d", str(int(seconds)), "-r", "1000",
                             "--threads", "--idle", "--nonblocking", "-f", "raw", "-o", out],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--adapters", required=True)
    p.add_argument("--num-adapters", type=int, default=1000)
    p.add_argument("--streams", type=int, nargs="+", default=[8, 256])
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--input-len", type=int, default=100)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--start-after-s", type=float, default=0.0, help="start the streams this long after /health")
    p.add_argument("--split-s", type=float, help="a control: file gaps as 'during' until this many seconds after "
                   "the streams start, whenever the reads end (with --start-after-s past the reads: is the first "
                   "stretch of traffic slower whatever is read?)")
    p.add_argument("--bin-s", type=float, default=0.5, help="the timeline's bin width")
    p.add_argument("--py-spy", type=float, metavar="SECONDS", help="record the worker with py-spy this long")
    p.add_argument("--out", required=True)
    p.add_argument("serve_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    args.serve_args = [a for a in args.serve_args if a != "--"]
    points = []
    for i, streams in enumerate(args.streams):
        point = run_point(args, streams, args.port + i)
        print(json.dumps({k: v for k, v in point.items() if k not in ("loaded_over_time", "timeline")}), flush=True)
        points.append(point)
    Path(args.out).write_text(json.dumps({"settings": vars(args), "points": points}, indent=1))


if __name__ == "__main__":
    main()
