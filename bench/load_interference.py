"""What host-side adapter work does to the step loop: a decode-like step (inputs copied in, a CUDA graph replayed,
outputs copied out, the host waiting for them) timed while a background thread does one kind of work at a time.

    python -m bench.load_interference --out /tmp/interference.json

Each activity runs for --seconds on `--threads` threads beside the steps: nothing; pinned allocations through torch
(`pin_memory=True`, fresh blocks kept alive, as per-adapter host entries are made); pageable allocations written
once (page faults); pageable buffers page-locked with cudaHostRegister, per entry and in 1 GiB chunks; copies into
memory page-locked beforehand; file reads (os.preadv) into pageable buffers. Reports the step's wall time (p50, p90,
p99, max) under each, beside the idle loop's, and each activity's rate in GB/s.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import tempfile
import threading
import time

import numpy as np
import torch

MiB = 1 << 20


def make_step(device: torch.device, layers: int, width: int, host_maps: int = 0):
    """A graph of `layers` (x @ W) products, about an 8-stream decode step of a mid-size model, with its
    host-to-device input copy and device-to-host output copy."""
    ws = [torch.randn(width, width, device=device, dtype=torch.bfloat16) / width ** 0.5 for _ in range(layers)]
    x = torch.zeros(8, width, device=device, dtype=torch.bfloat16)
    inp = torch.zeros(8, width, dtype=torch.bfloat16).pin_memory()
    out = torch.zeros(8, width, dtype=torch.bfloat16).pin_memory()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            y = x
            for w in ws:
                y = y @ w
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x
        for w in ws:
            y = y @ w
    done = torch.cuda.Event()

    def step() -> None:
        for _ in range(host_maps):           # what a step's host allocations past malloc's mmap threshold do
            m = mmap.mmap(-1, 1 << 20)
            m[0] = 1
            m.close()
        x.copy_(inp, non_blocking=True)
        graph.replay()
        out.copy_(y, non_blocking=True)
        done.record()
        done.synchronize()
    return step


def activities(entry_bytes: int, limit_bytes: int, path: str):
    cudart = torch.cuda.cudart()
    arena = torch.empty(256 * MiB, dtype=torch.uint8).pin_memory()
    source = np.random.default_rng(0).integers(0, 255, entry_bytes, dtype=np.uint8)

    def pinned_torch(kept):
        kept.append(torch.empty(entry_bytes, dtype=torch.uint8, pin_memory=True))
        return entry_bytes

    def pageable_touch(kept):
        a = np.empty(entry_bytes, dtype=np.uint8)
        a[:] = 0
        kept.append(a)
        return entry_bytes

    def register_pieces(kept):
        memory = mmap.mmap(-1, entry_bytes)
        memory.madvise(mmap.MADV_HUGEPAGE)
        t = torch.frombuffer(memory, dtype=torch.uint8)
        t.numpy()[::4096] = 0
        for start in range(0, entry_bytes, 2 * MiB):
            n = min(2 * MiB, entry_bytes - start)
            assert int(cudart.cudaHostRegister(t.data_ptr() + start, n, 0)) == 0
        kept.append(t)
        return entry_bytes

    def register(size, huge=False, unregister=False):
        def act(kept):
            memory = mmap.mmap(-1, size)
            if huge:
                memory.madvise(mmap.MADV_HUGEPAGE)
            t = torch.frombuffer(memory, dtype=torch.uint8)
            t.numpy()[::4096] = 0
            assert int(cudart.cudaHostRegister(t.data_ptr(), size, 0)) == 0
            if unregister:
                cudart.cudaHostUnregister(t.data_ptr())
            else:
                kept.append(t)
            return size
        return act

    def copy_pinned(kept):
        a = arena.numpy()
        off = (len(kept) * entry_bytes) % (arena.numel() - entry_bytes)
        np.copyto(a[off:off + entry_bytes], source)
        kept.append(None)
        return entry_bytes

    def file_reads(kept):
        a = np.empty(entry_bytes, dtype=np.uint8)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [memoryview(a)], 0)
        finally:
            os.close(fd)
        kept.append(a)
        return entry_bytes

    return {"pinned_torch": pinned_torch, "pageable_touch": pageable_touch, "register_entry": register(entry_bytes),
            "register_entry_huge": register(entry_bytes, huge=True), "register_256mib": register(256 * MiB),
            "register_256mib_huge": register(256 * MiB, huge=True),
            "register_unregister_entry": register(entry_bytes, unregister=True),
            "register_1gib": register(1 << 30), "register_pieces": register_pieces, "copy_into_pinned": copy_pinned, "file_reads": file_reads}


def run_activity(step, act, seconds: float, threads: int, limit_bytes: int) -> dict:
    stop = threading.Event()
    moved = [0] * threads
    kept: list = []
    lock = threading.Lock()

    def work(i: int) -> None:
        while not stop.is_set():
            with lock:
                if sum(moved) >= limit_bytes:
                    break
            mine: list = []
            moved[i] += act(mine)
            with lock:
                kept.extend(mine)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)] if act else []
    for w in workers:
        w.start()
    times = []
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    stop.set()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    q = statistics.quantiles(times, n=100)
    return {"steps": len(times), "p50_ms": q[49] * 1e3, "p90_ms": q[89] * 1e3, "p99_ms": q[98] * 1e3,
            "max_ms": max(times) * 1e3, "mean_ms": statistics.fmean(times) * 1e3,
            "activity_gb_s": sum(moved) / elapsed / 1e9, "activity_bytes": sum(moved)}, kept


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--entry-mib", type=float, default=40.0)
    p.add_argument("--limit-gib", type=float, default=12.0)
    p.add_argument("--layers", type=int, default=64)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4])
    p.add_argument("--only", nargs="*", help="the activities to run (default: all)")
    p.add_argument("--host-maps", type=int, default=0, help="anonymous 1 MiB maps made and unmapped by each step")
    args = p.parse_args()
    device = torch.device("cuda")
    step = make_step(device, args.layers, args.width, args.host_maps)
    entry = int(args.entry_mib * MiB)
    with tempfile.NamedTemporaryFile(dir="/tmp", delete=False) as f:
        f.write(os.urandom(entry))
        path = f.name
    print("transparent huge pages:", open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(), flush=True)
    acts = activities(entry, int(args.limit_gib * (1 << 30)), path)
    results = {"idle": run_activity(step, None, args.seconds, 0, 0)[0]}
    print("idle", results["idle"], flush=True)
    for name, act in acts.items():
        if args.only and name not in args.only:
            continue
        for threads in args.threads:
            key = f"{name}/{threads}"
            res, kept = run_activity(step, act, args.seconds, threads, int(args.limit_gib * (1 << 30)))
            results[key] = res
            print(key, {k: round(v, 3) for k, v in res.items()}, flush=True)
            if name.startswith("register"):
                for t in kept:
                    if t is None:
                        continue
                    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
            del kept
            if name == "pinned_torch" and hasattr(torch._C, "_host_emptyCache"):
                torch._C._host_emptyCache()      # give the cached pinned blocks back
    results["idle_again"] = run_activity(step, None, args.seconds, 0, 0)[0]
    results["settings"] = vars(args) | {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    os.unlink(path)


if __name__ == "__main__":
    main()
