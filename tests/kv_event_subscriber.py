"""A KV-event subscriber that rebuilds a server's block index as llm-d's router does, for the tests.

The wire shapes are vLLM 0.33.0's (vllm/distributed/kv_events.py), written out here from that source, not imported
from the server: a batch is a positional array, events are "type"-tagged maps, and unknown fields are refused (the
server must send nothing vLLM does not). What is done with them follows llm-d/llm-d-router at ebab6879:
- sockets (pkg/kvevents/zmq_subscriber.go): SUB on the topic prefix "kv@", three frames [topic, seq, payload];
  replay through a DEALER: send [b"", seq], read [b"", topic, seq, payload] until [b"", b"", END, b""]; replay from
  0 on the first connect, from last + 1 on a reconnect or a gap; a seq already seen is dropped;
- the index (pkg/kvevents/pool.go): a BlockStored whose parent hash is unknown is dropped; each block's own key is
  built from its parent's key, its tokens and the adapter's name (the topic's model for the base); BlockRemoved
  forgets the keys of the hashes it names; AllBlocksCleared forgets everything;
- a request's hit: its blocks' keys, from its rendered token ids, found in a row from the first.
On top, every event is checked against what a router must be able to rely on: hashes nonzero, a stored hash not
already stored, a removed hash stored, one live hash per key, token_ids exactly the blocks' tokens.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any

import msgspec
import zmq

END_SEQ = b"\xff" * 8


class VllmBlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True, forbid_unknown_fields=True):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class VllmBlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True, forbid_unknown_fields=True):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VllmAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", omit_defaults=True, forbid_unknown_fields=True):
    pass


class VllmKVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(VllmKVEventBatch)


def request_key(parent: bytes, token_ids: list[int], model: str) -> bytes:
    """The router's own key of one block (any collision-free function of these three will do)."""
    return hashlib.sha256(repr((parent, tuple(token_ids), model)).encode()).digest()


class RouterIndex:
    """One server's cached blocks as a router knows them from the events."""

    def __init__(self, base_model: str, block_size: int):
        self.base_model, self.block_size = base_model, block_size
        self.key_of: dict[int, bytes] = {}         # live engine hash -> the router's key of its block
        self.num_events = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}
        self.dropped_stores = 0                    # BlockStored with an unknown parent

    @property
    def keys(self) -> set[bytes]:
        return set(self.key_of.values())

    def apply(self, batch: VllmKVEventBatch) -> None:
        assert batch.data_parallel_rank == 0 and abs(batch.ts - time.time()) < 600
        for event in batch.events:
            self.num_events[type(event).__name__.removeprefix("Vllm")] += 1
            if isinstance(event, VllmBlockStored):
                self._stored(event)
            elif isinstance(event, VllmBlockRemoved):
                assert event.medium == "GPU" and event.group_idx == 0
                for block_hash in event.block_hashes:
                    assert block_hash in self.key_of, f"removed hash {block_hash} was never stored"
                    del self.key_of[block_hash]
            else:
                self.key_of.clear()

    def _stored(self, event: VllmBlockStored) -> None:
        size = event.block_size
        assert size == self.block_size and len(event.token_ids) == size * len(event.block_hashes) > 0
        assert (event.medium, event.group_idx, event.kv_cache_spec_kind) == ("GPU", 0, "full_attention")
        assert (event.lora_id is None) == (event.lora_name is None) and event.extra_keys is None
        assert all(isinstance(h, int) and 0 < h < 2 ** 64 for h in event.block_hashes)
        if event.parent_block_hash is None:
            parent = b""
        elif event.parent_block_hash in self.key_of:
            parent = self.key_of[event.parent_block_hash]
        else:
            self.dropped_stores += 1
            return
        model = event.lora_name or self.base_model
        for i, block_hash in enumerate(event.block_hashes):
            assert block_hash not in self.key_of, f"hash {block_hash} stored twice"
            parent = request_key(parent, event.token_ids[i * size:(i + 1) * size], model)
            assert parent not in self.keys, "two live hashes for one block key"
            self.key_of[block_hash] = parent

    def predicted_hit(self, token_ids: list[int], model: str) -> int:
        """Prompt tokens the server will find cached: whole blocks found in a row, the last token never cached."""
        size, parent, keys, found = self.block_size, b"", self.keys, 0
        for i in range((len(token_ids) - 1) // size):
            parent = request_key(parent, token_ids[i * size:(i + 1) * size], model)
            if parent not in keys:
                break
            found += 1
        return found * size


class Subscriber:
    """A SUB socket on the server's PUB endpoint and a DEALER for its replay endpoint, feeding a RouterIndex."""

    def __init__(self, endpoint: str, replay_endpoint: str, index: RouterIndex, topic_prefix: str = "kv@"):
        self.endpoint, self.replay_endpoint, self.index = endpoint, replay_endpoint, index
        self.topic_prefix = topic_prefix
        self.last_seq: int | None = None
        self.topics: set[str] = set()
        self.replays: list[int] = []               # the start of every replay asked for
        self._context = zmq.Context()
        self._sub: zmq.Socket | None = None

    def connect(self) -> None:
        """Subscribe, then replay what was missed: all from 0 the first time, from last + 1 after that."""
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt_string(zmq.SUBSCRIBE, self.topic_prefix)
        self._sub.connect(self.endpoint)
        time.sleep(0.2)                            # let the subscription reach the publisher
        self._replay(0 if self.last_seq is None else self.last_seq + 1)

    def disconnect(self) -> None:
        self._sub.close()
        self._sub = None

    def close(self) -> None:
        if self._sub is not None:
            self.disconnect()
        self._context.term()

    def catch_up(self, quiet_s: float = 0.4, timeout_s: float = 10.0) -> None:
        """Take live messages until none arrives for `quiet_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._sub.poll(int(quiet_s * 1000)):
            frames = self._sub.recv_multipart()
            assert len(frames) == 3 and len(frames[1]) == 8, frames
            seq = int.from_bytes(frames[1], "big")
            if self.last_seq is not None and seq <= self.last_seq:
                continue                           # already had it through a replay
            if self.last_seq is not None and seq > self.last_seq + 1:
                self._replay(self.last_seq + 1)    # a gap: fetch the missing batches first
                if seq <= self.last_seq:
                    continue
            self._take(frames[0], seq, frames[2])

    def _replay(self, start: int) -> None:
        self.replays.append(start)
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            assert dealer.poll(5000), "the replay did not end"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            if frames[1:] == [b"", END_SEQ, b""]:
                break
            topic, seq_bytes, payload = frames[1:]
            seq = int.from_bytes(seq_bytes, "big")
            if self.last_seq is None or seq > self.last_seq:
                self._take(topic, seq, payload)
        dealer.close()

    def _take(self, topic: bytes, seq: int, payload: bytes) -> None:
        assert seq == (0 if self.last_seq is None else self.last_seq + 1), (seq, self.last_seq)
        self.topics.add(topic.decode())
        self.index.apply(DECODER.decode(payload))
        self.last_seq = seq
