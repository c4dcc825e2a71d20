"""The offline engine: add requests and adapters, step, get per-request outputs.

    batch = scheduler.schedule(); handle = runner.execute(batch); scheduler.launched(batch)
    ... the next step's schedule() and execute() ...
    scheduler.tokens_arrived(batch, handle.result().token_ids)

Adapters live in three tiers: registered on disk (validated, no weights read), packed in the host
cache (lora/host_cache.py, filled by lora/loader.py's threads), and in a GPU slot (lora/gpu_pool.py,
filled by one copy on a side stream). The scheduler decides which slot gets which adapter; the engine
carries the loads out, between `schedule()` and the forward pass, and files them as they finish.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import Counter

import torch

from worker.batch import ScheduledBatch
from worker.config import WorkerConfig
from worker.ipc.messages import AdapterState, LoRAStats, RequestOutput, SamplingParams
from worker.kv_cache.block_allocator import BlockAllocator
from worker.lora.host_cache import HostAdapter, HostCache
from worker.lora.loader import AdapterLoader, PackedReader
from worker.lora.prefetcher import Prefetcher
from worker.lora.registry import AdapterRegistry
from worker.lora.slot_table import SlotTable
from worker.model_runner.runner import ModelRunner, StepHandle
from worker.models.hf_config import ArchConfig
from worker.request import AdapterRef, Request
from worker.scheduler.scheduler import Scheduler
from worker.validation import validate_request

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "half": torch.float16, "float": torch.float32}
IDLE_LOAD_WAIT_S = 0.05      # with nothing to run, a step waits this long at most for an adapter load
LOAD_POLL_S = 0.0005


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint: torch.dtype, device: torch.device) -> torch.dtype:
    """auto: float32 on the CPU; on a GPU the checkpoint's dtype, with float32 served as bfloat16."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"--dtype {name!r} is not supported (auto, float32, float16, bfloat16)")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if checkpoint == torch.float32 else checkpoint


class Engine:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.arch = ArchConfig.from_dir(config.model.path)
        self.dtype = resolve_dtype(config.model.dtype, self.arch.dtype, self.device)
        self.max_model_len = config.model.max_model_len or self.arch.max_position_embeddings
        self.vocab_size = self.arch.vocab_size
        self.eos_token_ids = list(self.arch.eos_token_ids)
        self.runner = ModelRunner(config, self.arch, self.device, self.dtype, self.max_model_len)
        self.num_kv_blocks = self.runner.num_kv_blocks
        lora = config.lora
        self.host_cache = HostCache(lora.max_cpu_loras)
        reader = PackedReader(self.arch, self.runner.lora_pool.layout, pin=self.device.type == "cuda",
                              read_threads=lora.lora_read_threads if lora.enable_lora_overlap_loading else 1)
        self.loader = AdapterLoader(reader, self.host_cache, lora.lora_load_workers)
        slots = SlotTable(lora.max_loras, lora.lora_eviction_policy)
        prefetcher = (Prefetcher(slots, self.host_cache, self.loader, window=max(2 * lora.max_loras, 8),
                                 max_reads=2 * lora.lora_load_workers)
                      if lora.enable_lora_overlap_loading else None)
        allocator = BlockAllocator(self.num_kv_blocks, config.cache.block_size)
        self.scheduler = Scheduler(config.scheduler, lora, allocator, slots, prefetcher)
        self.adapters = AdapterRegistry(lora, self.arch, slots, self.host_cache, self.loader)
        self._copies_in_flight = 0
        self._in_flight: tuple[ScheduledBatch, StepHandle] | None = None   # launched, tokens not filed
        self._arrivals = itertools.count()
        self._requests: dict[str, Request] = {}
        logger.info("engine ready: %s on %s (%s), %d KV blocks, %s adapter loads", self.arch.architecture,
                    self.device, self.dtype, self.num_kv_blocks,
                    "overlapped" if prefetcher is not None else "blocking")

    # adapters

    def add_adapter(self, name: str, path: str, *, load_inplace: bool = False, pinned: bool = False) -> None:
        """Validate and register an adapter; its weights are read when a request first needs them."""
        self.adapters.add(name, path, load_inplace=load_inplace, pinned=pinned)

    def remove_adapter(self, name: str) -> None:
        """Unregister `name`: new requests get 404, unfinished ones finish, then its memory is freed."""
        self.adapters.remove(name)

    def adapter_states(self) -> list[AdapterState]:
        return self.adapters.states(Counter(r.adapter for r in self.scheduler.running),
                                    Counter(r.adapter for r in self.scheduler.waiting))

    def lora_stats(self) -> LoRAStats:
        return self.adapters.stats()

    # requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora_name: str | None = None) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        ref = None if lora_name is None else self.adapters.acquire(lora_name)
        request = Request(request_id, list(prompt_token_ids), params, next(self._arrivals), ref,
                          tuple(self.eos_token_ids), self.max_model_len)
        self._requests[request_id] = request
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now, freeing its KV blocks and adapter reference; None if it is unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.scheduler.abort_request(request_id)
        self._forget(request)
        return RequestOutput(request_id, [], finish_reason="abort", num_prompt_tokens=request.num_prompt_tokens)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def running_adapter_names(self) -> list[str]:
        return sorted({r.adapter.name for r in self.scheduler.running if r.adapter})

    def waiting_adapter_names(self) -> list[str]:
        return sorted({r.adapter.name for r in self.scheduler.waiting if r.adapter})

    # the step

    def step(self) -> list[RequestOutput]:
        """One forward pass, launched; returns the outputs known by then.

        With async scheduling, the batch is launched while the previous one may still run on the
        device, and the previous batch's tokens are read back after that launch: the host schedules
        and prepares step N+1 while the device computes step N, and step() returns step N's tokens.
        When nothing can run while an adapter load is in flight, waits for the load (up to
        IDLE_LOAD_WAIT_S) instead of returning empty-handed at once."""
        outputs: list[RequestOutput] = []
        deadline = time.monotonic() + IDLE_LOAD_WAIT_S
        while True:
            self._collect_loads(outputs)
            batch = self.scheduler.schedule()
            self._start_loads(batch, outputs)
            if not batch.is_empty:
                break
            outputs += self._launched(batch)     # every schedule() is followed by launched()
            if self._in_flight is not None:
                outputs += self._file_tokens()   # nothing can run beside it; its tokens may make room
            elif not self._await_load(deadline, outputs):
                return outputs
        self.runner.wait_for_adapters(batch.lora_slots)
        prev = None if self._in_flight is None else self._in_flight[1]
        launched = (batch, self.runner.execute(batch, prev))
        outputs += self._launched(batch)
        if self._in_flight is not None:
            outputs += self._file_tokens()
        self._in_flight = launched
        if not self.config.async_scheduling:
            outputs += self._file_tokens()
        return outputs

    def _launched(self, batch: ScheduledBatch) -> list[RequestOutput]:
        rejected = self.scheduler.launched(batch)
        for request in rejected:
            self._forget(request)
        return [self._output(request, {}) for request in rejected]

    def _file_tokens(self) -> list[RequestOutput]:
        """Wait for the batch in flight and file its tokens with the scheduler."""
        (batch, handle), self._in_flight = self._in_flight, None
        result = handle.result()
        for request_id, scored in result.prompt_logprobs.items():
            if request_id in self._requests:
                self._requests[request_id].prompt_logprobs += scored
        sampling = [s.request.request_id for s in batch.seqs if s.samples]
        logprobs = dict(zip(sampling, result.logprobs))
        updated = self.scheduler.tokens_arrived(batch, result.token_ids)
        outputs = [self._output(request, logprobs) for request in updated]
        for request in updated:
            if request.is_finished:
                self._forget(request)
        return outputs

    def _start_loads(self, batch: ScheduledBatch, outputs: list[RequestOutput]) -> None:
        """Issue the batch's slot loads. Blocking loads read a missing adapter from disk here."""
        for ref, slot in batch.adapter_loads:
            entry = self.host_cache.get(ref)
            if entry is None:
                try:
                    entry = self._read_now(ref)
                except Exception as e:    # a directory that changed since it was registered
                    outputs += self._fail_adapter(ref, str(e), batch)
                    continue
            self.runner.load_adapter(slot, entry.packed, entry.rank, ref)
            self._copies_in_flight += 1

    def _read_now(self, ref: AdapterRef) -> HostAdapter:
        cached = self.host_cache.reserve(ref)
        try:
            entry, seconds = self.loader.read_now(ref)
        except Exception:
            self.host_cache.drop(ref)
            raise
        if cached:
            self.host_cache.fill(ref, entry)
        self.adapters.loaded(ref, "host", seconds, entry.num_bytes)
        return entry

    def _collect_loads(self, outputs: list[RequestOutput]) -> bool:
        """File finished disk reads and slot copies; True if any finished. A failed read ends the
        adapter's requests with an error."""
        reads = self.loader.poll()
        for read in reads:
            if read.error is not None:
                outputs += self._fail_adapter(read.ref, read.error)
            else:
                self.adapters.loaded(read.ref, "host", read.seconds, read.entry.num_bytes)
        copies = self.runner.finished_adapter_loads()
        self._copies_in_flight -= len(copies)
        for load in copies:
            if self.scheduler.slots.mark_loaded(load.key):
                self.adapters.loaded(load.key, "gpu", load.seconds, load.source.numel())
        return bool(reads or copies)

    def _await_load(self, deadline: float, outputs: list[RequestOutput]) -> bool:
        """Wait for the next adapter load to finish; False if none is in flight or the deadline passed."""
        while self.loader.num_in_flight or self._copies_in_flight:
            if self._collect_loads(outputs):
                return True
            if time.monotonic() >= deadline:
                return False
            if self.loader.num_in_flight:
                self.loader.wait(LOAD_POLL_S)
            else:
                time.sleep(LOAD_POLL_S)
        return False

    def _fail_adapter(self, ref: AdapterRef, error: str, batch: ScheduledBatch | None = None) -> list[RequestOutput]:
        """End every unfinished request of `ref` with an error: its weights could not be read."""
        message = f"Loading LoRA adapter '{ref.name}' failed: {error}"
        failed = [r for r in self._requests.values() if r.adapter == ref]
        if batch is not None:
            batch.seqs = [s for s in batch.seqs if s.request.adapter != ref]
        for request in failed:
            self.scheduler.abort_request(request.request_id)
            self._forget(request)
        self.scheduler.slots.drop(ref)     # blocking loads gave it a slot it never got weights for
        return [RequestOutput(r.request_id, [], finish_reason="error", error=message,
                              num_prompt_tokens=r.num_prompt_tokens) for r in failed]

    def _output(self, request: Request, logprobs: dict) -> RequestOutput:
        if request.finish_reason == "error":   # the scheduler found it can never fit in the KV pool
            return RequestOutput(request.request_id, [], finish_reason="error",
                                 num_prompt_tokens=request.num_prompt_tokens,
                                 error=f"The request needs more KV-cache blocks than the pool has "
                                       f"({self.num_kv_blocks} blocks of {self.config.cache.block_size} tokens).")
        lp = logprobs.get(request.request_id)
        first = len(request.output_token_ids) == 1
        prompt_lps = [None, *request.prompt_logprobs] if first and request.params.prompt_logprobs is not None else None
        return RequestOutput(request.request_id, [request.output_token_ids[-1]],
                             new_logprobs=None if lp is None else [lp], prompt_logprobs=prompt_lps,
                             finish_reason=request.finish_reason, stop_reason=request.stop_reason,
                             num_prompt_tokens=request.num_prompt_tokens)

    def _forget(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)
        if request.adapter is not None:
            self.adapters.release(request.adapter)
