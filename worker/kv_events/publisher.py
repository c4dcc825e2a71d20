"""The ZMQ publisher of KV-cache events: vLLM's sockets, framing and replay (`--kv-events-config`).

As in vLLM 0.33.0 (`ZmqEventPublisher`, vllm/distributed/kv_events.py):

    PUB     binds when `endpoint` holds "*" or "::" or is ipc:// or inproc://, else connects (to a central
            subscriber); high-water mark `hwm`. Every message is three frames:
                [topic (UTF-8), seq (8 bytes, big-endian), payload (msgpack KVEventBatch)]
            seq counts batches from 0 in each process: a subscriber seeing it fall knows the server restarted.
    ROUTER  bound at `replay_endpoint` when set. A DEALER sends [b"", start_seq (8 bytes, big-endian)] and gets
            back, for each of the last `buffer_steps` batches with seq >= start_seq, [b"", topic, seq, payload],
            then the end marker [b"", b"", 0xFF x 8, b""] (-1 as 8 signed bytes).

The engine hands one batch per step with events to `publish`, a queue put; a daemon thread encodes and sends
them, and answers replay requests between sends, so the step never waits on a socket (only on a full queue of
`max_queue_size` batches, as in vLLM). The sockets are made here, before the thread starts, so a bad or busy
endpoint fails the server's startup; after that only the thread touches them.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque

import msgspec
import zmq

from worker.config import KVEventsConfig
from worker.kv_events.events import KVEventBatch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)   # the replay's end marker
_IDLE_WAIT_S = 0.02        # with no batch queued, how often the thread looks for replay requests


def binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard hosts and local transports are bound, the rest dialled."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig):
        self._topic = config.topic.encode("utf-8")
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._sent: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)   # (seq, payload) for replay
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            if binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))   # a whole replay fits
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {config.endpoint!r}"
                             f"{'' if config.replay_endpoint is None else f' / {config.replay_endpoint!r}'}: {e}"
                             ) from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or config.endpoint
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        logger.info("KV-cache events: PUB %s %s, topic %r%s", "bound at" if binds(config.endpoint) else
                    "connected to", self.endpoint, config.topic,
                    "" if config.replay_endpoint is None else f", replay on {config.replay_endpoint}")

    def publish(self, batch: KVEventBatch) -> None:
        """Queue one step's batch; the thread numbers, encodes and sends it."""
        self._queue.put(batch)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to `timeout` seconds), then close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seqs = itertools.count()
        while True:
            self._serve_replays()
            try:
                batch = self._queue.get(timeout=_IDLE_WAIT_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            seq, payload = next(seqs), encoder.encode(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError:
                logger.exception("KV-cache event batch %d was not sent", seq)
            self._sent.append((seq, payload))

    def _serve_replays(self) -> None:
        """Answer every replay request waiting on the ROUTER socket."""
        while self._replay is not None and self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                logger.warning("Ignored a KV-event replay request of %d frames; expected [identity, b'', seq]",
                               len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            for seq, payload in self._sent:
                if seq >= start_seq:
                    self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._context.term()
