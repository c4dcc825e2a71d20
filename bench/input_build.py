"""Host time of building one step's inputs (InputBuilder.build) for decode batches, on this machine's CPU.

    python -m bench.input_build --out input_build.json

With async scheduling this work overlaps the device's previous step, so it is hidden only while it
stays shorter than a step; it grows with batch size and context length (block tables).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from worker.batch import ScheduledBatch, ScheduledSeq
from worker.ipc.messages import SamplingParams
from worker.model_runner.input_builder import InputBuilder
from worker.request import Request

CASES = [(1, 128), (32, 512), (64, 2048), (256, 1024)]     # (decode sequences, context tokens)
BLOCK_SIZE = 16


def decode_batch(num_seqs: int, context: int, num_slots: int) -> ScheduledBatch:
    blocks_per_seq = context // BLOCK_SIZE + 1
    seqs = []
    for i in range(num_seqs):
        request = Request(f"r{i}", list(range(context - 1)), SamplingParams(max_tokens=8), i, output_token_ids=[1])
        request.block_ids = list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
        seqs.append(ScheduledSeq(request, context - 1, 1, i % num_slots))
    return ScheduledBatch(seqs)


def time_build(num_seqs: int, context: int, repeats: int) -> float:
    """Median milliseconds of one build(), LoRA on (8 slots), after warm-up builds."""
    builder = InputBuilder(max_num_tokens=4096, max_num_seqs=max(num_seqs, 8), max_blocks_per_seq=context // BLOCK_SIZE + 2,
                           block_size=BLOCK_SIZE, device=torch.device("cpu"), lora_ranks_host=[16] * 8,
                           lora_ranks=torch.full((8,), 16))
    batch = decode_batch(num_seqs, context, 8)
    for _ in range(3):
        builder.build(batch)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        builder.build(batch)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows = [{"num_seqs": n, "context": c, "build_ms": time_build(n, c, args.repeats)} for n, c in CASES]
    for row in rows:
        print(f"{row['num_seqs']:>4} sequences x {row['context']:>5} tokens: {row['build_ms']:.3f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({"machine": platform.processor() or platform.machine(),
                                              "cpus": torch.get_num_threads(), "results": rows}, indent=2))


if __name__ == "__main__":
    main()
