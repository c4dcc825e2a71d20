"""GPU micro-benchmark of the LoRA shrink + expand kernels at Llama-8B projection shapes.

Each kernel is captured `--iters` times in a CUDA graph (no launch overhead in the timing) and timed
with CUDA events after a warm-up replay. Achieved bandwidth = bytes that must move / time, where the
bytes are x, the A and B rows of the adapters the batch uses (at their own rank), xa written and read
(at the used rank), and y read and written.

    python3 -m bench.kernels_lora --out lora_kernels.json
    python3 -m bench.kernels_lora --sweep --out sweep.json    # block-size candidates at decode shapes
"""
from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from worker.kernels.lora_expand import lora_expand
from worker.kernels.lora_shrink import lora_shrink

logger = logging.getLogger(__name__)

PROJECTIONS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
               "down": (14336, (4096,))}


@dataclass(frozen=True)
class Case:
    projection: str
    seg_lens: tuple[int, ...]   # tokens of each segment
    num_adapters: int           # segments cycle over this many adapters
    rank: int                   # every adapter's rank (slots are sized to max_rank)
    max_rank: int = 128

    @property
    def name(self) -> str:
        longest = max(self.seg_lens)
        kind = "decode" if longest == 1 else "short" if longest <= 16 else "prefill"
        return f"{self.projection}-{kind}-t{sum(self.seg_lens)}-a{self.num_adapters}-r{self.rank}-R{self.max_rank}"


CASES = [
    Case("qkv", (1,), 1, 16),
    Case("qkv", (1,) * 32, 32, 16),
    Case("qkv", (1,) * 32, 32, 16, max_rank=16),
    Case("qkv", (1,) * 32, 32, 128),
    Case("qkv", (1,) * 64, 8, 64),
    Case("qkv", (4,) * 8, 8, 16),
    Case("gate_up", (1,) * 32, 32, 16),
    Case("gate_up", (1,) * 32, 32, 16, max_rank=16),
    Case("down", (1,) * 32, 32, 16),
    Case("qkv", (512,), 1, 16),
    Case("qkv", (128,) * 4, 4, 64),
    Case("gate_up", (512,), 1, 16),
    Case("gate_up", (512,), 1, 16, max_rank=16),
    Case("down", (256, 1, 1, 1, 1, 128), 6, 32),
]


@dataclass
class Result:
    case: str
    tokens: int
    adapters: int
    rank: int
    shrink_us: float
    expand_us: float
    total_us: float
    bytes: int
    gbps: float


def graph_time_us(fns: list[Callable[[], object]], iters: int, finish: Callable[[], object] | None = None) -> float:
    """Mean time of one call, `iters` calls cycling over fns, captured in one CUDA graph (each fn is run
    once before capture: compiles Triton kernels, warms cuBLAS); `finish` runs once after the calls (in the
    graph: joining streams the calls forked)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()
        if finish is not None:
            finish()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(iters):
            fns[i % len(fns)]()
        if finish is not None:
            finish()
    graph.replay()                                     # warm-up
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _bytes_moved(case: Case, in_dim: int, out_dim: int, num_slices: int, elem: int) -> int:
    tokens, used = sum(case.seg_lens), min(case.num_adapters, len(case.seg_lens))
    x = tokens * in_dim
    a = used * num_slices * case.rank * in_dim
    xa = 2 * tokens * num_slices * case.rank        # written by shrink, read by expand
    b = used * out_dim * case.rank
    y = 2 * tokens * out_dim                        # read and written by expand
    return (x + a + xa + b + y) * elem


def run_case(case: Case, dtype: torch.dtype, iters: int, shrink_config: dict | None = None,
             expand_config: dict | None = None) -> Result:
    """Times the case's shrink, expand and both; the configs are passed to the kernels (None: their own)."""
    in_dim, widths = PROJECTIONS[case.projection]
    ns, R, dev = len(widths), case.max_rank, torch.device("cuda")
    offsets = [0]
    for w in widths:
        offsets.append(offsets[-1] + w)
    tokens, num_segments = sum(case.seg_lens), len(case.seg_lens)
    indptr = [0]
    for n in case.seg_lens:
        indptr.append(indptr[-1] + n)
    seg_indptr = torch.tensor(indptr, dtype=torch.int32, device=dev)
    weights = torch.tensor([i % case.num_adapters for i in range(num_segments)], dtype=torch.int32, device=dev)
    ranks = torch.full((case.num_adapters,), case.rank, dtype=torch.int32, device=dev)
    scalings = torch.ones(case.num_adapters, ns, device=dev)
    x = torch.randn(tokens, in_dim, dtype=dtype, device=dev)
    a = torch.randn(case.num_adapters, ns * R, in_dim, dtype=dtype, device=dev) * in_dim ** -0.5
    b = torch.randn(case.num_adapters, offsets[-1], R, dtype=dtype, device=dev) * 1e-3
    y = torch.randn(tokens, offsets[-1], dtype=dtype, device=dev)
    xa = torch.empty(tokens, ns * R, dtype=dtype, device=dev)
    max_len = max(case.seg_lens)

    def shrink() -> None:
        lora_shrink(x, a, seg_indptr, weights, ranks, ns, num_segments, max_len, out=xa, config=shrink_config)

    def expand() -> None:
        lora_expand(y, xa, b, seg_indptr, weights, ranks, scalings, offsets, num_segments, max_len,
                    config=expand_config)

    def both() -> None:
        shrink()
        expand()

    shrink_us, expand_us, total_us = (graph_time_us([fn], iters) for fn in (shrink, expand, both))
    moved = _bytes_moved(case, in_dim, offsets[-1], ns, x.element_size())
    return Result(case.name, tokens, case.num_adapters, case.rank, round(shrink_us, 2), round(expand_us, 2),
                  round(total_us, 2), moved, round(moved / total_us / 1e3, 1))


SWEEP_CASES = [Case(p, (1,) * n, n, 16, max_rank=16) for n in (1, 32) for p in ("qkv", "o", "gate_up", "down")]
SWEEP_EXPAND = [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_R=16, BLOCK_R_HIGH=16, num_warps=w, num_stages=2)
                for m in (1, 16) for n in (64, 128, 256, 512) for w in (4, 8)]
SWEEP_SHRINK = [dict(BLOCK_M=1, BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=3)
                for n in (2, 4, 8, 16) for k in (512, 1024, 2048) for w in (4,)]


def sweep(case: Case, dtype: torch.dtype, iters: int) -> dict:
    """Time shrink and expand alone under each candidate block config."""
    timings: dict[str, list] = {"shrink": [], "expand": []}
    for cfg in SWEEP_SHRINK:
        timings["shrink"].append((cfg, run_case(case, dtype, iters, shrink_config=cfg).shrink_us))
    for cfg in SWEEP_EXPAND:
        timings["expand"].append((cfg, run_case(case, dtype, iters, expand_config=cfg).expand_us))
    best = {kind: min(rows, key=lambda row: row[1]) for kind, rows in timings.items()}
    logger.info("%s: best shrink %s %.2f us, best expand %s %.2f us", case.name, *best["shrink"], *best["expand"])
    return {"case": case.name, "best": best, "timings": timings}


def _table(results: list[Result]) -> str:
    head = f"{'case':<40}{'shrink us':>10}{'expand us':>10}{'total us':>10}{'MB':>8}{'GB/s':>8}"
    rows = [f"{r.case:<40}{r.shrink_us:>10.2f}{r.expand_us:>10.2f}{r.total_us:>10.2f}"
            f"{r.bytes / 1e6:>8.2f}{r.gbps:>8.1f}" for r in results]
    return "\n".join([head, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--iters", type=int, default=200, help="launches per timed CUDA graph")
    parser.add_argument("--sweep", action="store_true", help="time block-size candidates at decode shapes instead")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernels_lora needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    if args.sweep:
        sweeps = []
        for case in SWEEP_CASES:   # the file is rewritten after each case, so a cut-off run keeps what it has
            sweeps.append(sweep(case, dtype, 50))
            _write(args.out, dtype=args.dtype, sweeps=sweeps)
        return
    results = []
    for case in CASES:
        results.append(run_case(case, dtype, args.iters))
        logger.info("done %s", case.name)
    print(_table(results))
    _write(args.out, dtype=args.dtype, iters=args.iters, results=[asdict(r) for r in results])


def _write(path: str, **payload) -> None:
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), **payload}, f, indent=2)


if __name__ == "__main__":
    main()
