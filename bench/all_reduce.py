"""GPU micro-benchmark of the tensor-parallel all-reduce: NCCL against the one-shot sum over symmetric memory
(worker/distributed/all_reduce.py, summed by kernels/one_shot_all_reduce.py), 2 ranks spawned with
torch.multiprocessing on GPUs 0 and 1 (MASTER_ADDR=127.0.0.1, NVLink multicast off).

For [rows, hidden] bf16, rows in --rows and hidden in --hidden, the time of one call (us, the slower rank's):
- nccl_eager: dist.all_reduce launched from Python, --iters calls back to back timed with CUDA events;
- nccl_graph: 64 all-reduces back to back (a Llama-8B decode step's) captured in one CUDA graph, --replays
  replays timed with CUDA events, divided by the calls;
- one_shot_eager, one_shot_graph: the same through `AllReduce`, its threshold at its buffer (always one-shot).
Inputs are zeros, so sums taken in place again and again stay finite. Per hidden size, the crossover: the smallest
message from which NCCL's graph time beats the one-shot kernel's, and `threshold_bytes`, the largest message below
it (what the runner should give AllReduce).
--check first asserts that one-shot sums of random inputs equal NCCL's, eager and replayed from a graph with new
inputs copied in: float32 within 1e-6, bf16 the same bits on both ranks and within one bf16 rounding of the
float32 sum.

    python3 -m bench.all_reduce --out all_reduce.json [--check]
"""
from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from worker.distributed.all_reduce import AllReduce, one_shot_fits

logger = logging.getLogger(__name__)

WORLD_SIZE = 2
GRAPH_CALLS = 64
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
VARIANTS = ("nccl_eager", "nccl_graph", "one_shot_eager", "one_shot_graph")
CHECK_REPLAYS = 3
BF16_RTOL = 2 ** -8 + 2 ** -20          # one rounding to bf16 (unit roundoff 2^-8), over a float32 reference


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def align_ranks(device: torch.device) -> None:
    """Both ranks idle and past this point before a timing starts."""
    torch.cuda.synchronize()
    dist.all_reduce(torch.zeros(1, device=device))
    torch.cuda.synchronize()


def slowest(us: float, device: torch.device) -> float:
    t = torch.tensor([us], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return round(t.item(), 2)


def eager_us(call: Callable[[], object], iters: int, device: torch.device) -> float:
    call()
    align_ranks(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        call()
    end.record()
    end.synchronize()
    return slowest(start.elapsed_time(end) * 1e3 / iters, device)


def capture(calls: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`calls` run once on a side stream (warm-up), then captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        calls()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return graph


def graph_us(call: Callable[[], object], replays: int, device: torch.device) -> float:
    graph = capture(lambda: [call() for _ in range(GRAPH_CALLS)])
    graph.replay()
    align_ranks(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return slowest(start.elapsed_time(end) * 1e3 / (replays * GRAPH_CALLS), device)


def time_case(ar: AllReduce, rows: int, hidden: int, args: argparse.Namespace, device: torch.device) -> dict:
    """One row of the table."""
    x = torch.zeros(rows, hidden, dtype=torch.bfloat16, device=device)
    result = {"rows": rows, "hidden": hidden, "bytes": x.numel() * x.element_size()}
    result["nccl_eager"] = eager_us(lambda: dist.all_reduce(x), args.iters, device)
    result["nccl_graph"] = graph_us(lambda: dist.all_reduce(x), args.replays, device)
    one_shot = ar.uses_one_shot(x)
    call = functools.partial(ar, x)
    result["one_shot_eager"] = eager_us(call, args.iters, device) if one_shot else None
    result["one_shot_graph"] = graph_us(call, args.replays, device) if one_shot else None
    return result


def crossover(results: list[dict], hidden: int) -> dict:
    """The smallest message (bytes) from which NCCL in a graph beats the one-shot kernel in a graph (None: never,
    over the sizes timed), and threshold_bytes, the largest message timed below it."""
    column = "one_shot_graph"
    timed = sorted((r for r in results if r["hidden"] == hidden and r[column] is not None),
                   key=lambda r: r["bytes"])
    nccl_from = next((r["bytes"] for r in timed if r["nccl_graph"] < r[column]), None)
    below = [r["bytes"] for r in timed if nccl_from is None or r["bytes"] < nccl_from]
    return {"nccl_wins_from_bytes": nccl_from, "threshold_bytes": max(below, default=0)}


def assert_sum(result: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    """result: one-shot's sum; reference: NCCL's float32 sum of the same inputs. bf16 results are also compared
    across ranks, bit for bit."""
    rtol = 1e-6 if result.dtype == torch.float32 else BF16_RTOL
    torch.testing.assert_close(result.float(), reference, rtol=rtol, atol=0, msg=lambda m: f"{what}: {m}")
    gathered = [torch.empty_like(result) for _ in range(WORLD_SIZE)]
    dist.all_gather(gathered, result.contiguous())
    assert all(torch.equal(gathered[0], g) for g in gathered), f"{what}: ranks hold different sums"


def graph_of_one_call(ar: AllReduce, x: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph summing what x holds when it is replayed, and the tensor it writes the sum to."""
    out = []
    graph = capture(lambda: out.append(ar(x.clone())))
    return graph, out[-1]


def check(ar: AllReduce, shapes: list[tuple[int, int]], rank: int, device: torch.device) -> None:
    """One-shot (through `ar`) against NCCL on random inputs, eager and from a graph replayed with new
    inputs (raises on a mismatch)."""
    g = torch.Generator(device).manual_seed(1 + rank)
    for dtype in (torch.float32, torch.bfloat16):
        for shape in shapes:
            one_shot = one_shot_fits(shape[0] * shape[1] * dtype.itemsize, dtype, ar.threshold_bytes)
            what = f"{dtype} {list(shape)} one_shot={one_shot}"
            x = torch.randn(shape, generator=g, device=device).to(dtype)
            reference = x.to(torch.float32, copy=True)      # NCCL sums it in place
            dist.all_reduce(reference)
            assert_sum(ar(x.clone()), reference, f"{what} eager")
            graph, out = graph_of_one_call(ar, x)
            for replay in range(CHECK_REPLAYS):
                x.copy_(torch.randn(shape, generator=g, device=device))
                reference = x.to(torch.float32, copy=True)
                dist.all_reduce(reference)
                graph.replay()
                assert_sum(out, reference, f"{what} graph replay {replay}")
    logger.info("rank %d: one-shot sums equal NCCL's", rank)


def run_rank(rank: int, port: int, args: argparse.Namespace) -> None:
    """Entry point of a spawned rank; rank 0 writes args.out after each case and prints the table."""
    os.environ.update(MULTICAST_OFF, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        dist.all_reduce(torch.zeros(1, device=device))           # NCCL's communicator, before any capture
        shapes = [(rows, hidden) for hidden in args.hidden for rows in args.rows]
        max_bytes = max(rows * hidden for rows, hidden in shapes) * 4     # the largest message, even in float32
        ar = AllReduce(dist.group.WORLD, device, max_bytes=max_bytes, threshold_bytes=max_bytes)
        if ar.buffer is None:
            logger.warning("no one-shot all-reduce here: its columns stay empty")
        elif args.check:
            check(ar, shapes, rank, device)
        results = []
        for rows, hidden in shapes:
            results.append(time_case(ar, rows, hidden, args, device))
            payload = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version())), "graph_calls": GRAPH_CALLS,
                       "results": results,
                       "crossover": {h: crossover(results, h) for h in args.hidden}}
            if rank == 0:
                with open(args.out, "w") as f:
                    json.dump(payload, f, indent=1)
        if rank == 0:
            print_table(payload)
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
    finally:
        dist.destroy_process_group()


def print_table(payload: dict) -> None:
    print(f"{payload['device']}, torch {payload['torch']}, NCCL {payload['nccl']}: us per all-reduce")
    print(f"{'hidden':>6} {'rows':>5} {'KiB':>7} " + " ".join(f"{v:>14}" for v in VARIANTS))
    for r in payload["results"]:
        cells = " ".join(f"{'-' if r[v] is None else r[v]:>14}" for v in VARIANTS)
        print(f"{r['hidden']:>6} {r['rows']:>5} {r['bytes'] / 1024:>7g} {cells}")
    for hidden, c in payload["crossover"].items():
        print(f"hidden {hidden}: NCCL wins from {c['nccl_wins_from_bytes']} bytes; "
              f"threshold_bytes={c['threshold_bytes']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512])
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--iters", type=int, default=200, help="eager calls per timing")
    parser.add_argument("--replays", type=int, default=20, help="graph replays per timing")
    parser.add_argument("--check", action="store_true", help="first assert one-shot sums equal NCCL's")
    args = parser.parse_args()
    if torch.cuda.device_count() < WORLD_SIZE:
        raise SystemExit(f"bench.all_reduce needs {WORLD_SIZE} CUDA devices")
    os.environ.update(MULTICAST_OFF)
    mp.spawn(run_rank, args=(free_port(), args), nprocs=WORLD_SIZE, join=True)


if __name__ == "__main__":
    main()
