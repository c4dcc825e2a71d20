"""Registered adapter names, their versions, and what the tiers report about them.

A name maps to its current AdapterRef; a version stays alive while unfinished requests run on it, so a
`load_inplace` or an unload never changes weights under a running request. Owned by the engine.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

from worker.config import LoRAConfig
from worker.ipc.messages import AdapterState, LoadedAdapter, LoRAStats, LoRATierStats
from worker.lora.adapter import AdapterError, AdapterSpec, inspect_adapter
from worker.lora.host_cache import HostCache
from worker.lora.reader import AdapterReader
from worker.lora.slot_table import SlotTable
from worker.lora.targets import LoRATargets
from worker.request import AdapterRef

logger = logging.getLogger(__name__)

LOAD_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass
class AdapterVersion:
    """One registered version of an adapter name."""
    spec: AdapterSpec
    version: int                     # 1 when the name is first loaded, +1 per load_inplace
    pinned: bool
    users: int = 0                   # unfinished requests on this version
    last_used: float | None = None   # unix time of its latest request
    disk_load_s: float | None = None
    gpu_load_s: float | None = None


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    loads: int = 0
    loaded_bytes: int = 0
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LOAD_SECONDS_BUCKETS) + 1))
    latency_sum: float = 0.0

    def observe(self, seconds: float, num_bytes: int) -> None:
        self.loads += 1
        self.loaded_bytes += num_bytes
        self.latency_counts[bisect.bisect_left(LOAD_SECONDS_BUCKETS, seconds)] += 1
        self.latency_sum += seconds

    def message(self, evictions: int) -> LoRATierStats:
        return LoRATierStats(hits=self.hits, misses=self.misses, loads=self.loads, loaded_bytes=self.loaded_bytes,
                             evictions=evictions, load_seconds_counts=list(self.latency_counts),
                             load_seconds_sum=self.latency_sum)


class AdapterRegistry:
    def __init__(self, config: LoRAConfig, targets: LoRATargets, slots: SlotTable, host_cache: HostCache,
                 reader: AdapterReader):
        self.config, self.targets = config, targets      # the base model's LoRA targets: what adapters must fit
        self.slots, self.host_cache, self.reader = slots, host_cache, reader
        self.refs: dict[str, AdapterRef] = {}                 # registered name -> current version
        self.versions: dict[AdapterRef, AdapterVersion] = {}  # live versions (current, or still in use)
        self.tiers = {"host": TierCounters(), "gpu": TierCounters()}
        self._uids = 0
        self._loaded: list[LoadedAdapter] = []
        self._loaded_key: tuple | None = None

    def add(self, name: str, path: str, *, load_inplace: bool = False, pinned: bool = False,
            warm: bool = False) -> None:
        """Validate and register an adapter; its weights are read when a request first needs them, or, when
        `warm` and the host cache has room without evicting anything, now on a reader thread, its memory
        page-locked beside the other warm adapters' (the adapters the server starts with: their first requests then
        pay only the host -> GPU copy, and the gateway waits for their memory before it serves; AdapterManager.settle)."""
        if name in self.refs and not load_inplace:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                               "adapter in place, set 'load_inplace' to True.")
        spec = inspect_adapter(name, path, self.targets, self.config.max_lora_rank)
        if pinned:
            self._check_pin_room(name)
        old = self.refs.get(name)
        self._uids += 1
        ref = AdapterRef(name, self._uids)
        self.refs[name] = ref
        self.versions[ref] = AdapterVersion(spec, 1 if old is None else self.versions[old].version + 1, pinned)
        self.reader.register(ref, spec)
        if pinned:
            self.slots.pin(ref)
            self.host_cache.pin(ref)
        if old is not None:
            self._release(old)
        if warm:
            size = self.reader.entry_bytes(ref)
            if self.host_cache.has_room(size):
                self.host_cache.reserve(ref, num_bytes=size)
                self.reader.start(ref, prepare=True)
        logger.info("adapter %s (rank %d, %s) registered from %s", name, spec.rank,
                    ",".join(spec.target_modules), path)

    def remove(self, name: str) -> None:
        """Unregister `name`: new requests get 404, unfinished ones finish, then its memory is freed."""
        ref = self.refs.pop(name, None)
        if ref is None:
            raise AdapterError(f"The lora adapter '{name}' cannot be found.", status_code=404)
        self._release(ref)

    def acquire(self, name: str) -> AdapterRef:
        """The current version of `name` for a new request, counted as a hit or miss of each tier. Only `add`
        registers a name: a --lora-dir adapter is loaded by the gateway's command before its first request,
        so a request that arrives after its adapter's unload finds nothing, and the gateway and the worker
        keep the same names."""
        ref = self.refs.get(name)
        if ref is None:
            raise AdapterError(f"The model `{name}` does not exist.", status_code=404)
        version = self.versions[ref]
        version.users += 1
        version.last_used = time.time()
        gpu, host = self.tiers["gpu"], self.tiers["host"]
        if self.slots.slot_of(ref) is not None:
            gpu.hits += 1
        else:
            gpu.misses += 1
            if ref in self.host_cache:
                host.hits += 1
            else:
                host.misses += 1
        return ref

    def release(self, ref: AdapterRef) -> None:
        """A request on `ref` finished; an old version goes once its last request does."""
        version = self.versions.get(ref)
        if version is None:
            return
        version.users -= 1
        if self.refs.get(ref.name) != ref:
            self._release(ref)

    def loaded(self, ref: AdapterRef, tier: str, seconds: float, num_bytes: int) -> None:
        """A disk read ("host") or a slot copy ("gpu") of `ref` finished."""
        self.tiers[tier].observe(seconds, num_bytes)
        version = self.versions.get(ref)
        if version is None:
            return
        if tier == "host":
            version.disk_load_s = seconds
        else:
            version.gpu_load_s = seconds

    def states(self, running: Counter, waiting: Counter) -> list[AdapterState]:
        """Where each registered adapter stands, by name; running/waiting count requests per ref."""
        return [self._state(ref, running[ref], waiting[ref]) for _, ref in sorted(self.refs.items())]

    def stats(self) -> LoRAStats:
        return LoRAStats(gpu_slots_used=self.slots.num_used, gpu_slots_total=self.slots.num_slots,
                         host_entries=len(self.host_cache), host_capacity=self.host_cache.capacity,
                         host_bytes=self.host_cache.num_bytes, load_seconds_buckets=list(LOAD_SECONDS_BUCKETS),
                         host=self.tiers["host"].message(self.host_cache.evictions),
                         gpu=self.tiers["gpu"].message(self.slots.evictions), loaded=self.loaded_adapters())

    def loaded_adapters(self) -> list[LoadedAdapter]:
        """The registered names whose current version is in a GPU slot (its copy done: "gpu") or, if not, filled
        in the host cache ("cpu"), by name. A name leaves the list when it is evicted from both tiers or unloaded.
        This runs every step: the list is made again only when a tier or the names changed since (a walk of a
        thousand host entries took ~40 % of an 8-stream step loop's host time on an H200 host)."""
        key = (self.slots.changes, self.host_cache.changes, self._uids, len(self.refs), len(self.versions))
        if key != self._loaded_key:
            self._loaded, self._loaded_key = self._walk_loaded(), key
        return self._loaded

    def _walk_loaded(self) -> list[LoadedAdapter]:
        loaded = []
        for ref in set(self.slots.residents()) | set(self.host_cache.filled()):
            level = "gpu" if self.slots.is_loaded(ref) else "cpu" if self.host_cache.is_filled(ref) else None
            if level is not None and self.refs.get(ref.name) == ref:
                version = self.versions[ref]
                loaded.append(LoadedAdapter(ref.name, level, version.pinned, version.spec.rank))
        return sorted(loaded, key=lambda adapter: adapter.name)

    def _state(self, ref: AdapterRef, num_running: int, num_waiting: int) -> AdapterState:
        v, slots = self.versions[ref], self.slots
        residency = ("gpu" if slots.is_loaded(ref) else "host" if self.host_cache.is_filled(ref) else "disk")
        loading = slots.is_loading(ref) or (ref in self.host_cache and not self.host_cache.is_filled(ref))
        return AdapterState(name=ref.name, path=v.spec.path, version=v.version, residency=residency,
                            loading=loading, slot=slots.slot_of(ref), rank=v.spec.rank,
                            target_modules=list(v.spec.target_modules), pinned=v.pinned, last_used=v.last_used,
                            disk_load_ms=_ms(v.disk_load_s), gpu_load_ms=_ms(v.gpu_load_s),
                            num_running=num_running, num_waiting=num_waiting)

    def _check_pin_room(self, name: str) -> None:
        """At least one GPU slot and one host-cache entry must stay free of pinned adapters."""
        pinned = sum(self.versions[ref].pinned for n, ref in self.refs.items() if n != name)
        room = min(self.config.max_loras, self.host_cache.capacity or self.config.max_loras)
        if pinned + 1 >= room:
            raise AdapterError(f"Cannot pin LoRA adapter '{name}': {pinned} adapters are pinned already, and "
                               f"at least one of the {room} adapter places (--max-loras, --max-cpu-loras) must "
                               "stay free for unpinned adapters.")

    def _release(self, ref: AdapterRef) -> None:
        """Forget a version that is no longer current once no unfinished request runs on it."""
        version = self.versions.get(ref)
        if version is None or version.users > 0:
            return
        del self.versions[ref]
        for tier in (self.slots, self.host_cache):
            tier.drop(ref)
            tier.unpin(ref)
        self.reader.forget(ref)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1e3 * seconds, 3)
