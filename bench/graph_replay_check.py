"""Diagnose a fault seen three times in bench.decode_step: an illegal memory access while the batch-32,
32-adapter decode graph was replayed back to back (no input build between replays).

Found: decode_step gave its requests max_tokens = steps + 20, so while the last of the 32 adapters
loaded, the first requests admitted decoded to the end and finished; the last steps ran fewer than 32 rows
(a smaller graph bucket), and the timing replayed the 32-row graph over input rows no step had rebuilt:
block tables of -1 (refilled every step) under stale sequence lengths, read at negative offsets into the KV
cache. The engine never replays a graph without building every row it reads; the benches now keep every
request running and assert it.

This check builds the Llama-3.1-8B-shaped engine (dummy weights), runs decode_step's runs before it on the
same engine and then the b32_32lora16 decode steps, checks every graph input buffer on the host (ids,
positions, slots, block tables, LoRA segments, slot ranks) and replays the graph `--replays` times,
synchronising after every `--burst` replays (1: a fault is pinned to one replay; 51: back to back, as
decode_step times them). One variant per process (a fault ends the CUDA context):

    python -m bench.graph_replay_check --variant side-stream --out check.json
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from bench.decode_step import RUNS, build_engine, start_requests, time_decode
from bench.make_adapters import make_adapter
from worker.config import KernelConfig
from worker.arch import ArchConfig

VARIANTS = {"side-stream": {}, "in-line": dict(kernels=KernelConfig(lora_side_stream=False)),
            "sync-scheduling": dict(async_scheduling=False)}


def input_report(engine, batch: int) -> dict:
    """Host copies of what the graph reads, with the bounds each must respect."""
    d = engine.runner.input_builder.dev
    pool = engine.runner.lora_pool
    kv = engine.runner.kv_pool
    vocab = engine.runner.model.cfg.vocab_size
    host = {k: v[: batch + 1].cpu().tolist() for k, v in d.items() if k != "block_tables"}
    tables = d["block_tables"][:batch].cpu()
    ranks = pool.ranks.cpu().tolist()
    problems = []
    if max(host["input_ids"][:batch]) >= vocab or min(host["input_ids"][:batch]) < 0:
        problems.append("input id out of range")
    if max(tables.max().item(), 0) >= kv.num_blocks:
        problems.append("block table entry past the pool")
    if max(host["kv_slot_mapping"][:batch]) >= kv.num_blocks * engine.runner.kv_pool.block_size:
        problems.append("slot past the pool")
    if host["seg_indptr"][:batch + 1] != list(range(batch + 1)):
        problems.append("segments are not one per sequence")
    weights = host["seg_lora_slots"][:batch]
    if any(w >= pool.num_slots for w in weights) or any(w >= 0 and ranks[w] <= 0 for w in weights):
        problems.append("segment names an empty or missing slot")
    if any(r > pool.max_rank for r in ranks):
        problems.append("slot rank above the slot size")
    return {"problems": problems, "seg_lora_slots": weights, "ranks": ranks,
            "positions_max": max(host["positions"][:batch]), "seq_lens": host["seq_lens"][:batch],
            "ranks_host": list(pool.ranks_host)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench/configs/llama-3.1-8b")
    parser.add_argument("--variant", choices=list(VARIANTS), default="side-stream")
    parser.add_argument("--steps", type=int, default=55)
    parser.add_argument("--replays", type=int, default=300)
    parser.add_argument("--burst", type=int, default=1, help="replays between syncs (decode_step's timing: 51)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    arch = ArchConfig.from_dir(args.model)
    result: dict = {"variant": args.variant}
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        engine = build_engine(args.model, 32, 32, eager=False, **VARIANTS[args.variant])
        for i in range(32):
            engine.add_adapter(f"a{i}", str(make_adapter(Path(tmp) / f"a{i}", arch, 16, seed=i, device="cuda")))
        for name in ("b1_base", "b32_base", "b1_lora16"):      # what decode_step runs before, on the same engine
            time_decode(engine, *RUNS[name], steps=args.steps - 5)
        start_requests(engine, *RUNS["b32_32lora16"], "b")    # every request admitted and prefilled
        for step in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        # the graph replayed below reads rows 0-31 of the input buffers: the last step must have built all 32
        # (a smaller last batch leaves stale rows past its bucket, e.g. block tables of -1 under old lengths)
        assert engine.num_running == 32, "not all 32 requests are running"
        result["steps_ok"] = args.steps
        result["inputs"] = input_report(engine, 32)
        out.write_text(json.dumps(result, indent=1))
        graph = engine.runner.graph_runner.decode_graph(32, lora=True)
        for burst in range(args.replays // args.burst):
            result["replays_started"] = (burst + 1) * args.burst
            out.write_text(json.dumps(result, indent=1))
            for _ in range(args.burst):      # back to back, as decode_step times them; a sync after each burst
                graph.replay()
            torch.cuda.synchronize()
        result["replays_ok"] = args.replays // args.burst * args.burst
        out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
