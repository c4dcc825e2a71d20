"""Time the Triton paged attention on CUDA: decode (batch x context) and single-sequence prefill.

Llama-8B attention shapes (32 query heads, 8 KV heads, head_dim 128, block size 16), blocks shuffled
in the pool. Each timed call follows an L2 flush; the median over iterations is reported with the
achieved K/V-read bandwidth, and torch SDPA on contiguous (unpaged) K/V as a baseline.

    python3 -m bench.kernels_attention --out attention.json
    python3 -m bench.kernels_attention --step-sweep --out attention_step.json

`--step-sweep` times decode as a step runs it instead: one CUDA graph of 32 launches (a Llama-8B step's
layers), each over its own layer's K/V (so none is in L2), under each key-split count and tile config, at the
batch x context pairs of STEP_CASES; bandwidth = K/V bytes / time.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from bench.kernels_lora import graph_time_us
from worker.kernels import attention

logger = logging.getLogger(__name__)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DECODE = [(b, c) for b in (1, 32, 64) for c in (1024, 4096)]
PREFILL = [512, 2048]
LAYERS = 32
STEP_CASES = [(32, 192), (32, 1024), (64, 192), (16, 192), (1, 1024)]
STEP_SPLITS = (1, 2, 4, 8, 16)
STEP_TILES = [(16, n, w, s) for n, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3))]   # BLOCK_M, BLOCK_N, warps, stages


@dataclass
class Row:
    phase: str
    batch: int
    context: int
    ms: float
    kv_gb_per_s: float   # K/V bytes of all contexts read once / time
    tflops: float
    sdpa_ms: float       # torch SDPA on contiguous K/V, same shapes


class Case:
    """Paged inputs for `batch` sequences of `context` tokens, `new` of them queried."""

    def __init__(self, batch: int, context: int, new: int, dtype: torch.dtype):
        blocks = -(-context // BLOCK_SIZE)
        shape = (batch * blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, dtype=dtype, device="cuda")
        self.v_cache = torch.randn(shape, dtype=dtype, device="cuda")
        self.block_tables = torch.randperm(batch * blocks, device="cuda").int().view(batch, blocks)
        self.q = torch.randn(batch * new, NUM_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
        self.query_start_loc = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device="cuda")
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        self.out = torch.empty_like(self.q)
        self.batch, self.context, self.new = batch, context, new

    def run(self) -> None:
        attention.paged_attention(self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                                  self.seq_lens, HEAD_DIM ** -0.5, self.batch, self.new, out=self.out)

    def sdpa(self):
        """Closure running SDPA on the same K/V gathered into contiguous [batch, kv_heads, context, dim]."""
        def dense(cache: torch.Tensor) -> torch.Tensor:
            return cache[self.block_tables.long()].flatten(1, 2)[:, :self.context].transpose(1, 2).contiguous()
        k, v = dense(self.k_cache), dense(self.v_cache)
        q = self.q.view(self.batch, self.new, NUM_HEADS, HEAD_DIM).transpose(1, 2)
        causal = self.new > 1
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    def kv_bytes(self) -> int:
        return 2 * self.batch * self.context * NUM_KV_HEADS * HEAD_DIM * self.k_cache.element_size()

    def flops(self) -> float:
        pairs = self.new * self.context - self.new * (self.new - 1) / 2   # causal (query, key) pairs
        return 4.0 * self.batch * NUM_HEADS * HEAD_DIM * pairs


def median_ms(fn, iters: int) -> float:
    """Median GPU time of one call, replayed from a CUDA graph (as decode runs) after an L2 flush."""
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    fn()                                                  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()                                     # evict the K/V from L2; also hides the replay launch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(phase: str, case: Case, iters: int) -> Row:
    ms = median_ms(case.run, iters)
    sdpa_ms = median_ms(case.sdpa(), iters)
    return Row(phase, case.batch, case.context, ms, case.kv_bytes() / ms / 1e6, case.flops() / ms / 1e9, sdpa_ms)


def step_sweep(batch: int, context: int, dtype: torch.dtype, iters: int) -> dict:
    """Decode over LAYERS layers' K/V, one graph of `iters` launches cycling over them, under each split count
    (the kernel's own tiles) and each tile config (its own split count): us per launch and K/V GB/s."""
    layers = [Case(batch, context, 1, dtype) for _ in range(LAYERS)]
    own_splits = attention.default_num_kv_splits(batch, NUM_KV_HEADS, 1, torch.device("cuda"))
    own_tiles = attention.default_config(1, NUM_HEADS // NUM_KV_HEADS, torch.device("cuda"))

    def time_with(splits: int | None, tiles: tuple[int, int, int, int] | None = None) -> float:
        def call(case: Case) -> None:
            attention.paged_attention(case.q, case.k_cache, case.v_cache, case.block_tables, case.query_start_loc,
                                      case.seq_lens, HEAD_DIM ** -0.5, batch, 1, out=case.out, num_kv_splits=splits,
                                      config=tiles)
        return graph_time_us([lambda c=c: call(c) for c in layers], iters)

    def entry(us: float) -> dict:
        return {"us": round(us, 2), "GBps": round(layers[0].kv_bytes() / us / 1e3, 1)}

    result = {"batch": batch, "context": context, "own_splits": own_splits, "own_tiles": list(own_tiles),
              "own": entry(time_with(None)), "splits": {}, "tiles": []}
    for splits in STEP_SPLITS:
        result["splits"][splits] = entry(time_with(splits))
    for tiles in STEP_TILES:
        for splits in sorted({1, 2, own_splits}):
            result["tiles"].append([list(tiles), splits, entry(time_with(splits, tiles))])
    best = min(result["tiles"], key=lambda row: row[2]["us"])
    result["best"] = {"tiles": best[0], "splits": best[1], **best[2]}
    logger.info("decode %d x %d: own %s (splits %d), by splits %s, best %s", batch, context, result["own"],
                own_splits, {s: e["us"] for s, e in result["splits"].items()}, result["best"])
    layers.clear()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="attention_bench.json")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--step-sweep", action="store_true", help="decode over a step's layers, splits and tiles")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels_attention.py needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    if args.step_sweep:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        results = []
        for batch, context in STEP_CASES:     # the file is rewritten after each case: a cut-off run keeps it
            results.append(step_sweep(batch, context, dtype, LAYERS))
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "dtype": args.dtype, "step": results}, f,
                          indent=1)
        return
    rows = [measure("decode", Case(b, c, 1, dtype), args.iters) for b, c in DECODE]
    rows += [measure("prefill", Case(1, n, n, dtype), args.iters) for n in PREFILL]
    print(f"{'phase':8} {'batch':>5} {'context':>7} {'ms':>8} {'KV GB/s':>8} {'TFLOP/s':>8} {'sdpa ms':>8}")
    for r in rows:
        print(f"{r.phase:8} {r.batch:5d} {r.context:7d} {r.ms:8.4f} {r.kv_gb_per_s:8.0f} {r.tflops:8.1f} "
              f"{r.sdpa_ms:8.4f}")
    device = torch.cuda.get_device_name()
    with open(args.out, "w") as f:
        json.dump({"device": device, "dtype": args.dtype, "torch": torch.__version__,
                   "rows": [asdict(r) for r in rows]}, f, indent=2)


if __name__ == "__main__":
    main()
