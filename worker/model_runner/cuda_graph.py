"""Steps replayed from CUDA graphs, with the LoRA kernels inside.

Decode batches replay a graph per batch-size bucket. Batches with prefill tokens (prefills, chunked
prefills and the decodes running beside them) replay a graph per token-count bucket, padded to its token
count and to min(max_num_seqs, tokens) sequences: the attention and LoRA kernels of such batches launch
one program per row tile that exists (kernels/row_tiles.py), so a graph fixes only the two counts and serves
any split of its tokens into sequences and adapter segments. Batches past the largest token bucket, and
those that want prompt logprobs, run eagerly.

Each bucket has two graphs: with LoRA (the shrink/expand kernels read the slot of every segment
from device memory, so any adapter or rank mix replays without recapture) and without (no LoRA
launches when no sequence has an adapter). Mixed graphs of at most `tile_map_max_tokens` tokens run their
LoRA kernels over 16-row tiles from the input builder's tile map, the shrink split over K (the decode rows
beside a prefill are grouped by adapter too). Decode buckets of at least `grouped_min_rows` sequences have a
third: LoRA over rows grouped by adapter (one segment per adapter's run of rows, the scheduler ordering rows
by slot; row tiles from the input builder's tile map, K split in the shrink), which a batch replays when its
rows average two or more per segment: each tile then reads its adapter's A and B once for all its rows,
where the per-row graph reads them once per row. Inputs live in the input builder's persistent buffers; every
graph writes its logits into one shared buffer ([max_num_seqs, vocab] float32), so the graphs' pool holds
one graph's working set, not one set of logits per graph (what the memory plan reserves).
"""
from __future__ import annotations

import gc
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


def grouped_buckets(max_num_seqs: int, min_rows: int) -> list[int]:
    """The decode buckets of at least min_rows sequences (0: none), which get a grouped-LoRA graph."""
    return [b for b in graph_buckets(max_num_seqs) if min_rows > 0 and b >= min_rows]


def mixed_token_buckets(max_tokens: int) -> list[int]:
    """16, 32, then steps of 32 up to 512 and of 64 above, up to max_tokens (always a bucket): from ~256
    tokens a step is bound by compute, and padding adds at most an eighth of the tokens past 256."""
    if max_tokens <= 0:
        return []
    buckets = [b for b in (16, 32) if b < max_tokens]
    buckets += list(range(64, min(max_tokens, 512), 32))
    buckets += list(range(512, max_tokens, 64))
    return buckets + [max_tokens]


class CUDAGraphRunner:
    def __init__(self, model: nn.Module, kv_caches, input_builder: InputBuilder, max_num_seqs: int,
                 max_mixed_tokens: int = 0, grouped_min_rows: int = 0, tile_map_max_tokens: int = 0):
        self.model, self.kv_caches, self.inputs = model, kv_caches, input_builder
        self.buckets = graph_buckets(max_num_seqs)
        self.grouped_buckets = grouped_buckets(max_num_seqs, grouped_min_rows)
        self.tile_map_max_tokens = tile_map_max_tokens     # mixed graphs up to this many tokens: LoRA tile maps
        self.max_num_seqs = max_num_seqs
        self.token_buckets = mixed_token_buckets(max_mixed_tokens)
        # (kind, size, lora) -> (graph, its logits); kind "decode" (size: sequences) or "mixed" (size: tokens);
        # lora: False, True (one segment per sequence, or per run of a slot in a mixed batch) or "grouped"
        self.graphs: dict[tuple[str, int, bool | str], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = {"decode": 0, "mixed": 0, "grouped": 0}
        self.last_replay = ""        # what run() replayed last: "decode", "grouped" (a decode graph) or "mixed"
        self.pool = None
        self.logits = None          # [max_num_seqs, vocab] float32, allocated at the first capture

    @staticmethod
    def num_graphs(max_num_seqs: int, max_mixed_tokens: int, grouped_min_rows: int = 0) -> int:
        """How many graphs capture() makes (two per bucket: with and without LoRA; a third for the grouped
        decode buckets)."""
        return (2 * (len(graph_buckets(max_num_seqs)) + len(mixed_token_buckets(max_mixed_tokens)))
                + len(grouped_buckets(max_num_seqs, grouped_min_rows)))

    def mixed_seqs(self, tokens: int) -> int:
        """Sequences a mixed graph of `tokens` tokens is padded to: every sequence has a token."""
        return min(self.max_num_seqs, tokens)

    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        # largest first: smaller graphs reuse its memory pool
        shapes = [("mixed", t) for t in reversed(self.token_buckets)] + [("decode", b) for b in reversed(self.buckets)]
        # No cyclic GC while capturing: garbage it frees then (a dropped engine's CUDA graphs, events) makes CUDA
        # calls a capture does not permit, which invalidate it. Collect now, and again only once it is over.
        gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            for kind, size in shapes:
                modes = (True, False, "grouped") if kind == "decode" and size in self.grouped_buckets else (True, False)
                for lora in modes:
                    self.graphs[(kind, size, lora)] = self._capture(kind, size, lora)
        finally:
            if gc_was_enabled:
                gc.enable()
        logger.info("captured %d CUDA graphs (decode batch sizes %s, mixed-batch token counts %s) in %.1f s",
                    len(self.graphs), self.buckets, self.token_buckets, time.perf_counter() - start)

    def _build(self, kind: str, size: int, batch: ScheduledBatch, lora: bool | str, prev_tokens=None):
        if kind == "decode":
            return self.inputs.build(batch, pad_to=size, lora=bool(lora), prev_tokens=prev_tokens,
                                     grouped=lora == "grouped")
        return self.inputs.build(batch, lora=lora, prev_tokens=prev_tokens, mixed_pad=(size, self.mixed_seqs(size)),
                                 grouped=size <= self.tile_map_max_tokens)

    def _capture(self, kind: str, size: int, lora: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch = self._build(kind, size, ScheduledBatch(), lora)
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):              # warm-up: Triton compiles and autotunes outside capture
            for _ in range(2):
                self.model(batch, self.kv_caches)
        torch.cuda.current_stream().wait_stream(stream)
        if self.logits is None:
            vocab = self.model.cfg.vocab_size          # the whole vocabulary: a sharded LM head gathers it
            self.logits = torch.empty(self.max_num_seqs, vocab, dtype=torch.float32, device=batch.input_ids.device)
        rows = len(batch.logits_indices)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model(batch, self.kv_caches, out=self.logits[:rows])   # [sequences, vocab]
        self.pool = graph.pool()
        return graph, logits

    def shape_for(self, batch: ScheduledBatch) -> tuple[str, int] | None:
        """(kind, size) of the graph that runs `batch`, None when it runs eagerly."""
        if any(s.request.params.prompt_logprobs is not None and s.start < s.request.num_prompt_tokens
               for s in batch.seqs):
            return None
        if len(batch.seqs) <= self.buckets[-1] and all(s.num_new_tokens == 1 and s.samples for s in batch.seqs):
            return "decode", next(b for b in self.buckets if b >= len(batch.seqs))
        tokens = batch.num_tokens
        size = next((t for t in self.token_buckets if t >= tokens), None)
        if size is None or len(batch.seqs) > self.mixed_seqs(size):
            return None
        return "mixed", size

    def _lora_mode(self, kind: str, size: int, batch: ScheduledBatch) -> bool | str:
        """False without adapters; "grouped" for a decode batch whose rows average two or more per run of one
        slot (and whose bucket has the graph); else True."""
        if not batch.lora_slots:
            return False
        if kind != "decode" or size not in self.grouped_buckets:
            return True
        runs = 1 + sum(a.lora_slot != b.lora_slot for a, b in zip(batch.seqs, batch.seqs[1:]))
        grouped = 2 * runs <= len(batch.seqs) and runs < self.inputs.grouped_segments(size)
        return "grouped" if grouped else True

    def decode_graph(self, num_seqs: int, lora: bool | str) -> torch.cuda.CUDAGraph:
        """The decode graph that runs batches of `num_seqs` sequences, with or without LoRA ("grouped": the
        grouped-LoRA graph of the bucket). A replay reads whatever the latest build left in the input buffers
        (bench.decode_step times the device work alone)."""
        bucket = next(b for b in self.buckets if b >= num_seqs)
        return self.graphs[("decode", bucket, lora)][0]

    def run(self, batch: ScheduledBatch, prev_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [num_sampling_seqs, vocab] of the batch, by replaying the smallest graph that fits; None
        (nothing enqueued) when the batch must run eagerly. `prev_tokens` as for InputBuilder.build."""
        shape = self.shape_for(batch)
        if shape is None:
            return None
        lora = self._lora_mode(*shape, batch)
        self._build(*shape, batch, lora, prev_tokens)
        graph, logits = self.graphs[(*shape, lora)]
        graph.replay()
        self.replays[shape[0]] += 1
        self.replays["grouped"] += lora == "grouped"
        self.last_replay = "grouped" if lora == "grouped" else shape[0]
        return logits[:sum(s.samples for s in batch.seqs)]
