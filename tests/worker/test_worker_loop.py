"""worker.__main__.Worker's outputs: one ring frame per engine step, split into frames that each take at most a
quarter of the ring when a step is larger, every output delivered once and in order. Its loop between steps:
while the engine's launch_delay lasts, messages are applied as they arrive, and a request that arrives then is in
the next step."""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass

import msgspec
import pytest

from tests.gateway.fake_engine import FakeEngine
from worker.__main__ import GatewayGone, Worker
from worker.config import ModelConfig, WorkerConfig
from worker.ipc.messages import (AbortRequest, AdapterCommand, AdapterCommandResult, AddRequest, OutputBatch,
                                 RequestOutput, SamplingParams, Shutdown, Stats, ToGateway, TokenLogprob)
from worker.ipc.shm_ring import ShmRing

DELAY_S = 0.5     # the stand-in engine's launch delay between two steps the test sees
# a launch delay no test outlasts: a message answered, or a stop, while it lasts was applied during the wait
ENDLESS_DELAY_S = 3600.0
ANSWER_TIMEOUT_S = 30.0       # how long a test waits for the worker's answer: generous, far below ENDLESS_DELAY_S


@pytest.fixture
def rings(request):
    """(worker, the gateway's end of the worker's outbound ring) for a ring of `request.param` bytes."""
    inbound, inbound_handle = ShmRing.create(1 << 12, "producer")
    from_worker, outbound_handle = ShmRing.create(request.param, "consumer")
    never_read, never_written = os.pipe()
    worker = Worker(ShmRing.attach(inbound_handle), ShmRing.attach(outbound_handle), never_read)
    yield worker, from_worker
    worker.close()
    for ring in (inbound, from_worker):
        ring.close()
    for handle in (inbound_handle, outbound_handle):
        handle.close()
    os.close(never_read)
    os.close(never_written)


def step_outputs(count: int) -> list[RequestOutput]:
    return [RequestOutput(f"cmpl-{i}-0", [i, i + 1], [TokenLogprob(i, -1.0, 1, [(i + 1, -2.0)])] if i % 3 else None,
                          finish_reason="length" if i % 5 == 0 else None, num_prompt_tokens=i)
            for i in range(count)]


def received(ring: ShmRing) -> list[OutputBatch]:
    decoder = msgspec.msgpack.Decoder(ToGateway)
    return [decoder.decode(frame) for frame in ring.get_many()]


@pytest.mark.parametrize("rings", [1 << 20], indirect=True)
def test_a_step_goes_as_one_frame(rings):
    worker, from_worker = rings
    outputs = step_outputs(256)
    worker.send_outputs(outputs)
    assert received(from_worker) == [OutputBatch(outputs)]


@pytest.mark.parametrize("rings", [1 << 13], indirect=True)
def test_a_large_step_is_split_into_frames_of_a_quarter_ring_at_most(rings):
    worker, from_worker = rings
    outputs = step_outputs(100)
    worker.send_outputs(outputs)
    frames = from_worker.get_many()
    assert len(frames) > 1 and all(len(frame) <= from_worker.capacity // 4 for frame in frames)
    decoder = msgspec.msgpack.Decoder(ToGateway)
    assert [o for frame in frames for o in decoder.decode(frame).outputs] == outputs


@pytest.mark.parametrize("rings", [1 << 12], indirect=True)
def test_an_empty_step_sends_nothing(rings):
    worker, from_worker = rings
    worker.send_outputs([])
    assert received(from_worker) == []


class PacedEngine(FakeEngine):
    """FakeEngine asking for `delay` seconds between steps; records which requests each step gave a token."""

    def __init__(self, config: WorkerConfig, delay: float = DELAY_S):
        super().__init__(config)
        self.delay = delay
        self.steps: list[list[str]] = []

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        self.steps.append(sorted(o.request_id for o in outputs))
        return outputs

    def launch_delay(self) -> float:
        return self.delay


@dataclass
class Served:
    """A Worker serving a PacedEngine in a thread, and the gateway's side: its ends of both rings, the pipe behind
    the worker's parent sentinel, what the serving thread raised."""
    engine: FakeEngine
    to_worker: ShmRing
    from_worker: ShmRing
    thread: threading.Thread
    raised: list[BaseException]
    parent_alive: int | None        # the sentinel's write end; closed: the gateway process exited

    def gateway_exits(self) -> None:
        os.close(self.parent_alive)
        self.parent_alive = None


@pytest.fixture
def served():
    with serving(PacedEngine(WorkerConfig(ModelConfig("unused")))) as gateway:
        yield gateway


@pytest.fixture
def waiting():
    """A worker whose engine waits ENDLESS_DELAY_S after each step."""
    with serving(PacedEngine(WorkerConfig(ModelConfig("unused")), ENDLESS_DELAY_S)) as gateway:
        yield gateway


@contextlib.contextmanager
def serving(engine: FakeEngine):
    to_worker, inbound_handle = ShmRing.create(1 << 16, "producer")
    from_worker, outbound_handle = ShmRing.create(1 << 16, "consumer")
    sentinel, parent_alive = os.pipe()
    worker = Worker(ShmRing.attach(inbound_handle), ShmRing.attach(outbound_handle), sentinel)
    raised: list[BaseException] = []

    def serve():
        try:
            worker.serve(engine)
        except GatewayGone as e:
            raised.append(e)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    gateway = Served(engine, to_worker, from_worker, thread, raised, parent_alive)
    yield gateway
    if thread.is_alive():
        send(to_worker, Shutdown())
        thread.join(5)
    worker.close()
    for ring in (to_worker, from_worker):
        ring.close()
    for handle in (inbound_handle, outbound_handle):
        handle.close()
    os.close(sentinel)
    if gateway.parent_alive is not None:
        os.close(gateway.parent_alive)


def send(ring: ShmRing, message) -> None:
    assert ring.try_put(msgspec.msgpack.encode(message))


def next_message(ring: ShmRing, kind: type, timeout: float = ANSWER_TIMEOUT_S):
    """The next message of type `kind` from the worker (others skipped)."""
    decoder = msgspec.msgpack.Decoder(ToGateway)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for frame in ring.get_many(max_frames=1):
            message = decoder.decode(frame)
            if isinstance(message, kind):
                return message
        time.sleep(0.001)
    raise AssertionError(f"no {kind.__name__} from the worker within {timeout} s")


def add(request_id: str) -> AddRequest:
    return AddRequest(request_id, [5, 6, 7], SamplingParams(max_tokens=100))


def test_a_request_arriving_during_the_wait_is_in_the_next_step(served):
    send(served.to_worker, add("a"))
    assert [o.request_id for o in next_message(served.from_worker, OutputBatch).outputs] == ["a"]
    send(served.to_worker, add("b"))       # the worker now waits DELAY_S before its next step
    assert [o.request_id for o in next_message(served.from_worker, OutputBatch).outputs] == ["a", "b"]
    assert served.engine.steps == [["a"], ["a", "b"]]


def test_an_abort_during_the_wait_is_answered_at_once_and_ends_the_steps(waiting):
    """Answered while the endless wait lasts; the engine is left with nothing to step."""
    send(waiting.to_worker, add("a"))
    next_message(waiting.from_worker, OutputBatch)
    send(waiting.to_worker, AbortRequest("a"))
    send(waiting.to_worker, AdapterCommand(1, "list", ""))
    aborted = next_message(waiting.from_worker, OutputBatch)
    assert [(o.request_id, o.finish_reason) for o in aborted.outputs] == [("a", "abort")]
    assert next_message(waiting.from_worker, AdapterCommandResult).ok
    assert not waiting.engine.has_unfinished() and waiting.engine.steps == [["a"]]


def test_shutdown_during_the_wait_stops_the_worker_without_another_step(waiting):
    send(waiting.to_worker, add("a"))
    next_message(waiting.from_worker, OutputBatch)
    send(waiting.to_worker, Shutdown())
    waiting.thread.join(ANSWER_TIMEOUT_S)         # stopped inside the endless wait
    assert not waiting.thread.is_alive() and not waiting.raised
    assert waiting.engine.steps == [["a"]]


def test_the_gateway_exiting_during_the_wait_stops_the_worker(waiting):
    send(waiting.to_worker, add("a"))
    next_message(waiting.from_worker, OutputBatch)
    waiting.gateway_exits()
    waiting.thread.join(ANSWER_TIMEOUT_S)         # stopped inside the endless wait
    assert not waiting.thread.is_alive() and isinstance(waiting.raised[0], GatewayGone)
    assert waiting.engine.steps == [["a"]]


class ReadingEngine(FakeEngine):
    """FakeEngine with background work (adapter reads) that ends at its `reads`-th idle poll."""

    def __init__(self, config: WorkerConfig, reads: int):
        super().__init__(config)
        self.reads, self.polls = reads, 0

    def has_background_work(self) -> bool:
        return self.polls < self.reads

    def idle_poll(self) -> list[RequestOutput]:
        self.polls += 1
        return []


def test_an_idle_worker_files_background_work_until_it_ends_then_sleeps():
    with serving(ReadingEngine(WorkerConfig(ModelConfig("unused")), reads=5)) as gateway:
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        while gateway.engine.polls < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)             # no request came: the loop now sleeps without polling again
        assert gateway.engine.polls == 5 and gateway.thread.is_alive()
        send(gateway.to_worker, add("a"))      # and wakes for a request
        assert [o.request_id for o in next_message(gateway.from_worker, OutputBatch).outputs] == ["a"]


def test_settle_is_answered_and_an_unknown_adapter_command_is_refused(waiting):
    send(waiting.to_worker, AdapterCommand(1, "settle", ""))
    settled = next_message(waiting.from_worker, AdapterCommandResult)
    assert (settled.command_id, settled.ok) == (1, True)
    send(waiting.to_worker, AdapterCommand(2, "reload", "x"))
    refused = next_message(waiting.from_worker, AdapterCommandResult)
    assert (refused.command_id, refused.ok, refused.status_code) == (2, False, 400)
    assert refused.message == "Unknown adapter command 'reload'; expected 'load', 'unload', 'list' or 'settle'."


class CountingEngine(FakeEngine):
    """A stand-in whose counters change at every look and say how often they were looked at."""

    def __init__(self):
        super().__init__(WorkerConfig(ModelConfig("stand-in")))
        self.looks = 0

    @property
    def num_preemptions(self) -> int:
        self.looks += 1
        return self.looks


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """The worker loop's time.monotonic, which the test moves on (clock[0])."""
    from worker import __main__ as worker_main
    now = [100.0]
    monkeypatch.setattr(worker_main.time, "monotonic", lambda: now[0])
    return now


def sent_stats(from_worker) -> list:
    return [m for m in received(from_worker) if type(m).__name__ == "Stats"]


@pytest.mark.parametrize("rings", [1 << 20], indirect=True)
def test_counters_go_at_most_every_interval_while_busy_and_at_once_when_idle(rings, clock):
    from worker import __main__ as worker_main
    worker, from_worker = rings
    engine = CountingEngine()
    sent = lambda: sent_stats(from_worker)
    worker._send_stats_if_changed(engine, busy=True)             # the first look goes at once
    for _ in range(5):                                             # busy steps within the interval: no look
        clock[0] += worker_main.STATS_INTERVAL_S / 10
        worker._send_stats_if_changed(engine, busy=True)
    assert engine.looks == 1 and len(sent()) == 1
    clock[0] += worker_main.STATS_INTERVAL_S
    worker._send_stats_if_changed(engine, busy=True)               # the interval passed
    worker._send_stats_if_changed(engine, busy=False)              # idle: at once
    assert engine.looks == 3 and [s.num_preemptions for s in sent()] == [2, 3]


class RunningEngine(CountingEngine):
    """CountingEngine whose running requests the test sets."""
    num_running = 0


@pytest.mark.parametrize("rings", [1 << 20], indirect=True)
def test_a_change_in_running_requests_goes_at_once_while_busy(rings, clock):
    """A request shows as running however short it is: its start and end are not held back by the interval."""
    from worker import __main__ as worker_main
    worker, from_worker = rings
    engine = RunningEngine()
    worker._send_stats_if_changed(engine, busy=True)
    for running in (1, 1, 0):
        clock[0] += worker_main.STATS_INTERVAL_S / 10
        engine.num_running = running
        worker._send_stats_if_changed(engine, busy=True)
    assert [s.num_running for s in sent_stats(from_worker)] == [0, 1, 0] and engine.looks == 3


class LoadingEngine(FakeEngine):
    """FakeEngine with `num_adapters_loading` adapters being read into host memory (the test sets it)."""
    num_adapters_loading = 3


def test_the_stats_tell_how_many_adapters_are_still_loading():
    engine = LoadingEngine(WorkerConfig(ModelConfig("unused")))
    with serving(engine) as gateway:
        assert next_message(gateway.from_worker, Stats).num_adapters_loading == 3
        engine.num_adapters_loading = 0
        send(gateway.to_worker, add("a"))      # the next loop sends the stats that changed
        assert next_message(gateway.from_worker, Stats).num_adapters_loading == 0
