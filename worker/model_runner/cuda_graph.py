"""Decode steps replayed from CUDA graphs, one per batch-size bucket, with the LoRA kernels inside.

Each bucket has two graphs: with LoRA (the shrink/expand kernels read the slot of every sequence
from device memory, so any adapter or rank mix replays without recapture) and without (no LoRA
launches when no sequence has an adapter). Inputs live in the input builder's persistent buffers.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from worker.batch import ScheduledBatch
from worker.model_runner.input_builder import InputBuilder

logger = logging.getLogger(__name__)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, then steps of 16 up to max_num_seqs (which is always a bucket)."""
    buckets = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    buckets += list(range(16, max_num_seqs, 16))
    return buckets + [max_num_seqs]


class CUDAGraphRunner:
    def __init__(self, model: nn.Module, kv_caches, input_builder: InputBuilder, max_num_seqs: int):
        self.model, self.kv_caches, self.inputs = model, kv_caches, input_builder
        self.buckets = graph_buckets(max_num_seqs)
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def can_run(self, batch: ScheduledBatch) -> bool:
        return (len(batch.seqs) <= self.buckets[-1]
                and all(s.num_new_tokens == 1 and s.samples for s in batch.seqs)
                and not any(s.request.params.prompt_logprobs is not None and s.start < s.request.num_prompt_tokens
                            for s in batch.seqs))

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        for bucket in reversed(self.buckets):        # largest first: smaller graphs reuse its memory pool
            for lora in (True, False):
                self.graphs[(bucket, lora)] = self._capture(bucket, lora)
        logger.info("captured %d CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs), self.buckets,
                    time.perf_counter() - start)

    def _capture(self, bucket: int, lora: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch = self.inputs.build(ScheduledBatch(), pad_to=bucket, lora=lora)
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):              # warm-up: Triton compiles and autotunes outside capture
            for _ in range(2):
                self.model(batch, self.kv_caches)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model(batch, self.kv_caches)   # [bucket, vocab]
        self.pool = graph.pool()
        return graph, logits

    def run(self, batch: ScheduledBatch, prev_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [num_seqs, vocab] of a decode batch, by replaying the smallest graph that fits;
        `prev_tokens` as for InputBuilder.build."""
        n = len(batch.seqs)
        bucket = next(b for b in self.buckets if b >= n)
        lora = any(s.lora_slot >= 0 for s in batch.seqs)
        self.inputs.build(batch, pad_to=bucket, lora=lora, prev_tokens=prev_tokens)
        graph, logits = self.graphs[(bucket, lora)]
        graph.replay()
        return logits[:n]


