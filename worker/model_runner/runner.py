"""ModelRunner: owns the device side (weights, KV pool, LoRA slot pool, sampler) and runs one step."""
from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import torch

from worker.batch import ScheduledBatch
from worker.config import WorkerConfig
from worker.ipc.messages import TokenLogprob
from worker.kv_cache.kv_pool import KVPool
from worker.lora.gpu_pool import GPULoRAPool, SlotLoad
from worker.model_runner.cuda_graph import CUDAGraphRunner
from worker.model_runner.input_builder import InputBuilder
from worker.model_runner.sampler import Sampler, SamplingRow, compute_logprobs, to_host
from worker.models.hf_config import ArchConfig
from worker.models.registry import build_model

logger = logging.getLogger(__name__)


@dataclass
class ModelOutput:
    token_ids: list[int]                   # one per sampling sequence, in batch order
    logprobs: list[TokenLogprob | None]    # likewise
    logits: torch.Tensor                   # [num_sampling_seqs, vocab] float32 (tests compare it)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # request id -> this step's


class ModelRunner:
    def __init__(self, config: WorkerConfig, arch: ArchConfig, device: torch.device, dtype: torch.dtype,
                 max_model_len: int):
        self.device, self.dtype = device, dtype
        m = config.model
        self.model = build_model(m.path, dtype, device, m.load_format, max_model_len, m.seed)
        self.lora_pool = GPULoRAPool(self.model, config.lora.max_loras, config.lora.max_lora_rank, dtype, device)
        self.kv_pool = KVPool(arch, config.cache, dtype, device, max_model_len)
        sched = config.scheduler
        max_blocks = -(-max_model_len // config.cache.block_size)
        self.input_builder = InputBuilder(sched.max_num_batched_tokens, sched.max_num_seqs, max_blocks,
                                          config.cache.block_size, device, self.lora_pool.ranks_host,
                                          self.lora_pool.ranks)
        self.sampler = Sampler(arch.vocab_size, seed=m.seed, device=device, eos_token_ids=list(arch.eos_token_ids))
        self.graph_runner = None
        if device.type == "cuda" and not config.enforce_eager:
            self.graph_runner = CUDAGraphRunner(self.model, self.kv_pool.caches, self.input_builder,
                                                sched.max_num_seqs)
            self.graph_runner.capture()

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_pool.num_blocks

    def load_adapter(self, slot: int, packed: torch.Tensor, rank: int, key: Hashable) -> None:
        """Start copying a packed adapter (host_cache.HostAdapter.packed) into `slot`; see lora_pool.start_load."""
        self.lora_pool.start_load(slot, packed, rank, key)

    def finished_adapter_loads(self) -> list[SlotLoad]:
        """Adapter copies found complete since the last call; never waits."""
        return self.lora_pool.finished_loads()

    def wait_for_adapters(self, slots: Iterable[int]) -> None:
        """Order the next step's work after the copies into `slots`."""
        self.lora_pool.wait_for(slots)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> ModelOutput:
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            logits, prompt_logprobs = self.graph_runner.run(batch), {}     # [num_seqs, vocab]
        else:
            forward_batch = self.input_builder.build(batch)
            logits = self.model(forward_batch, self.kv_pool.caches)    # [num_logits, vocab]
            prompt_logprobs = self._prompt_logprobs(batch, forward_batch.prompt_rows, logits)
            logits = logits[len(logits) - len(forward_batch.sample_rows):]   # [num_sampling_seqs, vocab]
        rows = [SamplingRow(s.request.params, s.request.prompt_token_ids, s.request.output_token_ids)
                for s in batch.seqs if s.samples]
        if not rows:
            return ModelOutput([], [], logits, prompt_logprobs)
        out = self.sampler(logits, rows)
        (token_ids,) = to_host(out.token_ids)
        return ModelOutput(token_ids.tolist(), out.logprobs, logits, prompt_logprobs)

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
