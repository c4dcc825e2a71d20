"""The offline engine: add requests and adapters, step, get per-request outputs.

One step (async scheduling: the device may still compute the step before):

    batch = scheduler.schedule()           # with the adapter loads it calls for
    loads.issue(batch.adapter_loads)       # host -> slot copies beside the step in flight
    handle = runner.execute(batch, prev)   # launched, not waited for
    scheduler.tokens_arrived(prev_batch, prev.result().token_ids)   # file the previous step's tokens

Adapters live in three tiers: registered on disk (lora/registry.py), packed in the host cache
(lora/host_cache.py) and in a GPU slot (lora/gpu_pool.py), all owned by one AdapterManager (lora/manager.py).
The scheduler decides which slot gets which adapter; lora/loads.py carries the loads out and files them as
they finish.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

import torch

from worker.batch import ScheduledBatch
from worker.batch_defaults import DeviceFacts, resolve_batch_limits
from worker.config import WorkerConfig
from worker.ranks.group import FollowerRanks
from worker.distributed.tensor_parallel import SINGLE
from worker.ipc.messages import AdapterState, LoRAStats, RequestOutput, SamplingParams
from worker.kv_cache.block_allocator import BlockAllocator
from worker.kv_events.events import KVEventBatch
from worker.launch_pacer import LaunchPacer, StepShape
from worker.lora.loads import FailedLoad
from worker.lora.manager import AdapterManager
from worker.model_runner.runner import ModelRunner, StepHandle
from worker.arch import ArchConfig
from worker.request import AdapterRef, Request
from worker.scheduler.scheduler import Scheduler
from worker.structured.structured_outputs import StructuredOutputs
from worker.validation import validate_request
from worker.warm_read_log import WarmReadLog

if TYPE_CHECKING:
    from worker.kv_events.publisher import KVEventPublisher

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "half": torch.float16, "float": torch.float32}
IDLE_LOAD_WAIT_S = 0.05      # with nothing to run, a step waits this long at most for an adapter load


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
        self.device = resolve_device(config.device)
        self.arch = ArchConfig.from_dir(config.model.path)
        self.dtype = resolve_dtype(config.model.dtype, self.arch.dtype, self.device)
        self.max_model_len = config.model.max_model_len or self.arch.max_position_embeddings
        config = dataclasses.replace(config, scheduler=resolve_batch_limits(
            config.scheduler, DeviceFacts.of(self.device), config.tensor_parallel_size, self.max_model_len))
        self.config = config      # with the batch limits the flags left to vLLM's defaults
        self.vocab_size = self.arch.vocab_size
        self.eos_token_ids = list(self.arch.eos_token_ids)
        # the grammar compiler (xgrammar, the tokenizer's vocabulary) is made on its own thread while the model loads:
        # made by the first constrained request instead, its imports held every other request up for seconds
        self.structured = StructuredOutputs(config.model.tokenizer or config.model.path, self.vocab_size,
                                            self.eos_token_ids, self.device,
                                            config.structured_outputs.disable_any_whitespace,
                                            max_rows=config.scheduler.max_num_seqs)
        self.followers = (FollowerRanks(config, self.device, self.dtype, self.max_model_len)
                          if config.tensor_parallel_size > 1 else None)     # the other tensor-parallel ranks
        self.runner = ModelRunner(config, self.arch, self.device, self.dtype, self.max_model_len,
                                  tp=self.followers.tp if self.followers else SINGLE, followers=self.followers)
        if self.followers is not None:
            self.followers.before_leave = self.runner.release_graphs
        self.num_kv_blocks = self.runner.num_kv_blocks
        self.adapters = AdapterManager(config.lora, self.runner.lora_pool, self.runner.model,
                                       followers=self.followers)
        allocator = BlockAllocator(self.num_kv_blocks, config.cache.block_size)
        self.scheduler = Scheduler(config.scheduler, allocator, self.adapters.slots, self.adapters.prefetcher,
                                   enable_prefix_caching=config.cache.enable_prefix_caching,
                                   record_kv_events=config.kv_events.publishes)
        self.kv_events = self._kv_event_publisher(config)    # None: no KV-cache events
        self._in_flight: tuple[ScheduledBatch, StepHandle] | None = None   # launched, tokens not filed
        # times the launches for the worker loop (launch_delay); only where the host runs ahead of a device
        paced = config.late_launch and config.async_scheduling and self.device.type == "cuda"
        self._pacer = LaunchPacer(self._shape) if paced else None
        self._arrivals = itertools.count()
        self._warm_reads = WarmReadLog()      # the log of the --lora-modules adapters' reads into host memory
        self.structured.wait_ready()          # begun before the model loaded; no request waits for it later
        logger.info("engine ready: %s on %s (%s), %d KV blocks (%s), max_num_seqs %d, max_num_batched_tokens %d, "
                    "%s adapter loads, prefix caching %s", self.arch.architecture, self.device, self.dtype,
                    self.num_kv_blocks, config.cache.kv_cache_dtype, config.scheduler.max_num_seqs,
                    config.scheduler.max_num_batched_tokens,
                    "overlapped" if self.adapters.prefetcher is not None else "blocking",
                    "on" if config.cache.enable_prefix_caching else "off")

    # adapters

    def add_adapter(self, name: str, path: str, *, load_inplace: bool = False, pinned: bool = False,
                    warm: bool = False) -> None:
        """Validate and register an adapter; its weights are read when a request first needs them, or now,
        beside the steps, into the host cache when `warm` and the cache has room (--lora-modules)."""
        old = self.adapters.registry.refs.get(name)
        self.adapters.registry.add(name, path, load_inplace=load_inplace, pinned=pinned, warm=warm)
        ref = self.adapters.registry.refs[name]
        if warm and self._reading_into_host(ref):
            self._warm_reads.started(ref)
        if old is not None:
            self._drop_cached_blocks(old)

    def remove_adapter(self, name: str) -> None:
        """Unregister `name`: new requests get 404, unfinished ones finish, then its memory is freed."""
        ref = self.adapters.registry.refs.get(name)
        self.adapters.registry.remove(name)
        if ref is not None:
            self._drop_cached_blocks(ref)

    def settle_adapters(self) -> None:
        start = time.monotonic()
        count = self.adapters.settle()
        if count:
            logger.info("page-locked the host memory of %d adapters in %.1f s", count, time.monotonic() - start)

    def adapter_states(self) -> list[AdapterState]:
        return self.adapters.registry.states(Counter(r.adapter for r in self.scheduler.running),
                                             Counter(r.adapter for r in self.scheduler.waiting))

    def lora_stats(self) -> LoRAStats:
        return self.adapters.registry.stats()

    # requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora_name: str | None = None) -> None:
        if self.scheduler.get_request(request_id) is not None:
            raise ValueError(f"request id {request_id!r} is already in use")
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        ref = None if lora_name is None else self.adapters.registry.acquire(lora_name)
        request = Request(request_id, list(prompt_token_ids), params, next(self._arrivals), ref,
                          tuple(self.eos_token_ids), self.max_model_len)
        if params.structured is not None:
            self.structured.hold(request)      # queued once its grammar compiles (off the step loop)
        else:
            self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now, freeing its KV blocks and adapter reference; None if it is unknown."""
        request = self.scheduler.abort_request(request_id) or self.structured.drop(request_id)
        if request is None:
            return None
        self._forget(request)
        return RequestOutput(request_id, [], finish_reason="abort", num_prompt_tokens=request.num_prompt_tokens)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.structured.num_compiling > 0

    def has_background_work(self) -> bool:
        """Adapter reads or slot copies in flight (the --lora-modules adapters read at startup, prefetches), or the
        warm reads' last log line still to write."""
        return self.adapters.loads.num_in_flight > 0 or self._warm_reads.open

    def idle_poll(self) -> list[RequestOutput]:
        """File the adapter reads and copies that finished while idle, so that they show as resident."""
        outputs = self._fail_loads(self.adapters.loads.collect())
        self._warm_reads.update(self._reading_into_host)
        return outputs

    @property
    def num_adapters_loading(self) -> int:
        """Adapters whose read from disk into host memory is queued or running."""
        return self.adapters.reader.num_in_flight

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting + self.structured.num_compiling

    @property
    def kv_cache_usage(self) -> float:
        return self.scheduler.kv_cache_usage

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_queries(self) -> int:
        return self.scheduler.blocks.queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.scheduler.blocks.hits

    def running_adapter_names(self) -> list[str]:
        """Adapters resident in a GPU slot (or being copied into one), and those of the running requests
        (an older version of a name still finishing after a load_inplace): vllm:lora_requests_info's
        running_lora_adapters, which the endpoint picker reads as "already loaded here"."""
        return sorted(self.adapters.resident_names() | {r.adapter.name for r in self.scheduler.running if r.adapter})

    def waiting_adapter_names(self) -> list[str]:
        return sorted({r.adapter.name for r in self.scheduler.waiting if r.adapter})

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (AllBlocksCleared), as vLLM's: False, and nothing changes, while any
        request holds blocks."""
        done = self.scheduler.blocks.reset()
        self._publish_kv_events()
        return done

    # the step

    def step(self) -> list[RequestOutput]:
        """One forward pass, launched; returns the outputs known by then (and publishes the step's KV-cache
        events)."""
        outputs = self._step()
        self._publish_kv_events()
        self._warm_reads.update(self._reading_into_host)
        return outputs

    def _step(self) -> list[RequestOutput]:
        """One forward pass, launched; returns the outputs known by then.

        With async scheduling, the batch is launched while the previous one may still run on the
        device, and the previous batch's tokens are read back after that launch: the host schedules
        and prepares step N+1 while the device computes step N, and step() returns step N's tokens
        (launch_delay: how long the worker may take in messages before the next call).
        When nothing can run while an adapter load or a grammar compile is in flight, waits for it (up to
        IDLE_LOAD_WAIT_S) instead of returning empty-handed at once. A batch with a constrained row files the
        previous step's tokens between its forward pass and its sampling (_execute)."""
        outputs: list[RequestOutput] = []
        if self._pacer is not None:
            self._pacer.step_began()
        deadline = time.monotonic() + IDLE_LOAD_WAIT_S
        while (batch := self._schedule(outputs)).is_empty:
            if self._in_flight is not None:
                outputs += self._file_tokens()   # nothing can run beside it; its tokens may make room
            elif not (self.structured.wait(deadline - time.monotonic()) or self.adapters.loads.wait(deadline)):
                return outputs
        self.adapters.loads.join(batch.lora_slots)
        prev = None if self._in_flight is None else self._in_flight[1]
        launched = (batch, self._execute(batch, prev, outputs))
        if self._pacer is not None:
            self._pacer.launched(batch, copying=self.adapters.loads.num_in_flight > 0)
        outputs += self._launched(batch)
        if self._in_flight is not None:
            outputs += self._file_tokens()
        self._in_flight = launched
        if not self.config.async_scheduling:
            outputs += self._file_tokens()
        return outputs

    def launch_delay(self) -> float:
        """Seconds the worker loop may take in messages before the next step() and still launch it before the
        step on the device ends (worker/launch_pacer.py); 0.0: step now."""
        return 0.0 if self._pacer is None else self._pacer.delay()

    def _shape(self, batch: ScheduledBatch) -> StepShape:
        graphs = self.runner.graph_runner
        return StepShape.of(batch, None if graphs is None else graphs.shape_for(batch))

    def _execute(self, batch: ScheduledBatch, prev: StepHandle | None, outputs: list[RequestOutput]) -> StepHandle:
        """Launch the batch. With a constrained row, the forward pass is launched first; then, if such a row's
        last token is still in flight, that step's tokens are filed (the grammar needs them: for this batch
        alone, the host waits for the device) and the matchers fill the bitmask the sampler applies."""
        if not self.structured.constrained_rows(batch):
            return self.runner.execute(batch, prev)
        handle = self.runner.forward(batch, prev)
        if self._in_flight is not None and self.structured.needs_filed_tokens(batch):
            outputs += self._file_tokens()
        return self.runner.sample(handle, batch, self.structured.bitmask(batch))

    def _schedule(self, outputs: list[RequestOutput]) -> ScheduledBatch:
        """File the adapter loads that finished, schedule, and issue the batch's loads. An empty batch is
        filed as launched at once (every schedule() is followed by launched())."""
        outputs += self._fail_loads(self.adapters.loads.collect())
        outputs += self._admit_compiled()
        batch = self.scheduler.schedule()
        outputs += self._fail_loads(self.adapters.loads.issue(batch.adapter_loads), batch)
        if batch.is_empty:
            outputs += self._launched(batch)
        return batch

    def _launched(self, batch: ScheduledBatch) -> list[RequestOutput]:
        rejected = self.scheduler.launched(batch)
        for request in rejected:
            self._forget(request)
        return [self._output(request, {}) for request in rejected]

    def _file_tokens(self) -> list[RequestOutput]:
        """Wait for the batch in flight and file its tokens with the scheduler."""
        (batch, handle), self._in_flight = self._in_flight, None
        if self._pacer is not None:
            self._pacer.wait_oldest()
        result = handle.result()
        sampled = [s.request for s in batch.seqs if s.samples]
        outputs = [self._fail_nonfinite(sampled[row]) for row in result.nonfinite_rows
                   if not sampled[row].is_finished]
        for request_id, scored in result.prompt_logprobs.items():
            request = self.scheduler.get_request(request_id)
            if request is not None:
                request.prompt_logprobs += scored
        logprobs = dict(zip((r.request_id for r in sampled), result.logprobs))
        updated = self.scheduler.tokens_arrived(batch, result.token_ids)
        outputs += [self._output(request, logprobs) for request in updated]
        for request in updated:
            if request.is_finished:
                self._forget(request)
        return outputs

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar compiled; answer the others (a spec xgrammar refused: 400)."""
        compiled, failed = self.structured.ready()
        for request in compiled:
            self.scheduler.add_request(request)
        outputs = []
        for request, message, status in failed:
            self._forget(request)
            outputs.append(RequestOutput(request.request_id, [], finish_reason="error", error=message,
                                         status_code=status, num_prompt_tokens=request.num_prompt_tokens))
        return outputs

    def _fail_loads(self, failed: list[FailedLoad], batch: ScheduledBatch | None = None) -> list[RequestOutput]:
        """End every unfinished request of each failed adapter with its error, and drop them from `batch`."""
        outputs = []
        for load in failed:
            self._warm_reads.failed(load.ref)
            for request in self.scheduler.fail_adapter(load.ref, batch):
                self._forget(request)
                outputs.append(RequestOutput(request.request_id, [], finish_reason="error", error=load.message,
                                             status_code=500, num_prompt_tokens=request.num_prompt_tokens))
        return outputs

    def _reading_into_host(self, ref: AdapterRef) -> bool:
        """Whether `ref`'s read into host memory is queued or running: its host-cache entry reserved, not filled."""
        host = self.adapters.host_cache
        return ref in host and not host.is_filled(ref)

    def _fail_nonfinite(self, request: Request) -> RequestOutput:
        """End a request whose logits held a nan or inf: its token means nothing (corrupt adapter weights,
        an overflow); the rest of the batch goes on."""
        self.scheduler.abort_request(request.request_id)
        self._forget(request)
        adapter = "" if request.adapter is None else f" with LoRA adapter '{request.adapter.name}'"
        return RequestOutput(request.request_id, [], finish_reason="error", num_prompt_tokens=request.num_prompt_tokens,
                             status_code=500,
                             error=f"The model's output for this request{adapter} was not finite (nan or inf).")

    def _output(self, request: Request, logprobs: dict) -> RequestOutput:
        if request.finish_reason == "error":   # the scheduler found it can never fit in the KV pool
            return RequestOutput(request.request_id, [], finish_reason="error", status_code=400,
                                 num_prompt_tokens=request.num_prompt_tokens,
                                 error=f"The request needs more KV-cache blocks than the pool has "
                                       f"({self.num_kv_blocks} blocks of {self.config.cache.block_size} tokens).")
        lp = logprobs.get(request.request_id)
        first = len(request.output_token_ids) == 1
        prompt_lps = [None, *request.prompt_logprobs] if first and request.params.prompt_logprobs is not None else None
        return RequestOutput(request.request_id, [request.output_token_ids[-1]],
                             new_logprobs=None if lp is None else [lp], prompt_logprobs=prompt_lps,
                             finish_reason=request.finish_reason, stop_reason=request.stop_reason,
                             num_prompt_tokens=request.num_prompt_tokens,
                             queue_time=request.queue_time if first else None,
                             num_cached_tokens=request.num_cached_tokens if first else None)

    @staticmethod
    def _kv_event_publisher(config: WorkerConfig) -> KVEventPublisher | None:
        """The KV-cache event publisher `--kv-events-config` asks for; None when events are off. pyzmq is imported
        only then."""
        if not config.kv_events.publishes:
            return None
        if not config.cache.enable_prefix_caching:
            logger.warning("KV-cache events are on but prefix caching is off: no block is ever cached, so no "
                           "event is sent")
        from worker.kv_events.publisher import KVEventPublisher
        return KVEventPublisher(config.kv_events)

    def _publish_kv_events(self) -> None:
        """Hand the KV-cache events recorded since the last call to the publisher, as one batch."""
        events = self.scheduler.blocks.take_events()
        if events and self.kv_events is not None:
            self.kv_events.publish(KVEventBatch(time.time(), events, data_parallel_rank=0))

    def _drop_cached_blocks(self, ref: AdapterRef) -> None:
        """An adapter version was retired: its cached blocks leave the prefix cache now (BlockRemoved)."""
        self.scheduler.blocks.drop_adapter(ref)
        self._publish_kv_events()

    def _forget(self, request: Request) -> None:
        """A finished request gives back its reference on its adapter's version, and its grammar matcher."""
        self.structured.forget(request.request_id)
        if request.adapter is not None:
            self.adapters.registry.release(request.adapter)
