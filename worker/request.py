"""A generation request as the scheduler sees it: tokens, progress, KV blocks, adapter."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from worker.ipc.messages import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # not admitted yet, or preempted (its KV is recomputed on readmission)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class AdapterRef:
    """Which adapter version a request runs with. `uid` changes on every (re)load of a name,
    so requests admitted before a reload keep the old weights."""
    name: str
    uid: int


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_seq: int                          # FCFS order; smaller arrived earlier
    adapter: AdapterRef | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0              # tokens whose K/V sit in the cache (or are being computed)
    # async scheduling: a token sampled by the batch in flight, not yet read back. It counts in
    # num_tokens (the next step already decodes it, its id taken on the device from that batch's
    # sampler output row `pending_row`) but is not in output_token_ids until it arrives.
    num_pending: int = 0
    pending_row: int = -1
    block_ids: list[int] = field(default_factory=list)   # owned by the scheduler's block allocator
    # prefix caching (set by the scheduler): keys of the full blocks of known tokens (kv_cache/prefix_cache.py),
    # how many of block_ids are findable in the cache, and the prompt tokens found cached at first admission
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int | None = None
    finish_reason: str | None = None
    stop_reason: int | None = None
    num_preemptions: int = 0
    num_adapter_bypasses: int = 0             # times a later request was admitted ahead of this one
    prompt_logprobs: list = field(default_factory=list)  # TokenLogprob per prompt token from the 2nd on
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None  # set by the scheduler when it first admits the request
    # the sampler's device tensors of this request's lists (model_runner/logit_edits.py), set by the model runner
    # at its first sampled step and reused by every later one
    logit_edits: object | None = None

    def __post_init__(self) -> None:
        self._stop_token_ids = frozenset(self.params.stop_token_ids)   # looked up per token: a set, built once

    @property
    def queue_time(self) -> float | None:
        """Seconds from arrival to the first step that computed any of its tokens; None before that."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        """Positions in [start, end) whose logits score a not-yet-scored prompt token (position p scores
        token p + 1). Empty unless prompt logprobs were asked for; recomputation never scores twice."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(end, self.num_prompt_tokens - 1))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        """Tokens sampled so far, the pending one included."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def reaches_length_limit(self) -> bool:
        """max_tokens or max_model_len is reached once the tokens sampled so far are in: a request in
        this state ends when its pending token arrives, whatever that token is."""
        return self.num_generated >= self.params.max_tokens or self.num_tokens >= self.max_model_len

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Known token ids of positions [start, end); a pending token at the end is left out."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def check_stop(self) -> bool:
        """After a token was appended: decide whether the request ends, and why."""
        n_out = len(self.output_token_ids)
        last = self.output_token_ids[-1]
        if n_out >= self.params.min_tokens:
            if last in self._stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", last
                return True
            if not self.params.ignore_eos and last in self.eos_token_ids:
                self.finish_reason = "stop"
                return True
        if n_out >= self.params.max_tokens or len(self.prompt_token_ids) + n_out >= self.max_model_len:
            self.finish_reason = "length"   # by the tokens arrived: a later step's may be pending already
            return True
        return False
