"""KVEventPublisher on real ZMQ sockets: vLLM's three frames, sequence numbers, and its replay protocol."""
import msgspec
import pytest
import zmq

from tests.kv_event_subscriber import END_SEQ
from tests.server_process import free_port
from worker.config import KVEventsConfig
from worker.kv_events.events import AllBlocksCleared, BlockRemoved, KVEventBatch
from worker.kv_events.publisher import KVEventPublisher, binds

TOPIC = "kv@10.0.0.1:8000@base"


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), [BlockRemoved(block_hashes=[i + 1], medium="GPU")], data_parallel_rank=0)


@pytest.fixture
def sockets():
    """(publisher factory, a SUB socket, a replay function) over loopback TCP."""
    context = zmq.Context()
    pub_port, replay_port = free_port(), free_port()
    publishers = []

    def publisher(**fields) -> KVEventPublisher:
        config = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://*:{pub_port}",
                                replay_endpoint=f"tcp://*:{replay_port}", topic=TOPIC, **fields)
        publishers.append(KVEventPublisher(config))
        return publishers[-1]

    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv@")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")

    def replay(frames: list[bytes]) -> list[list[bytes]]:
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart(frames)
        got = []
        while dealer.poll(2000):
            got.append(dealer.recv_multipart())
            if got[-1][2:] == [END_SEQ, b""]:
                break
        dealer.close()
        return got

    yield publisher, sub, replay
    for p in publishers:
        p.close()
    sub.close()
    context.term()


def test_each_batch_is_topic_seq_payload_with_seq_from_zero(sockets):
    publisher, sub, _ = sockets
    pub = publisher()
    sub.poll(300)            # the subscription reaches the publisher before the first batch
    for i in range(3):
        pub.publish(batch(i))
    frames = [sub.recv_multipart() for _ in range(3)]
    assert [f[0] for f in frames] == [TOPIC.encode()] * 3
    assert [f[1] for f in frames] == [i.to_bytes(8, "big") for i in range(3)]
    assert [msgspec.msgpack.decode(f[2]) for f in frames] == [
        [float(i), [{"type": "BlockRemoved", "block_hashes": [i + 1], "medium": "GPU"}], 0] for i in range(3)]


def published(pub: KVEventPublisher, sub: zmq.Socket, batches: list[KVEventBatch]) -> None:
    """Publish `batches` and wait until the subscriber has them all (so they sit in the replay buffer)."""
    sub.poll(300)            # the subscription reaches the publisher before the first batch
    for b in batches:
        pub.publish(b)
    for _ in batches:
        assert sub.poll(2000)
        sub.recv_multipart()


@pytest.mark.parametrize("start, expected", [(0, [0, 1, 2, 3]), (2, [2, 3]), (4, [])])
def test_replay_sends_the_buffered_batches_from_the_asked_seq_then_the_end_marker(sockets, start, expected):
    publisher, sub, replay = sockets
    pub = publisher()
    published(pub, sub, [batch(i) for i in range(4)])
    got = replay([b"", start.to_bytes(8, "big")])
    assert got[-1] == [b"", b"", END_SEQ, b""]
    assert [f[:2] for f in got[:-1]] == [[b"", TOPIC.encode()]] * len(expected)
    assert [int.from_bytes(f[2], "big") for f in got[:-1]] == expected
    assert [msgspec.msgpack.decode(f[3])[0] for f in got[:-1]] == [float(i) for i in expected]


def test_replay_keeps_only_the_last_buffer_steps_batches(sockets):
    publisher, sub, replay = sockets
    pub = publisher(buffer_steps=2)
    published(pub, sub, [batch(i) for i in range(5)])
    got = replay([b"", (0).to_bytes(8, "big")])
    assert [int.from_bytes(f[2], "big") for f in got[:-1]] == [3, 4]


def test_a_malformed_replay_request_is_ignored_and_the_next_one_answered(sockets):
    publisher, sub, replay = sockets
    pub = publisher()
    published(pub, sub, [KVEventBatch(0.0, [AllBlocksCleared()])])
    assert replay([b"", b"\x00" * 8, b"extra"]) == []
    assert len(replay([b"", b"\x00" * 8])) == 2


def test_a_busy_endpoint_fails_startup_with_the_flag_named(sockets):
    publisher, _, _ = sockets
    publisher()
    with pytest.raises(ValueError, match="--kv-events-config: cannot open"):
        publisher()


@pytest.mark.parametrize("endpoint, bound", [("tcp://*:5557", True), ("tcp://[::]:5557", True),
                                             ("ipc:///tmp/kv", True), ("inproc://kv", True),
                                             ("tcp://epp.ns.svc.cluster.local:5557", False),
                                             ("tcp://10.0.0.1:5557", False)])
def test_wildcard_and_local_endpoints_are_bound_the_rest_dialled(endpoint, bound):
    assert binds(endpoint) is bound
