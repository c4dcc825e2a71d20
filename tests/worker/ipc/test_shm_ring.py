"""ShmRing: frames in order across processes, wraparound, backpressure, wakeups, dead peers, cleanup."""
from __future__ import annotations

import multiprocessing
import os
import random
import select
import signal
import struct
import time
import zlib

import pytest

from worker.ipc.shm_ring import ShmRing, ShmRingHandle

SPAWN = multiprocessing.get_context("spawn")
TIMEOUT = 20.0


def payloads(seed: int, count: int, max_size: int) -> list[bytes]:
    """Frames of random sizes: sequence number, random body, crc32 of both."""
    rng = random.Random(seed)
    frames = []
    for seq in range(count):
        body = struct.pack("<I", seq) + rng.randbytes(rng.randint(0, max_size))
        frames.append(body + struct.pack("<I", zlib.crc32(body)))
    return frames


def wait_readable(fd: int) -> None:
    readable, _, _ = select.select([fd], [], [], TIMEOUT)
    assert readable, "no wakeup within the timeout"


def is_readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def produce(handle: ShmRingHandle, seed: int, count: int, max_size: int) -> None:
    ring = ShmRing.attach(handle)
    for frame in payloads(seed, count, max_size):
        while not ring.try_put(frame):
            wait_readable(ring.wakeup_fd)
            ring.clear_wakeup()
    ring.close()


def put_then_linger(handle: ShmRingHandle, frames: list[bytes], linger: float) -> None:
    ring = ShmRing.attach(handle)
    for frame in frames:
        assert ring.try_put(frame)
    time.sleep(linger)


def start_peer(target, handle: ShmRingHandle, *args) -> multiprocessing.Process:
    process = SPAWN.Process(target=target, args=(handle, *args))
    process.start()
    handle.close()
    return process


def consume(ring: ShmRing, count: int) -> list[bytes]:
    received: list[bytes] = []
    while len(received) < count:
        ring.clear_wakeup()
        frames = ring.get_many()
        if not frames:
            wait_readable(ring.wakeup_fd)
        received += frames
    return received


def local_pair(capacity: int) -> tuple[ShmRing, ShmRing]:
    producer, handle = ShmRing.create(capacity, "producer")
    return producer, ShmRing.attach(handle)


@pytest.mark.parametrize("capacity, max_size", [(257, 120), (4096, 1500), (1 << 16, 300)])
def test_frames_cross_processes_intact_and_in_order(capacity, max_size):
    count = 1500
    consumer, handle = ShmRing.create(capacity, "consumer")
    process = start_peer(produce, handle, 7, count, max_size)
    received = consume(consumer, count)
    process.join(TIMEOUT)
    assert process.exitcode == 0
    assert received == payloads(7, count, max_size)
    assert all(struct.unpack("<I", f[-4:])[0] == zlib.crc32(f[:-4]) for f in received)
    consumer.close()
    assert not os.path.exists(f"/dev/shm/{consumer.name}")


@pytest.mark.parametrize("offset", range(56, 65))   # the prefix or the payload straddles the end
def test_frame_split_across_the_end_reads_back_whole(offset):
    producer, consumer = local_pair(64)
    assert producer.try_put(bytes(offset - 4))
    assert consumer.get_many(max_frames=1) == [bytes(offset - 4)]
    frame = bytes(range(1, 21))
    assert producer.try_put(frame)
    assert producer.try_put(b"next")
    assert consumer.get_many() == [frame, b"next"]
    assert consumer.get_many(max_frames=1) == []
    consumer.close()
    producer.close()


def test_full_ring_refuses_then_accepts_after_the_consumer_drains():
    producer, consumer = local_pair(32)
    assert producer.try_put(b"a" * 8) and producer.try_put(b"b" * 8)    # 2 x (4 + 8) = 24 of 32 bytes
    producer.clear_wakeup()
    assert not producer.try_put(b"c" * 8)
    assert not is_readable(producer.wakeup_fd)
    assert consumer.get_many(max_frames=1) == [b"a" * 8]
    assert is_readable(producer.wakeup_fd)                             # the consumer signalled space
    assert producer.try_put(b"c" * 8)
    assert consumer.get_many() == [b"b" * 8, b"c" * 8]
    consumer.close()
    producer.close()


@pytest.mark.parametrize("size, fits", [(28, True), (29, False)])
def test_frame_larger_than_the_ring_raises(size, fits):
    producer, consumer = local_pair(32)
    if fits:
        assert producer.try_put(bytes(size))
        assert consumer.get_many(max_frames=1) == [bytes(size)]
    else:
        with pytest.raises(ValueError, match="29 bytes does not fit in the shared-memory ring of 32 bytes"):
            producer.try_put(bytes(size))
    consumer.close()
    producer.close()


def test_consumer_wakes_on_notify_not_before():
    producer, consumer = local_pair(256)
    assert producer.try_put(b"one", notify=False)
    assert producer.try_put(b"two", notify=False)
    assert not is_readable(consumer.wakeup_fd)
    producer.notify()
    assert is_readable(consumer.wakeup_fd)
    consumer.clear_wakeup()
    assert not is_readable(consumer.wakeup_fd)
    assert consumer.get_many() == [b"one", b"two"]
    consumer.close()
    producer.close()


@pytest.mark.parametrize("death", ["exit", "kill"])
def test_consumer_sees_the_producer_process_gone(death):
    consumer, handle = ShmRing.create(1024, "consumer")
    frames = [b"first", b"second", b"third"]
    process = start_peer(put_then_linger, handle, frames, 0.0 if death == "exit" else TIMEOUT)
    assert consume(consumer, 3) == frames
    if death == "kill":
        assert not consumer.peer_closed
        os.kill(process.pid, signal.SIGKILL)
    process.join(TIMEOUT)
    wait_readable(consumer.wakeup_fd)
    consumer.clear_wakeup()
    assert consumer.peer_closed
    assert consumer.get_many() == []
    consumer.close()


def test_only_the_owner_unlinks_the_segment():
    producer, consumer = local_pair(64)
    path = f"/dev/shm/{producer.name}"
    consumer.close()
    assert os.path.exists(path)
    producer.close()
    producer.close()
    assert not os.path.exists(path)
