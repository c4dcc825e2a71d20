"""Continuous batching with chunked prefill, KV-block accounting and LoRA-slot admission.

One engine step: `batch = schedule()`, the runner launches `batch`, `launched(batch)`; the sampled
tokens are filed later with `tokens_arrived(batch, sampled)` (async scheduling: the next schedule()
may run first, with each sampling request holding one pending token).
Decisions (order, preemption victim, bypass rule) are in policy.py; this file does the mechanics.

Invariant: a RUNNING request holds a reference on KV blocks covering its computed tokens and, when it
has an adapter, one reference on that adapter's slot; WAITING and FINISHED requests hold neither.

Prefix caching (kv_cache/prefix_cache.py): a request being admitted starts from the longest cached prefix
of its tokens under its adapter version (its num_computed_tokens start there, and it computes only the
rest); each step makes the full blocks it computed findable, once their tokens are all known.

Adapter loads. Without a prefetcher (blocking loads), admitting a request whose adapter is not
resident takes a slot and asks for the load in the same batch. With one (overlap loading), the
prefetcher reads the queue's adapters from disk on other threads, and reserves slots and asks for their
copies once they are in host memory; a request waits, without holding anyone up, until its adapter has
a slot with its copy issued (in this step at the earliest): its step waits for the copy on the device,
and the copy waits only for earlier steps that read the slot, so it runs beside the step in flight.
"""
from __future__ import annotations

import bisect
import itertools
import logging
import time

from worker.batch import ScheduledBatch, ScheduledSeq
from worker.config import SchedulerConfig
from worker.kv_cache.block_allocator import BlockAllocator
from worker.kv_cache.prefix_cache import PrefixCache
from worker.lora.prefetcher import Prefetcher
from worker.lora.slot_table import SlotTable
from worker.request import AdapterRef, Request, RequestStatus
from worker.scheduler import policy

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, block_allocator: BlockAllocator, slot_table: SlotTable,
                 prefetcher: Prefetcher | None = None, enable_prefix_caching: bool = False,
                 record_kv_events: bool = False):
        self.config = scheduler_config
        self.blocks = PrefixCache(block_allocator, enable_prefix_caching, record_kv_events)
        self.slots = slot_table             # lora/manager.py's: max_loras slots, as many as the GPU pool
        self.prefetcher = prefetcher        # None: blocking adapter loads
        self.waiting: list[Request] = []   # policy.waiting_key order; read-only outside this class
        self.running: list[Request] = []   # policy.running_key order (oldest first); read-only outside
        self._unfinished: dict[str, Request] = {}
        self._rejected: list[Request] = []  # ended with "error" in schedule(); next launched() returns them
        self.num_preemptions = 0            # preemptions since start (vLLM's `vllm:num_preemptions`)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of KV blocks held by running requests, 0 to 1 (cached blocks nobody holds are free)."""
        return self.blocks.usage

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request `request_id`; None once it has finished or if it never existed."""
        return self._unfinished.get(request_id)

    def add_request(self, request: Request) -> None:
        if request.request_id in self._unfinished:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        assert request.num_tokens > 0, "a request needs at least one prompt token"
        request.status = RequestStatus.WAITING
        self._unfinished[request.request_id] = request
        bisect.insort(self.waiting, request, key=policy.waiting_key)

    def abort_request(self, request_id: str) -> Request | None:
        """Finish a request now with "abort", giving back its blocks and slot reference."""
        request = self._unfinished.get(request_id)
        if request is not None:
            self._end(request, "abort")
        return request

    def fail_adapter(self, ref: AdapterRef, batch: ScheduledBatch | None = None) -> list[Request]:
        """End every unfinished request of `ref` with "error" (its weights could not be read), drop their
        sequences from `batch` (scheduled, not launched) and forget the slot it was given; returns them."""
        failed = [r for r in self._unfinished.values() if r.adapter == ref]
        if batch is not None:
            batch.seqs = [s for s in batch.seqs if s.request.adapter != ref]
        for request in failed:
            self._end(request, "error")
        self.slots.drop(ref)     # blocking loads gave it a slot it never got weights for
        return failed

    def schedule(self) -> ScheduledBatch:
        """Pick this step's tokens: running requests first, then admissions from the queue.

        A request whose tokens could never fit the whole KV pool finishes with "error"; it is
        returned by the next `launched()`, which must therefore follow every `schedule()`, also
        when the batch is empty.
        """
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        starved: set = set()
        if self.prefetcher is not None:
            prefetch = self.prefetcher.prefetch(self.waiting)
            batch.adapter_loads += prefetch.loads
            starved = prefetch.starved
        if not batch.preempted:   # memory is short: readmitting now would only churn
            self._admit_waiting(batch, budget, starved)
        batch.seqs.sort(key=policy.row_key)
        return batch

    def launched(self, batch: ScheduledBatch) -> list[Request]:
        """The batch was handed to the device: its tokens count as computed and each sampling seq's
        request gets a pending token, so the next schedule() can run before the tokens are known.

        Returns the requests schedule() ended with "error" (it must be followed by this call, also
        when the batch is empty).
        """
        rows = itertools.count()      # a sampling seq's row in the sampler output
        for seq in batch.seqs:
            row = next(rows) if seq.samples else None
            request = seq.request
            if request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += seq.num_new_tokens
            if row is not None:
                request.num_pending += 1
                request.pending_row = row
            self.blocks.cache_computed(request)
        rejected, self._rejected = self._rejected, []
        return rejected

    def tokens_arrived(self, batch: ScheduledBatch, sampled_token_ids: list[int]) -> list[Request]:
        """File a launched batch's sampled tokens (one per sampling seq, in batch order).

        Returns the requests that got a token (and may have finished). A request aborted since has
        no use for its token; one preempted since keeps it, for its recompute.
        """
        samples = [seq for seq in batch.seqs if seq.samples]
        assert len(sampled_token_ids) == len(samples), "one sampled token per sampling seq"
        changed = []
        for seq, token in zip(samples, sampled_token_ids):
            request = seq.request
            if request.is_finished:
                continue
            request.num_pending -= 1
            request.output_token_ids.append(token)
            if request.status is RequestStatus.RUNNING:
                self.blocks.cache_computed(request)   # a block whose last token was pending
            if request.check_stop():
                self._end(request, request.finish_reason)
            changed.append(request)
        return changed

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        """Give each running request, oldest first, its remaining tokens; returns the budget left."""
        for request in list(self.running):
            if budget == 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue   # preempted for an older request in this loop
            if request.num_pending and request.reaches_length_limit:
                continue   # ends when its pending token arrives: nothing more to compute
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._grow_or_preempt(request, num_new, batch):
                break      # it preempted itself, so it was the newest: nothing is left
            batch.seqs.append(self._seq(request, num_new))
            budget -= num_new
        return budget

    def _grow_or_preempt(self, request: Request, num_new: int, batch: ScheduledBatch) -> bool:
        """Cover `num_new` more tokens with blocks, preempting newest requests until they fit.

        False when `request` itself had to be preempted.
        """
        need = self._blocks_to_add(request, num_new)
        while not self.blocks.can_allocate(need):
            victim = policy.preemption_victim(self.running)
            self._preempt(victim, batch)
            if victim is request:
                return False
        request.block_ids += self.blocks.allocate(need)
        return True

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, starved: set) -> None:
        """Admit waiting requests FCFS; ones whose adapter is not ready are skipped, memory shortage stops.

        `starved`: adapters the prefetcher found no slot for (their requests count as overtaken)."""
        skipped: list[Request] = []   # waiting for an adapter slot; later requests overtake them
        draining = None               # the adapter whose slot is drained for them, chosen when needed
        for request in self.waiting:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if request.num_pending:
                continue   # preempted while its last token is in flight; readmitted once it arrives
            if self._never_fits(request):
                self._reject(request)
                continue
            if request.adapter is not None:
                if skipped and draining is None:
                    draining = policy.slot_to_drain(self.running, self.slots.pinned)
                if not self._adapter_ready(request, skipped, starved, draining):
                    continue
            hit = self.blocks.cached_prefix(request)
            num_cached = len(hit) * self.blocks.block_size
            num_new = min(request.num_tokens - num_cached, budget)
            need = self.blocks.blocks_needed(num_cached + num_new) - len(hit)
            if not self.blocks.can_allocate(need + self.blocks.num_evictable(hit)):
                break      # strict FCFS for memory
            self._admit(request, hit, need, batch)
            policy.record_overtake(skipped)
            batch.seqs.append(self._seq(request, num_new))
            budget -= num_new
        self.waiting = [r for r in self.waiting if r.status is RequestStatus.WAITING]

    def _adapter_ready(self, request: Request, skipped: list[Request], starved: set,
                       draining: AdapterRef | None) -> bool:
        """Whether `request`'s adapter lets it in now; one kept out for want of a slot joins `skipped`."""
        if self.prefetcher is not None and self.slots.slot_of(request.adapter) is None:
            if request.adapter in starved:
                skipped.append(request)
            return False       # on its way from disk, or no slot yet: it waits, nobody else does
        if (policy.may_overtake(request, skipped, self.config.max_adapter_bypasses, draining)
                and self.slots.can_acquire(request.adapter)):
            return True
        skipped.append(request)
        return False

    def _admit(self, request: Request, hit: list[int], num_blocks: int, batch: ScheduledBatch) -> None:
        """WAITING -> RUNNING: take the cached prefix `hit`, `num_blocks` new blocks and a slot reference
        (all checked by the caller); its tokens up to the end of `hit` count as computed."""
        if request.adapter is not None:
            slot, needs_load = self.slots.acquire(request.adapter)
            if needs_load:
                batch.adapter_loads.append((request.adapter, slot))
        self.blocks.start_from(request, hit)
        request.block_ids = hit + self.blocks.allocate(num_blocks)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        bisect.insort(self.running, request, key=policy.running_key)

    def _preempt(self, request: Request, batch: ScheduledBatch) -> None:
        """RUNNING -> WAITING by recompute: its KV is dropped and rebuilt on readmission."""
        logger.debug("preempting request %s (%d computed tokens)", request.request_id,
                     request.num_computed_tokens)
        self._give_back(request)
        self.running.remove(request)
        request.num_computed_tokens = request.num_cached_blocks = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        bisect.insort(self.waiting, request, key=policy.waiting_key)
        batch.preempted.append(request)

    def _reject(self, request: Request) -> None:
        """A WAITING request too long for the whole pool ends with "error"; caller drops it from waiting."""
        logger.warning("request %s needs %d KV blocks but the pool has %d; finishing it with an error",
                       request.request_id, self.blocks.blocks_needed(request.num_tokens),
                       self.blocks.num_blocks)
        request.finish_reason = "error"
        self._finish(request)
        self._rejected.append(request)

    def _end(self, request: Request, reason: str) -> None:
        """Any unfinished status -> FINISHED with `reason`, out of whichever queue holds it."""
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.finish_reason = reason
        self._finish(request)

    def _finish(self, request: Request) -> None:
        """Any status -> FINISHED; the caller has set finish_reason and removed it from waiting."""
        if request.status is RequestStatus.RUNNING:
            self._give_back(request)
            self.running.remove(request)
        request.status = RequestStatus.FINISHED
        del self._unfinished[request.request_id]

    def _give_back(self, request: Request) -> None:
        self.blocks.free(request.block_ids)
        request.block_ids = []
        if request.adapter is not None:
            self.slots.release(request.adapter)

    def _seq(self, request: Request, num_new: int) -> ScheduledSeq:
        slot = -1 if request.adapter is None else self.slots.slot_of(request.adapter)
        return ScheduledSeq(request, request.num_computed_tokens, num_new, slot)

    def _blocks_to_add(self, request: Request, num_new: int) -> int:
        covered = self.blocks.blocks_needed(request.num_computed_tokens + num_new)
        return max(0, covered - len(request.block_ids))

    def _never_fits(self, request: Request) -> bool:
        return self.blocks.blocks_needed(request.num_tokens) > self.blocks.num_blocks
