"""The disk tier: reads registered adapters into the host cache, on a thread pool.

With overlap loading, reads never run in the step loop: `start` hands one to a worker thread (its host
cache entry already reserved by the caller) and `poll` files the finished ones into the host cache.
Blocking loads read in the caller's thread with `read_now`.
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from worker.lora.adapter import AdapterSpec
from worker.lora.host_cache import HostAdapter, HostCache
from worker.request import AdapterRef

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadResult:
    ref: AdapterRef
    entry: HostAdapter | None        # None when the read failed
    error: str | None
    seconds: float


class EntryReader(Protocol):
    """What reads an adapter into a host-cache entry (slot_layout.PackedReader)."""

    def __call__(self, spec: AdapterSpec, out: torch.Tensor | None = None) -> HostAdapter: ...

    def entry_bytes(self, spec: AdapterSpec) -> int: ...

    def prepare(self, spec: AdapterSpec) -> concurrent.futures.Future[torch.Tensor]: ...


class AdapterReader:
    """Reads registered adapters into `host`. `read` (spec, out -> HostAdapter) and `executor` may be
    replaced, e.g. by tests that hold a read back or run reads inline; `entries` (the reader `read` starts as)
    sizes the entries and prepares their memory. `on_read(ref, spec)` is told of each read as it starts (tensor parallelism: the other ranks
    read their shares beside it)."""

    def __init__(self, read: EntryReader, host: HostCache, num_workers: int,
                 on_read: Callable[[AdapterRef, AdapterSpec], None] | None = None):
        self.read: Callable[[AdapterSpec, torch.Tensor | None], HostAdapter] = read
        self.entries = read
        self.on_read = on_read
        self.host = host
        self._specs: dict[AdapterRef, AdapterSpec] = {}
        self.executor: concurrent.futures.Executor = concurrent.futures.ThreadPoolExecutor(
            num_workers, thread_name_prefix="lora-read")
        self._reads: dict[concurrent.futures.Future, AdapterRef] = {}

    def register(self, ref: AdapterRef, spec: AdapterSpec) -> None:
        self._specs[ref] = spec

    def forget(self, ref: AdapterRef) -> None:
        self._specs.pop(ref, None)

    def entry_bytes(self, ref: AdapterRef) -> int:
        """The size of `ref`'s host-cache entry (what the host cache reserves for its read)."""
        return self.entries.entry_bytes(self._specs[ref])

    def start(self, ref: AdapterRef, prepare: bool = False) -> None:
        """Read `ref` on a worker thread; its host entry is reserved already. `prepare`: its memory is made now,
        beside the other reads' (lora/host_buffers.py: before the server serves)."""
        self._announce(ref)
        spec = self._specs[ref]
        out = self.entries.prepare(spec) if prepare else None
        self._reads[self.executor.submit(self._timed_read, spec, out)] = ref

    def read_now(self, ref: AdapterRef) -> tuple[HostAdapter, float]:
        """Read `ref` in this thread: (entry, seconds). Raises what the read raised."""
        self._announce(ref)
        return self._timed_read(self._specs[ref])

    def poll(self) -> list[ReadResult]:
        """Reads finished since the last call, filed into the host cache (or their entries given back)."""
        results = []
        for future in [f for f in self._reads if f.done()]:
            ref = self._reads.pop(future)
            try:
                entry, seconds = future.result()
            except Exception as e:   # any failure ends the adapter's queued requests, never the worker
                logger.warning("Reading adapter %s failed: %s", ref.name, e)
                self.host.drop(ref)
                results.append(ReadResult(ref, None, str(e), 0.0))
                continue
            if self.host.fill(ref, entry):
                results.append(ReadResult(ref, entry, None, seconds))
        return results

    def wait(self, timeout: float) -> bool:
        """Block until a read finishes or `timeout` seconds pass; False when none finished."""
        if not self._reads:
            return False
        done, _ = concurrent.futures.wait(self._reads, timeout, concurrent.futures.FIRST_COMPLETED)
        return bool(done)

    def submit(self, spec: AdapterSpec) -> concurrent.futures.Future[tuple[HostAdapter, float]]:
        """Read `spec` on a worker thread, outside the host cache: (entry, seconds). A follower rank's reads
        (lora/manager.py), which its own host cache files."""
        return self.executor.submit(self._timed_read, spec)

    def spec(self, ref: AdapterRef) -> AdapterSpec:
        return self._specs[ref]

    def _announce(self, ref: AdapterRef) -> None:
        if self.on_read is not None:
            self.on_read(ref, self._specs[ref])

    @property
    def num_in_flight(self) -> int:
        return len(self._reads)

    def _timed_read(self, spec: AdapterSpec, out: concurrent.futures.Future[torch.Tensor] | None = None
                    ) -> tuple[HostAdapter, float]:
        start = time.perf_counter()
        with torch.inference_mode():
            entry = self.read(spec, None if out is None else out.result())
        return entry, time.perf_counter() - start

