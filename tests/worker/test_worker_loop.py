"""worker.__main__.Worker's outputs: one ring frame per engine step, split into frames that each take at most a
quarter of the ring when a step is larger, every output delivered once and in order."""
from __future__ import annotations

import os

import msgspec
import pytest

from worker.__main__ import Worker
from worker.ipc.messages import OutputBatch, RequestOutput, ToGateway, TokenLogprob
from worker.ipc.shm_ring import ShmRing


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
