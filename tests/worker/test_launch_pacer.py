"""worker.launch_pacer.LaunchPacer on a fake clock and a fake device: the wait is zero until the running step's
start and comparable durations are known, ends a measured margin before the estimated end, never reaches the
estimate, and a paced loop keeps the device busy while its steps are planned late."""
from __future__ import annotations

import random

import pytest

from worker.batch import ScheduledBatch, ScheduledSeq
from worker.ipc.messages import SamplingParams
from worker.launch_pacer import (DURATIONS_PER_KIND, LAG_WINDOW, MAX_EXCESS, SLACK_FRACTION, SLACK_S, LaunchPacer,
                                 StepShape, sampler_passes)
from worker.request import Request

MS = 1e-3


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeEnd:
    def __init__(self, clock: Clock, end: float):
        self.clock, self.end = clock, end

    def done(self) -> bool:
        return self.clock.now >= self.end

    def wait(self) -> None:
        self.clock.now = max(self.clock.now, self.end)

    def seconds_after(self, earlier: FakeEnd) -> float:
        return self.end - earlier.end


class FakeDevice:
    """One stream: a step starts when it is launched or when the one before it ends, whichever is later."""

    def __init__(self, clock: Clock):
        self.clock = clock
        self.free_at = 0.0
        self.duration = 10 * MS       # of the next step launched
        self.idle: list[float] = []   # the gap before each step

    def mark_end(self) -> FakeEnd:
        start = max(self.clock.now, self.free_at)
        self.idle.append(start - self.free_at)
        self.free_at = start + self.duration
        return FakeEnd(self.clock, self.free_at)


def decode(seqs: int = 8, kv: int = 800, adapters: int = 2,
           kind: tuple[str, int, str] = ("decode", 8, "d")) -> StepShape:
    return StepShape(kind, seqs, seqs, kv, adapters)


def make_pacer() -> tuple[LaunchPacer, Clock, FakeDevice]:
    clock = Clock()
    device = FakeDevice(clock)
    return LaunchPacer(lambda shape: shape, device.mark_end, clock), clock, device


def run_step(pacer: LaunchPacer, clock: Clock, device: FakeDevice, shape: StepShape, duration: float,
             host: float = 1 * MS, wait: bool = True) -> float:
    """What Engine.step() tells the pacer, with `host` seconds of schedule, build and launch, then the worker
    loop's wait; returns the delay it waited."""
    pacer.step_began()
    clock.advance(host)
    device.duration = duration
    pacer.launched(shape)
    if len(pacer._unfiled) > 1:
        pacer.wait_oldest()
    delay = pacer.delay()
    if wait:
        clock.advance(delay)
    return delay


def test_no_delay_while_nothing_is_known():
    pacer, clock, device = make_pacer()
    assert pacer.delay() == 0.0
    delays = [run_step(pacer, clock, device, decode(), 10 * MS) for _ in range(3)]
    # step 1: nothing before it; step 2: the first duration is of a step that followed nothing; step 3: one sample
    assert delays == [0.0, 0.0, 0.0]
    assert run_step(pacer, clock, device, decode(), 10 * MS) > 0.0


def warmed_up_and_launched() -> tuple[LaunchPacer, Clock, FakeDevice]:
    """A pacer after six 10 ms decode steps with 1 ms of host time each, then a seventh launched 1 ms after its
    step began, and the step before it waited for: the seventh starts on the device now."""
    pacer, clock, device = make_pacer()
    for _ in range(6):
        run_step(pacer, clock, device, decode(), 10 * MS, host=1 * MS)
    pacer.step_began()
    clock.advance(1 * MS)
    pacer.launched(decode())
    pacer.wait_oldest()
    return pacer, clock, device


def test_delay_ends_the_margin_before_the_estimated_end():
    pacer, clock, _ = warmed_up_and_launched()   # the step before ends now: the one just launched starts
    started = clock.now
    clock.advance(0.2 * MS)                # the tokens are read, the outputs sent
    margin = 1 * MS + SLACK_S + SLACK_FRACTION * 10 * MS
    assert pacer.delay() == pytest.approx(started + 10 * MS - margin - clock.now)


def test_margin_covers_the_largest_recent_host_lag():
    pacer, clock, device = make_pacer()
    hosts = [1 * MS] * 5 + [3 * MS] + [1 * MS] * 3
    delays = [run_step(pacer, clock, device, decode(), 10 * MS, host=h) for h in hosts]
    assert delays[-1] == pytest.approx(10 * MS - 3 * MS - SLACK_S - SLACK_FRACTION * 10 * MS)
    for h in [1 * MS] * LAG_WINDOW:        # once the 3 ms lag leaves the window, the margin shrinks again
        delay = run_step(pacer, clock, device, decode(), 10 * MS, host=h)
    assert delay == pytest.approx(10 * MS - 1 * MS - SLACK_S - SLACK_FRACTION * 10 * MS)


def test_lateness_of_the_loop_counts_in_the_host_lag():
    pacer, clock, device = warmed_up_and_launched()
    clock.advance(pacer.delay() + 0.5 * MS)    # the loop wakes 0.5 ms after the planned launch
    delay = run_step(pacer, clock, device, decode(), 10 * MS, host=1 * MS)
    assert max(pacer._lags) == pytest.approx(1.5 * MS)
    assert delay == pytest.approx(10 * MS - 1.5 * MS - SLACK_S - SLACK_FRACTION * 10 * MS)


def test_an_idle_loop_after_a_plan_is_not_a_lag():
    pacer, clock, device = make_pacer()
    for _ in range(6):
        run_step(pacer, clock, device, decode(), 10 * MS, host=1 * MS, wait=False)
    assert pacer.delay() > 0.0
    clock.advance(5.0)                     # the plan is never used: the requests were aborted
    run_step(pacer, clock, device, decode(), 10 * MS, host=1 * MS)
    assert max(pacer._lags) == pytest.approx(1 * MS)


def test_no_delay_when_the_running_step_started_unseen():
    pacer, clock, device = make_pacer()
    for _ in range(6):
        run_step(pacer, clock, device, decode(), 10 * MS)
    pacer.step_began()
    clock.advance(1 * MS)
    pacer.launched(decode())
    clock.advance(20 * MS)                 # the host reaches the wait after the step before ended
    pacer.wait_oldest()
    assert pacer.delay() == 0.0


def test_no_delay_after_idle():
    pacer, clock, device = make_pacer()
    for _ in range(6):
        run_step(pacer, clock, device, decode(), 10 * MS)
    pacer.step_began()
    pacer.wait_oldest()                    # nothing to launch: the step in flight is filed, the engine idles
    clock.advance(1.0)
    assert pacer.delay() == 0.0
    assert run_step(pacer, clock, device, decode(), 10 * MS) == 0.0   # nothing ran before it
    assert run_step(pacer, clock, device, decode(), 10 * MS) > 0.0    # queued behind it, seen to start


def test_no_delay_when_the_running_step_is_already_over():
    pacer, clock, device = make_pacer()
    for _ in range(6):
        run_step(pacer, clock, device, decode(), 10 * MS)
    pacer.step_began()
    pacer.launched(decode())
    pacer.wait_oldest()
    clock.advance(11 * MS)
    assert pacer.delay() == 0.0


def test_no_delay_for_a_kind_without_enough_durations():
    pacer, clock, device = make_pacer()
    for _ in range(6):
        run_step(pacer, clock, device, decode(), 10 * MS)
    mixed = StepShape(("mixed", 256, "d"), 160, 9, 2000, 2)
    assert run_step(pacer, clock, device, mixed, 30 * MS) == 0.0      # running: the first mixed step
    assert run_step(pacer, clock, device, decode(), 10 * MS) > 0.0


def test_a_step_beside_an_adapter_copy_is_not_a_duration():
    pacer, clock, device = make_pacer()
    for _ in range(3):
        pacer.step_began()
        device.duration = 10 * MS
        pacer.launched(decode(), copying=True)
        if len(pacer._unfiled) > 1:
            pacer.wait_oldest()
    assert pacer.estimate(decode()) is None


def test_no_delay_with_synchronous_steps():
    """Nothing in flight between steps (what async_scheduling=False leaves): launch at once."""
    pacer, clock, device = make_pacer()
    for _ in range(6):
        pacer.step_began()
        pacer.launched(decode())
        pacer.wait_oldest()
        assert pacer.delay() == 0.0


@pytest.mark.parametrize("larger, excess", [(decode(seqs=8), 1.0), (decode(seqs=9, kv=900), 9 / 8),
                                            (decode(kv=1000), 1000 / 800), (decode(adapters=3), 1.5),
                                            (decode(adapters=1), 1.0), (decode(seqs=4, kv=400), 1.0)])
def test_excess_is_the_largest_ratio_of_counts(larger, excess):
    assert larger.excess(decode()) == pytest.approx(excess)


GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("params, passes", [
    (GREEDY, ""), (SamplingParams(), "d"), (SamplingParams(seed=1, top_p=0.9), "es"),
    (SamplingParams(top_k=5, min_p=0.1), "dms"),
    (SamplingParams(temperature=0.0, repetition_penalty=1.1, logprobs=2), "lp"),
    (SamplingParams(temperature=0.0, logit_bias={3: 1.0}), "b"),
    (SamplingParams(temperature=0.0, bad_words_token_ids=[[4]]), "b")])
def test_sampler_passes_name_each_pass_a_sampling_row_asks_for(params, passes):
    asks = Request("a", [1, 2, 3], params, 0)
    greedy = Request("b", [1, 2, 3, 4], GREEDY, 1)
    chunk = Request("c", [1, 2, 3, 4], SamplingParams(logprobs=1), 2)    # samples nothing this step
    batch = ScheduledBatch([ScheduledSeq(asks, 2, 1, -1), ScheduledSeq(greedy, 0, 4, 0), ScheduledSeq(chunk, 0, 2, 1)])
    assert sampler_passes(batch) == passes


def test_shape_of_a_batch_counts_tokens_sequences_positions_and_adapters():
    seqs = [ScheduledSeq(Request("a", [1] * 10, GREEDY, 0), 0, 10, 1),       # a whole prompt
            ScheduledSeq(Request("b", [1] * 6, GREEDY, 1), 5, 1, 1),         # a decode: 6 positions attended
            ScheduledSeq(Request("c", [1] * 40, GREEDY, 2), 16, 8, -1)]      # a chunk: 24 positions
    assert StepShape.of(ScheduledBatch(seqs), ("mixed", 32)) == StepShape(("mixed", 32, ""), 19, 3, 40, 1)
    assert StepShape.of(ScheduledBatch(seqs), None).kind == ("eager", 0, "")


def test_excess_over_zero_is_infinite():
    assert decode(adapters=1).excess(decode(adapters=0)) == float("inf")


def test_estimate_is_the_smallest_duration_divided_by_its_excess():
    pacer, clock, device = make_pacer()
    kept = [(decode(seqs=8, kv=800), 10 * MS), (decode(seqs=9, kv=900), 10.5 * MS), (decode(seqs=12), 8 * MS),
            (decode(seqs=4, kv=400), 7 * MS), (decode(kind=("decode", 16, "d")), 1 * MS)]
    for shape, seconds in kept:
        pacer._durations.setdefault(shape.kind, []).append((shape, seconds))
    # 12 sequences is 1.5 times 8: beyond MAX_EXCESS, not comparable; the 16-bucket graph is another kind
    assert 12 / 8 > MAX_EXCESS
    assert pacer.estimate(decode()) == pytest.approx(min(10 * MS, 10.5 * MS * 8 / 9, 7 * MS))


def test_estimate_needs_two_comparable_durations():
    pacer, _, _ = make_pacer()
    pacer._durations[("decode", 8, "d")] = [(decode(), 10 * MS)]
    assert pacer.estimate(decode()) is None


def test_durations_kept_per_kind_are_the_latest():
    pacer, clock, device = make_pacer()
    for i in range(DURATIONS_PER_KIND + 4):
        run_step(pacer, clock, device, decode(), (10 + i) * MS)
    # steps 1 to 10 are filed behind the step before them (the last is still in flight); the latest 8 are kept
    assert [s for _, s in pacer._durations[("decode", 8, "d")]] == \
        pytest.approx([(10 + i) * MS for i in range(3, DURATIONS_PER_KIND + 3)])


@pytest.mark.parametrize("seed", range(5))
def test_a_paced_loop_keeps_the_device_busy(seed):
    """Steps of 8-12 sequences (a shorter graph bucket at 8), durations growing with the batch and context, the host's
    lag between 0.5 and 1.5 ms: the device never idles once the loop runs, and most of each step is spent waiting."""
    rng = random.Random(seed)
    pacer, clock, device = make_pacer()
    delays, durations = [], []
    kv = 1000
    for step in range(400):
        seqs = rng.randint(8, 12)
        kv += seqs
        shape = StepShape(("decode", 8 if seqs == 8 else 16, "d"), seqs, seqs, kv, rng.randint(1, 4))
        duration = 6 * MS + 0.1 * MS * seqs + 1e-6 * kv + 0.2 * MS * shape.num_adapters
        durations.append(duration)
        delays.append(run_step(pacer, clock, device, shape, duration, host=rng.uniform(0.5, 1.5) * MS))
    assert sum(device.idle[2:]) == 0.0
    paced = [d / s for d, s in zip(delays[20:], durations[20:]) if d > 0]
    assert len(paced) > 0.8 * len(delays[20:]) and sum(paced) / len(paced) > 0.6
    assert all(d < s for d, s in zip(delays, durations))


def test_steps_getting_faster_idle_the_device_once_by_the_drop_less_the_slack():
    """The one risk: a step shorter than every recent one of its kind (10 ms, then 8 ms from step 8). The launch
    behind it comes 2 ms - slack late; that launch is not chained, so the next one is not paced and the 8 ms
    durations take over."""
    pacer, clock, device = make_pacer()
    durations = [10 * MS] * 8 + [8 * MS] * 12
    delays = [run_step(pacer, clock, device, decode(), d, host=1 * MS) for d in durations]
    gaps = [gap for gap in device.idle[1:] if gap > 0]
    assert gaps == [pytest.approx(2 * MS - SLACK_S - SLACK_FRACTION * 10 * MS)]
    assert delays[9] == 0.0 and delays[-1] == pytest.approx(8 * MS - 1 * MS - SLACK_S - SLACK_FRACTION * 8 * MS)
