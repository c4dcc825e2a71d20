"""LaunchPacer: how long the worker loop may take in messages before it schedules the next step, so that the
step still queues behind the one the device runs and the requests that arrive meanwhile join it.

With async scheduling, step() launches step N+1, then waits for step N's tokens: the device starts N+1 as N ends
and is busy with it for about one step. Scheduling N+2 at once would fix its batch a whole step before the device
can start it, and a request arriving meanwhile would wait for all of N+1 and N+2. Instead the loop takes in
messages (arrivals, aborts, adapter commands) until

    planned launch = start of N+1 + estimated duration of N+1 - margin

then schedules and launches N+2, which still queues behind N+1, so the device never idles for it.

- start of N+1: the host time at which it saw N end, if N+1 was already queued whole behind N (chained) and N had
  not ended when the host began waiting for it (seen live); otherwise unknown.
- duration of N+1: a lower bound from recent steps of its kind that ran back to back with the step before them
  (device time between the two end marks, in which no adapter copy was in flight): the smallest of the comparable
  ones, each divided by how much larger than N+1 it was (StepShape.excess, at most MAX_EXCESS).
- margin: the largest of the last LAG_WINDOW host lags (from a planned launch, or step()'s start, to the host
  waiting for the step before: select's overshoot, messages, schedule, input build, launch) + SLACK_S +
  SLACK_FRACTION of the estimate.

The delay is zero whenever one of these is unknown: nothing in flight (idle), the step in flight not chained or its
start not seen live (the first steps, after idle, after a late launch, after a constrained step that read the
previous tokens before its sampling), fewer than MIN_SAMPLES comparable durations, or the step already over. As the
start is past, it is always less than the estimate, so less than one step of that kind.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from worker.batch import ScheduledBatch
from worker.model_runner.sampling_passes import pass_letters

logger = logging.getLogger(__name__)

DURATIONS_PER_KIND = 8    # device durations kept per kind of step
LAG_WINDOW = 16           # host lags kept; the margin covers the largest
MIN_SAMPLES = 2           # comparable durations needed before a step is paced
MAX_EXCESS = 1.25         # a kept duration counts for a step at most this many times smaller (StepShape.excess)
SLACK_S = 0.0003          # margin beyond the largest recent host lag...
SLACK_FRACTION = 0.05     # ...and this share of the estimated duration
LOG_INTERVAL_S = 60.0     # at most one summary line this often, while steps are paced


@dataclass(frozen=True)
class StepShape:
    """What a step's device time grows with. Only steps of one kind (the CUDA graph replayed, or eager, and the
    sampler's passes) are compared; within a kind, a step no larger in any count takes no longer."""
    kind: tuple[str, int, str]  # ("decode", 64, "d"): the graph replayed and its size (("eager", 0) without one),
                                # sampler_passes
    num_tokens: int             # tokens computed
    num_seqs: int               # sequences
    num_kv_tokens: int          # positions attended to: sum over sequences of start + new tokens
    num_adapters: int           # distinct LoRA slots read

    @classmethod
    def of(cls, batch: ScheduledBatch, graph: tuple[str, int] | None) -> StepShape:
        return cls((*(graph or ("eager", 0)), sampler_passes(batch)), batch.num_tokens, len(batch.seqs),
                   sum(s.start + s.num_new_tokens for s in batch.seqs), len(batch.lora_slots))

    def excess(self, other: StepShape) -> float:
        """How many times larger than `other` this step is in its relatively largest count (1.0: in none).
        If device time is a fixed part plus parts proportional to each count, all >= 0, then
        time(self) <= excess * time(other); so time(self) / excess is a lower bound of time(other).

        counts (tokens, seqs, kv, adapters) (8, 8, 800, 2) against (7, 7, 1000, 2): 8/7 = 1.14"""
        ratios = [1.0]
        for mine, theirs in ((self.num_tokens, other.num_tokens), (self.num_seqs, other.num_seqs),
                             (self.num_kv_tokens, other.num_kv_tokens), (self.num_adapters, other.num_adapters)):
            if mine > theirs:
                ratios.append(mine / theirs if theirs else float("inf"))
        return max(ratios)


def sampler_passes(batch: ScheduledBatch) -> str:
    """The letters of the sampler's passes (model_runner/sampling_passes.py) that the batch's sampling rows ask for:
    their device time hardly depends on how many rows ask. Greedy rows alone: ""."""
    return pass_letters(s.request.params for s in batch.seqs if s.samples)


class StepEnd(Protocol):
    """A mark in the device's stream after one step's work."""

    def done(self) -> bool:
        """Whether the device has passed it; never waits."""

    def wait(self) -> None:
        """Block the host until the device passes it."""

    def seconds_after(self, earlier: StepEnd) -> float:
        """Device seconds from `earlier` to this mark, both passed."""


class CudaStepEnd:
    """A timing event recorded on the current stream: query() polls it, elapsed_time() reads two passed ones."""

    def __init__(self):
        self._event = torch.cuda.Event(enable_timing=True)
        self._event.record()

    def done(self) -> bool:
        return self._event.query()

    def wait(self) -> None:
        self._event.synchronize()

    def seconds_after(self, earlier: CudaStepEnd) -> float:
        return earlier._event.elapsed_time(self._event) / 1000


@dataclass
class _Launched:
    batch: object                 # what the pacer's shape_of reads
    end: StepEnd
    chained: bool                 # queued whole while the step before still ran: the device ran them back to back
    sampled: bool                 # its duration may be kept (chained, no adapter copy in flight)
    started: float | None = None  # host time the device began it, once seen
    shape: StepShape | None = None   # shape_of(batch), once needed: after the launch path, while the device works


class LaunchPacer:
    """Owned by the engine, which tells it, in each step(): step_began(), launched() after the launch,
    wait_oldest() before reading the oldest step's tokens; the worker loop asks delay() between steps.
    `shape_of`: a launched batch's StepShape."""

    def __init__(self, shape_of: Callable[[Any], StepShape], mark_end: Callable[[], StepEnd] = CudaStepEnd,
                 clock: Callable[[], float] = time.monotonic):
        self._shape_of, self._mark_end, self._clock = shape_of, mark_end, clock
        self._unfiled: deque[_Launched] = deque()    # launched, tokens not yet read; oldest first
        self._last_end: StepEnd | None = None        # end mark of the newest step whose tokens were read
        self._durations: dict[tuple, deque[tuple[StepShape, float]]] = {}   # kind -> (shape, seconds), latest last
        self._lags: deque[float] = deque(maxlen=LAG_WINDOW)   # host seconds from a planned launch to waiting
        self._planned: tuple[float, float] | None = None      # (launch time delay() planned, estimate behind it)
        self._origin: float | None = None     # where this step's host lag counts from, until its launch
        self._lag_from: float | None = None   # the same, after the launch, until the host waits
        self._paced = False                   # this step() follows a positive delay()
        self._summary = _Summary(clock())

    def step_began(self) -> None:
        """step() starts: the host lag counts from the planned launch when the loop woke late for it (not later
        than the step the plan was for could have run: a longer gap is an idle loop, not a lag), else from now."""
        now = self._clock()
        late = 0.0
        if self._planned is not None:
            planned, horizon = self._planned
            late = now - planned if 0.0 <= now - planned <= horizon else 0.0
        self._paced, self._planned = self._planned is not None, None
        self._origin, self._lag_from = now - late, None

    def launched(self, batch: Any, copying: bool = False) -> None:
        """`batch` was just launched whole; `copying`: an adapter copy was in flight beside it."""
        chained = bool(self._unfiled) and not self._unfiled[-1].end.done()
        self._unfiled.append(_Launched(batch, self._mark_end(), chained, chained and not copying))
        self._lag_from, self._origin = self._origin, None
        if self._paced:
            self._summary.paced(late=not chained, now=self._clock())

    def wait_oldest(self) -> None:
        """Block until the oldest step in flight is over (its tokens are then read without waiting); keep its
        duration, and the start of the step behind it if this end was seen live."""
        if self._lag_from is not None:
            self._lags.append(self._clock() - self._lag_from)
            self._lag_from = None
        oldest = self._unfiled.popleft()
        live = not oldest.end.done()
        oldest.end.wait()
        ended = self._clock()
        if oldest.sampled and self._last_end is not None:
            shape = self._shape(oldest)
            kept = self._durations.setdefault(shape.kind, deque(maxlen=DURATIONS_PER_KIND))
            kept.append((shape, oldest.end.seconds_after(self._last_end)))
        self._last_end = oldest.end
        if live and self._unfiled and self._unfiled[0].chained:
            self._unfiled[0].started = ended

    def estimate(self, shape: StepShape) -> float | None:
        """A lower bound of the device time of a step of `shape`; None without MIN_SAMPLES comparable ones."""
        bounds = [seconds / excess for kept, seconds in self._durations.get(shape.kind, ())
                  if (excess := kept.excess(shape)) <= MAX_EXCESS]
        return min(bounds) if len(bounds) >= MIN_SAMPLES else None

    def delay(self) -> float:
        """Seconds to wait before scheduling the next step: until the step in flight is about to end, less the
        margin; 0.0 when that is unknown or already past."""
        now = self._clock()
        self._planned = None
        if len(self._unfiled) != 1 or self._unfiled[0].started is None or not self._lags:
            return 0.0
        running = self._unfiled[0]
        estimate = self.estimate(self._shape(running))
        if estimate is None or running.end.done():
            return 0.0
        margin = max(self._lags) + SLACK_S + SLACK_FRACTION * estimate
        delay = running.started + estimate - margin - now    # less than the estimate: the start is past
        if delay <= 0.0:
            return 0.0
        self._planned = (now + delay, estimate)
        self._summary.planned(delay, estimate, margin)
        return delay

    def _shape(self, launched: _Launched) -> StepShape:
        if launched.shape is None:
            launched.shape = self._shape_of(launched.batch)
        return launched.shape


class _Summary:
    """Counts behind the periodic log line: paced launches, late ones (the step before had ended by the end of
    the launch: the device may have idled), the delays, estimates and margins planned."""

    def __init__(self, now: float):
        self._reset(now)

    def planned(self, delay: float, estimate: float, margin: float) -> None:
        self._plans += 1
        self._delay += delay
        self._estimate += estimate
        self._margin += margin

    def paced(self, late: bool, now: float) -> None:
        self._launches += 1
        self._late += late
        if now - self._since >= LOG_INTERVAL_S and self._plans:
            logger.info("late launch: %d steps paced in %.0f s, %d of them late (the device may have idled); "
                        "mean wait %.2f ms, estimate %.2f ms, margin %.2f ms", self._launches, now - self._since,
                        self._late, 1e3 * self._delay / self._plans, 1e3 * self._estimate / self._plans,
                        1e3 * self._margin / self._plans)
            self._reset(now)

    def _reset(self, now: float) -> None:
        self._since = now
        self._launches = self._late = self._plans = 0
        self._delay = self._estimate = self._margin = 0.0
