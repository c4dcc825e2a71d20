"""Carries out the adapter loads the scheduler decides: disk reads into the host cache, host -> slot copies.

Owned by the engine; one step uses it in order:

    failed = loads.collect()              # file the reads and copies that finished since the last step
    batch = scheduler.schedule()
    failed += loads.issue(batch.adapter_loads)   # start each (adapter, slot) copy; blocking loads read here
    loads.join(batch.lora_slots)          # the step waits, on the device, for its adapters' copies

A read that fails (a directory changed or removed since it was registered) is returned as a FailedLoad:
the engine ends that adapter's requests with its message. `wait` lets a step with nothing to run wait for
the next load instead of spinning.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from worker.lora.adapter import AdapterSpec
from worker.lora.gpu_pool import GPULoRAPool
from worker.lora.host_cache import HostAdapter, HostCache
from worker.lora.reader import AdapterReader
from worker.lora.registry import AdapterRegistry
from worker.lora.slot_table import SlotTable
from worker.request import AdapterRef

POLL_S = 0.0005       # while waiting for a copy (no host thread to wait on), check this often


@dataclass(frozen=True)
class FailedLoad:
    ref: AdapterRef
    message: str       # for the adapter's requests: "Loading LoRA adapter 'x' failed: ..."


class AdapterLoads:
    def __init__(self, reader: AdapterReader, host_cache: HostCache, pool: GPULoRAPool, slots: SlotTable,
                 registry: AdapterRegistry, on_load: Callable[[AdapterRef, AdapterSpec, int, int], None] | None = None):
        self.reader, self.host_cache, self.pool = reader, host_cache, pool
        self.on_load = on_load        # (ref, spec, slot, rank) of each copy issued: the other tensor-parallel ranks'
        self.slots = slots            # the scheduler's slot table: a finished copy marks its slot loaded
        self.registry = registry      # load times and bytes, per tier
        self._copies_in_flight = 0
        self._failed: list[FailedLoad] = []   # found by wait(), returned by the next collect()

    @property
    def num_in_flight(self) -> int:
        """Disk reads and slot copies started and not yet filed."""
        return self.reader.num_in_flight + self._copies_in_flight

    def collect(self) -> list[FailedLoad]:
        """File the disk reads and slot copies that finished; returns the reads that failed."""
        self._file_finished()
        failed, self._failed = self._failed, []
        return failed

    def issue(self, loads: list[tuple[AdapterRef, int]]) -> list[FailedLoad]:
        """Start the copy of each (adapter, slot) beside the step in flight. An adapter not yet in host
        memory (blocking loads) is read from disk here first; returns the reads that failed."""
        failed = []
        for ref, slot in loads:
            entry = self.host_cache.get(ref)
            if entry is None:
                try:
                    entry = self._read_now(ref)
                except Exception as e:    # a directory that changed since it was registered
                    failed.append(_failed(ref, str(e)))
                    continue
            self.pool.start_load(slot, entry.packed, entry.rank, ref, entry.layout)
            if self.on_load is not None:
                self.on_load(ref, self.reader.spec(ref), slot, entry.rank)
            self._copies_in_flight += 1
        return failed

    def join(self, slots: set[int]) -> None:
        """Order the next step's device work after the copies into `slots`."""
        self.pool.wait_for(slots)

    def wait(self, deadline: float) -> bool:
        """Wait until a load finishes (True; the next collect() files it), no load is in flight or
        `deadline` (time.monotonic()) passes (False)."""
        while self.num_in_flight:
            if self._file_finished():
                return True
            if time.monotonic() >= deadline:
                return False
            if self.reader.num_in_flight:
                self.reader.wait(POLL_S)
            else:
                time.sleep(POLL_S)
        return False

    def _file_finished(self) -> int:
        """File finished reads (failures kept for collect()) and copies; how many finished."""
        reads = self.reader.poll()
        for read in reads:
            if read.error is not None:
                self._failed.append(_failed(read.ref, read.error))
            else:
                self.registry.loaded(read.ref, "host", read.seconds, read.entry.num_bytes)
        copies = self.pool.finished_loads()
        self._copies_in_flight -= len(copies)
        for copy in copies:
            if self.slots.mark_loaded(copy.key):
                self.registry.loaded(copy.key, "gpu", copy.seconds, copy.source.numel())
        return len(reads) + len(copies)

    def _read_now(self, ref: AdapterRef) -> HostAdapter:
        """Read `ref` in this thread into the host cache (when it has room); raises what the read raised."""
        cached = self.host_cache.reserve(ref, num_bytes=self.reader.entry_bytes(ref))
        try:
            entry, seconds = self.reader.read_now(ref)
        except Exception:
            self.host_cache.drop(ref)
            raise
        if cached:
            self.host_cache.fill(ref, entry)
        self.registry.loaded(ref, "host", seconds, entry.num_bytes)
        return entry


def _failed(ref: AdapterRef, error: str) -> FailedLoad:
    return FailedLoad(ref, f"Loading LoRA adapter '{ref.name}' failed: {error}")
