"""ModelRunner: owns the device side (weights, KV pool, LoRA slot pool, sampler) and launches steps."""
from __future__ import annotations

import dataclasses
import gc
import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from worker.batch import ScheduledBatch, ScheduledSeq
from worker.config import WorkerConfig
from worker.distributed.tensor_parallel import SINGLE, TensorParallel
from worker.gc_pauses import PAUSES, GCPauses
from worker.ipc.messages import SamplingParams, TokenLogprob
from worker.kv_cache.kv_pool import KVPool, bytes_per_block, fixed_num_blocks, kv_cache_dtype
from worker.layers.sparse_moe import SparseMoE
from worker.lora.manager import build_gpu_pool
from worker.model_runner.cuda_graph import CUDAGraphRunner
from worker.model_runner.input_builder import InputBuilder
from worker.model_runner.logprobs import compute_logprobs
from worker.model_runner.memory_plan import GRAPH_ALLOWANCE_BYTES, MemoryLimits, MemoryPlan, plan_memory
from worker.model_runner.sampler import PendingTokens, Sampler, SamplingRow
from worker.arch import ArchConfig
from worker.models.builder import build_model
from worker.request import Request



class StepFollowers(Protocol):
    """The other ranks of a tensor-parallel group as rank 0's runner sees them (ranks/group.py's FollowerRanks):
    told of each step before it is enqueued."""

    def step(self, batch: ScheduledBatch) -> None: ...

logger = logging.getLogger(__name__)
STEP_LOG_INTERVAL_S = 60.0     # the step-path counters are logged at most this often


class StepPaths:
    """Counts behind a periodic log line: which path ran each step (a decode graph, a decode graph with LoRA grouped
    by adapter, a mixed-batch graph, or eagerly), the mean tokens of each kind of step and the largest eager step,
    so that a serving run's log shows whether its steps replay graphs and how full its batches are."""

    def __init__(self, clock=time.monotonic, pauses: GCPauses = PAUSES):
        self._clock, self._pauses = clock, pauses     # the collector's passes since the last line
        self._reset(clock())

    def count(self, path: str, num_tokens: int) -> None:
        """path: "decode", "grouped" (a decode graph too), "mixed" or "eager"."""
        kinds = ("decode", path) if path == "grouped" else (path,)
        for kind in kinds:
            self._counts[kind] = self._counts.get(kind, 0) + 1
            self._tokens[kind] = self._tokens.get(kind, 0) + num_tokens
        if path == "eager":
            self._largest_eager = max(self._largest_eager, num_tokens)
        now = self._clock()
        if now - self._since >= STEP_LOG_INTERVAL_S:
            c, t = self._counts, self._tokens
            logger.info("steps in %.0f s: %d decode graphs (%.0f rows on average, %d with LoRA grouped by adapter), "
                        "%d mixed-batch graphs (%.0f tokens on average), %d eager (largest %d tokens); %s",
                        now - self._since, c.get("decode", 0), t.get("decode", 0) / max(c.get("decode", 0), 1),
                        c.get("grouped", 0), c.get("mixed", 0), t.get("mixed", 0) / max(c.get("mixed", 0), 1),
                        c.get("eager", 0), self._largest_eager, self._pauses.describe())
            self._reset(now)

    def _reset(self, now: float) -> None:
        self._since, self._counts, self._tokens, self._largest_eager = now, {}, {}, 0


@dataclass
class ModelOutput:
    token_ids: list[int]                   # one per sampling sequence, in batch order
    logprobs: list[TokenLogprob | None]    # likewise
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # request id -> this step's
    nonfinite_rows: list[int] = field(default_factory=list)   # sampling rows whose logits had a nan or inf


@dataclass
class StepHandle:
    """A launched step. The device may still be running it; `result()` waits for its tokens (on an
    event) and reads them back, once."""
    logits: torch.Tensor                   # [num_sampling_seqs, vocab] (tests compare it)
    tokens: PendingTokens | None           # None when no sequence samples this step
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    prev_tokens: torch.Tensor | None = None   # the previous step's sampled ids, which the sampler may read
    _result: ModelOutput | None = None

    @property
    def device_token_ids(self) -> torch.Tensor | None:
        """The sampled ids [num_sampling_seqs] on the device: the next step's pending inputs."""
        return None if self.tokens is None else self.tokens.device_token_ids

    def result(self) -> ModelOutput:
        if self._result is None:
            token_ids, logprobs, nonfinite = self.tokens.wait() if self.tokens is not None else ([], [], [])
            self._result = ModelOutput(token_ids, logprobs, self.prompt_logprobs, nonfinite)
        return self._result


@dataclass
class BroadcastTokens:
    """A follower's copy of the ids rank 0 sampled: the next step's pending inputs; never read back."""
    device_token_ids: torch.Tensor         # [num_sampling_seqs] int64


def profile_lengths(tokens: int, max_seqs: int, max_model_len: int) -> list[int]:
    """New-token counts of the profiling step: min(max_seqs, tokens) sequences of `tokens` tokens in all, the
    first ones as long as max_model_len allows, the rest one token each (every sequence samples a token).

    tokens 10, max_seqs 4, max_model_len 5 -> [5, 3, 1, 1]"""
    lens = [1] * min(max_seqs, tokens)
    extra = tokens - len(lens)
    for i in range(len(lens)):
        add = min(extra, max_model_len - 1)
        lens[i] += add
        extra -= add
    return lens


class ModelRunner:
    """Tensor parallelism: every rank has a runner over its share of the model (`tp`); their steps run the same
    forward passes, whose collectives meet. Rank 0's runner announces each step to the other ranks first
    (`followers`, ranks/group.py), samples alone and broadcasts the sampled ids; the others `follow`."""

    def __init__(self, config: WorkerConfig, arch: ArchConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, tp: TensorParallel = SINGLE, followers: StepFollowers | None = None):
        self.device, self.dtype, self.max_model_len = device, dtype, max_model_len
        self.tp, self.followers = tp, followers
        self.plan: MemoryPlan | None = None     # None when the configuration fixes the KV pool's size
        free_at_start = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
        m, sched, cache = config.model, config.scheduler, config.cache
        self.kv_dtype = kv_cache_dtype(cache.kv_cache_dtype, dtype, device)     # the KV pool's element type
        self.model = build_model(m.path, dtype, device, m.load_format, max_model_len, config.kernels, m.seed, tp,
                                 m.quantization, kv_cache_dtype=cache.kv_cache_dtype)
        arch = dataclasses.replace(arch, num_kv_heads=self.model.num_kv_heads)   # the K/V this rank caches
        self.lora_pool = build_gpu_pool(self.model, config.lora, dtype, device, config.kernels.lora_side_stream)
        max_blocks = -(-max_model_len // cache.block_size)
        self.input_builder = InputBuilder(sched.max_num_batched_tokens, sched.max_num_seqs, max_blocks,
                                          cache.block_size, device, self.lora_pool.ranks_host,
                                          self.lora_pool.ranks)
        self.sampler = Sampler(arch.vocab_size, seed=m.seed, device=device, eos_token_ids=list(arch.eos_token_ids))
        self.moe_buffer_bytes = 0
        if arch.is_moe and device.type == "cuda":
            self.moe_buffer_bytes = self._attach_moe_workspaces(arch, config)
        use_graphs = device.type == "cuda" and not config.enforce_eager
        graph_tokens = min(config.mixed_graph_max_tokens, sched.max_num_batched_tokens)
        num_blocks = fixed_num_blocks(arch, cache, self.kv_dtype, device)
        if num_blocks is None:
            self.plan = self._plan_memory(config, arch, max_model_len, free_at_start, use_graphs, graph_tokens)
            num_blocks = self.plan.kv // bytes_per_block(arch, cache.block_size, self.kv_dtype)
        num_blocks = tp.min_over_ranks(num_blocks)      # one block table for every rank
        self.kv_pool = KVPool(arch, cache.block_size, num_blocks, self.kv_dtype, device)
        logger.info(self.kv_pool.describe(max_model_len))
        self.graph_runner = None
        self.step_paths = StepPaths()
        if device.type == "cuda":
            self._warm_up(cache.block_size, min(sched.max_num_batched_tokens, max_model_len, 80), sched.max_num_seqs)
        if use_graphs:
            free_before = torch.cuda.mem_get_info(device)[0]
            self.graph_runner = CUDAGraphRunner(self.model, self.kv_pool.caches, self.input_builder,
                                                sched.max_num_seqs, graph_tokens, self._grouped_min_rows(config),
                                                config.kernels.lora_tile_map_max_tokens)
            self.graph_runner.capture()
            torch.cuda.empty_cache()     # the capture warm-ups' blocks, cached for their side stream alone
            taken = free_before - torch.cuda.mem_get_info(device)[0]
            logger.info("CUDA graphs took %.2f GiB (%s)", taken / 2**30,
                        f"planned {self.plan.graphs / 2**30:.2f} GiB" if self.plan else "no memory plan")

    def release_graphs(self) -> None:
        """Free the CUDA graphs (and their memory pool) before this rank leaves its process group: NCCL's
        communicator shutdown waits while graphs that captured its collectives exist (ranks/group.py)."""
        if self.graph_runner is not None:
            self.graph_runner = None
            gc.collect()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def _grouped_min_rows(self, config: WorkerConfig) -> int:
        """KernelConfig.grouped_lora_min_rows, 0 (no grouped-LoRA graphs) when the model has no LoRA slots."""
        return config.kernels.grouped_lora_min_rows if self.lora_pool.ranks_host else 0

    def _attach_moe_workspaces(self, arch: ArchConfig, config: WorkerConfig) -> int:
        """The buffers every sparse MoE layer's kernels work in (kernels/fused_moe.py, kernels/moe_lora.py), one set
        shared by all layers, sized for the largest step; returns their bytes."""
        from worker.kernels.fused_moe import MoEWorkspace  # Triton; imported here so CPU installs need none
        from worker.kernels.moe_lora import MoELoRAWorkspace
        tokens, lora = config.scheduler.max_num_batched_tokens, config.lora
        shape = (tokens, arch.num_experts, arch.num_experts_per_tok)
        inter = self.model.moe_intermediate_size_per_rank     # this rank's share of each expert's I
        experts = MoEWorkspace(*shape, arch.hidden_size, inter, self.dtype, self.device)
        lora_ws = MoELoRAWorkspace(*shape, lora.max_lora_rank, lora.max_loras, self.device)
        for block in self.model.modules():
            if isinstance(block, SparseMoE):
                block.attach_workspaces(experts, lora_ws)
        return (MoEWorkspace.num_bytes(*shape, arch.hidden_size, inter, self.dtype)
                + MoELoRAWorkspace.num_bytes(*shape, lora.max_lora_rank, lora.max_loras))

    def _plan_memory(self, config: WorkerConfig, arch: ArchConfig, max_model_len: int, free_at_start: int,
                     use_graphs: bool, graph_tokens: int) -> MemoryPlan:
        """Profile the largest steps the flags allow and plan the device's memory (model_runner/memory_plan.py)."""
        sched, cache, device = config.scheduler, config.cache, self.device
        activations = self._profile_peak(arch, cache.block_size, sched.max_num_batched_tokens, sched.max_num_seqs,
                                         eager=True)
        graphs = 0
        if use_graphs:    # the largest graph's forward, in the graphs' own pool, and their shared logits
            tokens = min(sched.max_num_batched_tokens, max(graph_tokens, sched.max_num_seqs))
            graphs = (self._profile_peak(arch, cache.block_size, tokens, sched.max_num_seqs, eager=False)
                      + sched.max_num_seqs * arch.vocab_size * 4
                      + GRAPH_ALLOWANCE_BYTES * CUDAGraphRunner.num_graphs(sched.max_num_seqs, graph_tokens,
                                                                           self._grouped_min_rows(config)))
        torch.cuda.empty_cache()
        free_now, total = torch.cuda.mem_get_info(device)
        plan = plan_memory(
            total=total, free_at_start=free_at_start, free_now=free_now,
            torch_reserved=torch.cuda.memory_reserved(device),
            weights=sum(p.numel() * p.element_size() for p in self.model.parameters()),
            lora_slots=self.lora_pool.num_bytes, moe_buffers=self.moe_buffer_bytes, activations=activations,
            graphs=graphs,
            kv_bytes_per_token=bytes_per_block(arch, cache.block_size, self.kv_dtype) // cache.block_size,
            limits=MemoryLimits(cache.gpu_memory_utilization, max_model_len, sched.max_num_seqs,
                                sched.max_num_batched_tokens, config.lora.max_loras))
        logger.info(plan.summary())
        return plan

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_pool.num_blocks

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, prev: StepHandle | None = None) -> StepHandle:
        """Enqueue the batch's forward pass and sampling, and start reading the tokens back; returns
        without waiting for the device. `prev`: the step still in flight, whose sampled tokens are
        inputs of this one (async scheduling)."""
        return self.sample(self.forward(batch, prev), batch)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, prev: StepHandle | None = None) -> StepHandle:
        """Enqueue the forward pass alone: a handle with the logits and no tokens, which `sample` completes
        (the engine files the tokens in flight in between when a grammar needs them)."""
        if self.followers is not None:
            self.followers.step(batch)
        prev_tokens = None if prev is None else prev.device_token_ids
        logits = None if self.graph_runner is None else self.graph_runner.run(batch, prev_tokens)
        self.step_paths.count("eager" if logits is None else self.graph_runner.last_replay, batch.num_tokens)
        prompt_logprobs = {}
        if logits is None:
            forward_batch = self.input_builder.build(batch, prev_tokens=prev_tokens)
            logits = self.model(forward_batch, self.kv_pool.caches)    # [num_logits, vocab]
            if self.tp.rank == 0:
                prompt_logprobs = self._prompt_logprobs(batch, forward_batch.prompt_rows, logits)
            logits = logits[len(logits) - len(forward_batch.sample_rows):]   # [num_sampling_seqs, vocab]
        self.lora_pool.record_use(batch.lora_slots)
        return StepHandle(logits, None, prompt_logprobs, prev_tokens)

    @torch.inference_mode()
    def sample(self, handle: StepHandle, batch: ScheduledBatch,
               token_bitmask: torch.Tensor | None = None) -> StepHandle:
        """Enqueue the sampling of `handle`'s logits and start reading the tokens back. Rows read their
        requests' tokens now. `token_bitmask`: the grammars' allowed tokens per sampling row, or None."""
        rows = [self._sampling_row(s.request) for s in batch.seqs if s.samples]
        if rows:
            handle.tokens = self.sampler(handle.logits, rows, handle.prev_tokens, token_bitmask).copy_to_host()
            self.tp.broadcast(handle.tokens.device_token_ids)
        return handle

    def _sampling_row(self, request: Request) -> SamplingRow:
        """The request's row; its logit edits are built at its first sampled step and kept on it."""
        if request.logit_edits is None:
            request.logit_edits = self.sampler.logit_edits(request.params, request.prompt_token_ids)
        return SamplingRow(request.params, request.prompt_token_ids, request.output_token_ids, request.num_pending,
                           request.pending_row, request.logit_edits)

    @torch.inference_mode()
    def follow(self, batch: ScheduledBatch, prev: StepHandle | None) -> StepHandle:
        """A follower rank's step: the forward pass, then the ids rank 0 sampled, broadcast into this rank's
        copy (the next step's pending tokens are read from it)."""
        handle = self.forward(batch, prev)
        num_rows = sum(s.samples for s in batch.seqs)
        if num_rows:
            handle.tokens = BroadcastTokens(self.tp.broadcast(torch.empty(num_rows, dtype=torch.int64,
                                                                          device=self.device)))
        return handle

    @torch.inference_mode()
    def _profile_peak(self, arch: ArchConfig, block_size: int, tokens: int, max_seqs: int, eager: bool) -> int:
        """Device bytes a step of `tokens` tokens over min(max_seqs, tokens) sequences (profile_lengths) takes
        above what is allocated before it: the forward with LoRA on and, for an `eager` step, the first sequence
        scoring its whole prompt (prompt logprobs) and every sequence sampling with the costliest settings (top-p, top-k,
        penalties, logprobs, a grammar's bitmask); a graph holds the forward alone. K/V go to a temporary pool
        freed afterwards."""
        lens = profile_lengths(tokens, max_seqs, self.max_model_len)
        kv = KVPool(arch, block_size, sum(-(-n // block_size) for n in lens), self.kv_dtype, self.device)
        batch, first_block = ScheduledBatch(), 0
        for i, n in enumerate(lens):
            params = SamplingParams(max_tokens=1, top_p=0.9, top_k=50, repetition_penalty=1.1, logprobs=5,
                                    prompt_logprobs=5 if eager and i == 0 else None)
            request = Request(f"profile-{i}", [0] * n, params, 0)
            request.block_ids = list(range(first_block, first_block + -(-n // block_size)))
            first_block += len(request.block_ids)
            batch.seqs.append(ScheduledSeq(request, 0, n, 0))
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        forward_batch = self.input_builder.build(batch, lora=True)
        logits = self.model(forward_batch, kv.caches)
        if eager:
            self._prompt_logprobs(batch, forward_batch.prompt_rows, logits)
            logits = logits[len(logits) - len(forward_batch.sample_rows):]
            rows = [SamplingRow(s.request.params, s.request.prompt_token_ids, []) for s in batch.seqs]
            bitmask = torch.full((len(rows), -(-arch.vocab_size // 32)), -1, dtype=torch.int32, device=self.device)
            self.sampler(logits, rows, None, bitmask).copy_to_host().wait()     # every row constrained
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del kv, logits, forward_batch
        return peak

    @torch.inference_mode()
    def _warm_up(self, block_size: int, long_len: int, max_seqs: int) -> None:
        """Compile the Triton kernels' prefill and mixed-batch variants now, not on the first requests:
        one long prompt, short prompts, and a short prompt beside a decode token (as many as a step may
        hold), each with LoRA on (the slot-0 adapter at whatever rank it has, 0 included) and off. K/V go to
        the first blocks, which no request owns yet and whose contents a request overwrites before reading."""
        start = time.perf_counter()
        shapes = [[long_len], [3, 3], [12, 1]]
        for lens in shapes:
            batch = ScheduledBatch()
            for n in lens[:max_seqs]:
                request = Request("warm-up", [0] * n, SamplingParams(max_tokens=1), 0)
                request.block_ids = list(range(-(-n // block_size)))
                batch.seqs.append(ScheduledSeq(request, 0, n, 0))
            for lora in (True, False):
                self.model(self.input_builder.build(batch, lora=lora), self.kv_pool.caches)
                # the builder's two host buffer sets take turns: a third build must not refill the first set
                # before its copy ran (under tensor parallelism a rank's device may wait on the other ranks)
                torch.cuda.synchronize()
        logger.info("compiled prefill kernels in %.1f s", time.perf_counter() - start)

    @staticmethod
    def _prompt_logprobs(batch: ScheduledBatch, prompt_rows, logits: torch.Tensor) -> dict:
        """Logprobs of prompt tokens: the logits row of position p scores prompt token p + 1."""
        result, row = {}, 0
        for seq_index, positions in prompt_rows:
            request = batch.seqs[seq_index].request
            scored = [request.prompt_token_ids[p + 1] for p in positions]
            rows = logits[row:row + len(positions)]
            result[request.request_id] = compute_logprobs(rows, scored, request.params.prompt_logprobs)
            row += len(positions)
        return result
