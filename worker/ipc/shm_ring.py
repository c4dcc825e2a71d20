"""Single-producer/single-consumer byte ring in shared memory, with pipe wakeups.

Segment layout (all counters are native little-endian u64, 8-byte aligned):

    [0, 8)      head      bytes consumed so far; written by the consumer only
    [8, 16)     capacity  size of the data area; written once, before the peer attaches
    [64, 72)    tail      bytes produced so far; written by the producer only (own cache line)
    [128, ...)  data      `capacity` bytes; a frame is a u32 little-endian payload length, then
                          the payload, starting at `counter % capacity` and split across the end
                          of the area when it does not fit before it

Counters only grow, so `tail - head` is the number of unread bytes and they never wrap in practice.

Memory ordering: each side writes only its own counter and reads the other's. A counter is
stored with one aligned 8-byte write (memoryview of format "Q"), which is never torn on x86-64
or AArch64. The producer copies a frame, then publishes `tail`; the consumer reads `tail`, copies
the frames below it, then publishes `head`. On x86-64 (TSO) stores become visible in program
order and loads are not reordered with older loads, so a consumer that sees a new `tail` sees the
frame behind it, and a producer that sees a new `head` never overwrites unread bytes. CPython has
no explicit fence; on weakly ordered CPUs (AArch64) the same order holds in practice because the
interpreter executes thousands of instructions, including atomic ones, between the two steps,
but that is not an architectural guarantee.

Wakeups: two pipes per ring, both non-blocking. The producer writes one byte to the data pipe
after publishing (`notify`, which may be deferred to cover several frames); the consumer writes
one byte to the space pipe after each drain that freed space. A side that wants to sleep clears
its pipe, retries the ring, and only then waits on `wakeup_fd`; since every publish precedes its
byte, no wakeup is lost. A full pipe already means "readable", so a write that would block is
dropped. The pipes travel to a spawned child as `multiprocessing` Connections; when the peer
process exits its pipe ends close, the waiting side reads end-of-file and `peer_closed` turns True.
"""
from __future__ import annotations

import mmap
import os
import secrets
import struct
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from multiprocessing.shared_memory import SharedMemory

HEADER_BYTES = 128
_HEAD, _CAPACITY, _TAIL = 0, 1, 8        # indexes into the header viewed as u64 words
_LENGTH = struct.Struct("<I")            # frame prefix: payload length
_MAX_CAPACITY = 1 << 32


@dataclass(frozen=True)
class ShmRingHandle:
    """What the peer process needs to attach; picklable as a spawn argument (pipes travel as fds)."""
    name: str
    role: str                  # the attaching side's role: "producer" | "consumer"
    wait_conn: Connection      # read end the attaching side waits on
    signal_conn: Connection    # write end the attaching side signals through

    def close(self) -> None:
        """Drop the owner's copies of the peer's pipe ends; call once the peer process has started."""
        self.wait_conn.close()
        self.signal_conn.close()


class ShmRing:
    """One side (producer or consumer) of an SPSC ring of length-prefixed byte frames."""

    def __init__(self, shm: SharedMemory, role: str, wait_conn: Connection, signal_conn: Connection,
                 *, owner: bool):
        self._shm = shm
        self._owner = owner
        self._header = shm.buf[:HEADER_BYTES].cast("Q")   # [16] u64 words
        self.capacity = self._header[_CAPACITY]
        self._data = shm.buf[HEADER_BYTES:HEADER_BYTES + self.capacity]
        # map every page now, so the process's RSS holds the whole ring from the start instead of growing by
        # the bytes passed until the counters have gone round once (what a soak would read as a leak)
        shm.buf[::mmap.PAGESIZE].tobytes()
        self.role = role
        self._wait_conn, self._signal_conn = wait_conn, signal_conn
        self._position = self._header[_TAIL if role == "producer" else _HEAD]   # our own counter
        self.peer_closed = False
        self._closed = False

    @classmethod
    def create(cls, capacity: int, role: str) -> tuple[ShmRing, ShmRingHandle]:
        """Create the segment and its pipes; `role` is the owner's side. Returns (ring, peer handle)."""
        if not 0 < capacity < _MAX_CAPACITY:
            raise ValueError(f"ring capacity must be in [1, 2**32), got {capacity}")
        if role not in ("producer", "consumer"):
            raise ValueError(f"role must be 'producer' or 'consumer', got {role!r}")
        shm = SharedMemory(name=f"lpx_{os.getpid()}_{secrets.token_hex(6)}", create=True,
                           size=HEADER_BYTES + capacity)
        header = shm.buf[:HEADER_BYTES].cast("Q")
        header[_CAPACITY] = capacity
        header.release()
        shm.buf[mmap.PAGESIZE::mmap.PAGESIZE] = bytes(len(range(mmap.PAGESIZE, shm.size, mmap.PAGESIZE)))  # pages
        data_r, data_w = Pipe(duplex=False)      # producer -> consumer: frames were published
        space_r, space_w = Pipe(duplex=False)    # consumer -> producer: space was freed
        for conn in (data_r, data_w, space_r, space_w):
            os.set_blocking(conn.fileno(), False)
        if role == "producer":
            ring = cls(shm, role, space_r, data_w, owner=True)
            return ring, ShmRingHandle(shm.name, "consumer", data_r, space_w)
        ring = cls(shm, role, data_r, space_w, owner=True)
        return ring, ShmRingHandle(shm.name, "producer", space_r, data_w)

    @classmethod
    def attach(cls, handle: ShmRingHandle) -> ShmRing:
        """Open the peer's side of a ring created by another process."""
        shm = SharedMemory(name=handle.name)
        return cls(shm, handle.role, handle.wait_conn, handle.signal_conn, owner=False)

    @property
    def name(self) -> str:
        return self._shm.name

    @property
    def wakeup_fd(self) -> int:
        """Readable when the peer published frames (consumer) or freed space (producer), or exited."""
        return self._wait_conn.fileno()

    def try_put(self, frame: bytes, *, notify: bool = True) -> bool:
        """Append one frame; False if it does not fit now (nothing is written: retry later)."""
        assert self.role == "producer"
        needed = _LENGTH.size + len(frame)
        if needed > self.capacity:
            raise ValueError(f"A message of {len(frame)} bytes does not fit in the shared-memory ring "
                             f"of {self.capacity} bytes; raise ring_bytes.")
        if self._position + needed - self._header[_HEAD] > self.capacity:
            return False
        self._copy_in(self._position, _LENGTH.pack(len(frame)))
        self._copy_in(self._position + _LENGTH.size, frame)
        self._position += needed
        self._header[_TAIL] = self._position     # publish after the frame is written
        if notify:
            self.notify()
        return True

    def notify(self) -> None:
        """Wake the consumer (covers every frame published so far)."""
        self._signal()

    def get_many(self, max_frames: int | None = None) -> list[bytes]:
        """Every unread frame (at most `max_frames`), oldest first; frees their space at once."""
        assert self.role == "consumer"
        tail = self._header[_TAIL]
        frames: list[bytes] = []
        position = self._position
        while position < tail and (max_frames is None or len(frames) < max_frames):
            (length,) = _LENGTH.unpack(self._copy_out(position, _LENGTH.size))
            frames.append(self._copy_out(position + _LENGTH.size, length))
            position += _LENGTH.size + length
        if frames:
            self._position = position
            self._header[_HEAD] = position     # publish after the frames are copied out
            self._signal()
        return frames

    def clear_wakeup(self) -> None:
        """Consume pending wakeup bytes; sets `peer_closed` when the peer's pipe end is gone."""
        fd = self._wait_conn.fileno()
        while True:
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                return
            if not chunk:
                self.peer_closed = True
                return

    def close(self) -> None:
        """Detach; the owner also unlinks the segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._header.release()
        self._data.release()
        self._wait_conn.close()
        self._signal_conn.close()
        self._shm.close()
        if self._owner:
            self._shm.unlink()

    def __del__(self) -> None:
        if hasattr(self, "_closed"):      # absent when __init__ failed
            self.close()

    def _signal(self) -> None:
        try:
            os.write(self._signal_conn.fileno(), b"\x01")
        except BlockingIOError:
            pass                     # the pipe is full: the peer has a wakeup pending already
        except BrokenPipeError:
            self.peer_closed = True

    def _copy_in(self, position: int, payload: bytes) -> None:
        start = position % self.capacity
        first = min(len(payload), self.capacity - start)
        view = memoryview(payload)
        self._data[start:start + first] = view[:first]
        if first < len(payload):
            self._data[:len(payload) - first] = view[first:]

    def _copy_out(self, position: int, length: int) -> bytes:
        start = position % self.capacity
        end = start + length
        if end <= self.capacity:
            return bytes(self._data[start:end])
        return bytes(self._data[start:]) + bytes(self._data[:end - self.capacity])
