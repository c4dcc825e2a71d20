"""Host memory for the host cache's entries: page-locked buffers of each entry's exact size, kept for reuse.

Why not `torch.empty(..., pin_memory=True)`: torch's pinned allocator rounds every size up to a power of two (a
40 MiB entry takes 64 MiB) and makes each new block with cudaHostAlloc, which holds the CUDA driver while it
allocates and locks the pages, so the step loop's launches and copies wait behind it. Measured on an H200 with
bench/load_interference.py (a 0.8 ms decode-like step: input copy, graph replay, output copy, host wait): 174 ms
a step (p50) while one thread made 40 MiB pinned blocks, 460 ms beside four. Writing into memory page-locked
beforehand, or reading files into plain memory, left the step at 0.80-0.83 ms.

So a buffer here is anonymous memory (page-aligned, transparent huge pages asked for, its pages written first,
outside the driver) page-locked with cudaHostRegister, which holds the driver only while it locks pages already
present. That still holds up a serving step's many CUDA calls: with 1,000 adapters read after startup, each into a
buffer registered as its read began, an 8B model's 8-stream TPOT went from 6.0 to 10.8-14.9 ms while they were
read (bench/warm_reads.py; a profile showed the step thread waiting, not working). So buffers are page-locked
before the server serves where that is known ahead: `prepare` registers on a few threads of its own (the
--lora-modules adapters' buffers, while the server starts; `settle` waits for them), and a buffer needed while
serving is registered one at a time. Buffers come back (`give_back`) when their entry is gone and serve the next
entry of their size, so a host cache that turns over registers nothing new; beyond `keep_bytes` of idle buffers
the largest are unregistered and freed. Without CUDA, plain memory.
"""
from __future__ import annotations

import concurrent.futures
import mmap
import threading
import weakref
from collections import defaultdict

import torch

PAGE = mmap.PAGESIZE
PREPARE_THREADS = 4      # registrations side by side before serving: ~4 GB/s on an H200 host against ~1.5 on one


class HostBuffers:
    """Buffers for host-cache entries, page-locked when `pin`; at most `keep_bytes` of them kept idle."""

    def __init__(self, pin: bool, keep_bytes: int = 1 << 30):
        self.pin, self.keep_bytes = pin, keep_bytes
        self._idle: dict[int, list[torch.Tensor]] = defaultdict(list)    # size -> buffers given back
        self._idle_bytes = 0
        self._lock = threading.Lock()
        self._registering = threading.Lock()      # `get`: one cudaHostRegister at a time
        self._preparer: concurrent.futures.ThreadPoolExecutor | None = None
        self._preparing: set[concurrent.futures.Future] = set()
        # every page-locked buffer, in use or idle, by address: its memory is not unmapped before it is unregistered
        # (an address mapped again would then fail to register), here or when these buffers go
        self._registered: dict[int, torch.Tensor] = {}
        weakref.finalize(self, _unregister_all, self._registered)

    @property
    def registered_bytes(self) -> int:
        """Page-locked now, in use or idle."""
        return sum(b.numel() for b in list(self._registered.values()))

    def get(self, num_bytes: int) -> torch.Tensor:
        """A [num_bytes] uint8 buffer (page-locked when pinning): one given back, or a new one."""
        buffer = self._take_idle(num_bytes)
        if buffer is not None:
            return buffer
        with self._registering:                   # one at a time while serving
            return self._new(num_bytes)

    def prepare(self, num_bytes: int) -> concurrent.futures.Future[torch.Tensor]:
        """`get`, on this object's threads, several at once (before the server serves: `settle` waits for them)."""
        if self._preparer is None:
            self._preparer = concurrent.futures.ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="lora-pin")
        future = self._preparer.submit(self._prepared, num_bytes)
        with self._lock:
            self._preparing.add(future)
        future.add_done_callback(self._prepared_done)
        return future

    def settle(self) -> int:
        """Wait for the buffers `prepare` is making; how many there were."""
        with self._lock:
            pending = list(self._preparing)
        concurrent.futures.wait(pending)
        return len(pending)

    def _prepared(self, num_bytes: int) -> torch.Tensor:
        buffer = self._take_idle(num_bytes)
        return buffer if buffer is not None else self._new(num_bytes)

    def _take_idle(self, num_bytes: int) -> torch.Tensor | None:
        with self._lock:
            idle = self._idle.get(num_bytes)
            if not idle:
                return None
            self._idle_bytes -= num_bytes
            return idle.pop()

    def _prepared_done(self, future: concurrent.futures.Future) -> None:
        with self._lock:
            self._preparing.discard(future)

    def _new(self, num_bytes: int) -> torch.Tensor:
        size = max(PAGE, -(-num_bytes // PAGE) * PAGE)
        memory = mmap.mmap(-1, size)                  # anonymous, page-aligned: no page shared with other data
        if hasattr(mmap, "MADV_HUGEPAGE"):
            memory.madvise(mmap.MADV_HUGEPAGE)        # fewer pages for the driver to lock
        buffer = torch.frombuffer(memory, dtype=torch.uint8)
        buffer.numpy()[::PAGE] = 0                     # fault the pages in here, not inside the driver's lock
        if self.pin:
            error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), size, 0)
            if int(error) != 0:
                raise RuntimeError(f"cudaHostRegister of {size} bytes failed: {error}")
            with self._lock:
                self._registered[buffer.data_ptr()] = buffer
        return buffer[:num_bytes]

    def give_back(self, buffer: torch.Tensor) -> None:
        """`buffer` (from `get`) is no longer used: keep it for the next entry of its size, or free it."""
        num_bytes = buffer.numel()
        with self._lock:
            self._idle[num_bytes].append(buffer)
            self._idle_bytes += num_bytes
            freed = []
            while self._idle_bytes > self.keep_bytes:
                size = max(self._idle, key=lambda n: n if self._idle[n] else -1)
                freed.append(self._idle[size].pop())
                self._idle_bytes -= size
        for old in freed:
            self._free(old)

    @property
    def idle_bytes(self) -> int:
        return self._idle_bytes

    def _free(self, buffer: torch.Tensor) -> None:
        if self.pin:
            torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
            with self._lock:
                del self._registered[buffer.data_ptr()]


def _unregister_all(registered: dict[int, torch.Tensor]) -> None:
    """When a HostBuffers goes: unregister its buffers before their memory can be unmapped (entries still holding
    one keep it mapped, no longer page-locked)."""
    for address in list(registered):
        try:
            torch.cuda.cudart().cudaHostUnregister(address)
        except Exception:      # the CUDA context may be gone already at interpreter exit
            pass
    registered.clear()
