"""One owner for a rank's adapter tiers, built from one LoRAConfig (one max_loras, one max_lora_rank).

    registry ──reader (packer: a file into its entry layout)──▶ host cache ──loads──▶ GPU pool
    (names, versions)  (disk reads on threads)                 (LRU, page-locked,   (slot table: which adapter where;
                                                                own sizes)          entries laid out into slots)

Rank 0 (the engine) uses every tier: the registry names the adapters, the scheduler decides with the slot table and
the prefetcher, the loads carry out what it decided. A follower rank (ranks/follower.py) reads and copies its share
of what rank 0 announces into its own host cache and slots (`follow_read`, `follow_load`).

The runner builds the GPU pool with the model (`build_gpu_pool`: its memory plan counts the slots, its graphs read
them) before the manager is made over it.
"""
from __future__ import annotations

import concurrent.futures
import logging
from typing import Protocol

import torch
from torch import nn

from worker.config import LoRAConfig
from worker.lora.adapter import AdapterSpec
from worker.lora.gpu_pool import GPULoRAPool
from worker.lora.host_buffers import HostBuffers
from worker.lora.host_cache import HostAdapter, HostCache
from worker.lora.host_cache_plan import plan_host_cache
from worker.lora.loads import AdapterLoads
from worker.lora.prefetcher import Prefetcher
from worker.lora.reader import AdapterReader
from worker.lora.registry import AdapterRegistry
from worker.lora.shards import shard_loras_fully
from worker.lora.slot_layout import PackedReader
from worker.lora.slot_table import SlotTable
from worker.request import AdapterRef

logger = logging.getLogger(__name__)


class AdapterFollowers(Protocol):
    """The other tensor-parallel ranks as rank 0's adapter tiers see them (ranks/group.py's FollowerRanks): told of
    each read as it starts and of each copy as it is issued."""

    def read(self, ref: AdapterRef, spec: AdapterSpec) -> None: ...

    def load(self, ref: AdapterRef, spec: AdapterSpec, slot: int, rank: int) -> None: ...


def build_gpu_pool(model: nn.Module, config: LoRAConfig, dtype: torch.dtype, device: torch.device,
                   side_stream: bool) -> GPULoRAPool:
    """`config.max_loras` slots of `model`'s LoRA at `config.max_lora_rank`, viewed by its projections; with
    --fully-sharded-loras over several ranks, every projection is marked fully sharded before the slots are laid out."""
    world_size = model.tp.world_size
    fully_sharded = config.fully_sharded_loras and world_size > 1
    if fully_sharded:
        shard_loras_fully(model, config.max_lora_rank)
    pool = GPULoRAPool(model, config.max_loras, config.max_lora_rank, dtype, device, side_stream=side_stream)
    if world_size > 1:
        logger.info("LoRA %s over %d ranks: a slot takes %.2f MiB here", "fully sharded" if fully_sharded
                    else "sharded", world_size, pool.layout.num_bytes / 2**20)
    return pool


class AdapterManager:
    """A rank's adapter tiers over `pool` (the runner's, of `model`, built by `build_gpu_pool` from the same `config`).
    Rank 0 uses them all; a follower rank only `follow_read` and `follow_load` (its host cache, reader and pool).
    `followers`: on rank 0 under tensor parallelism, the ranks told of each read and copy."""

    def __init__(self, config: LoRAConfig, pool: GPULoRAPool, model: nn.Module,
                 followers: AdapterFollowers | None = None):
        if pool.num_slots != config.max_loras:
            raise ValueError(f"the GPU pool has {pool.num_slots} slots but max_loras is {config.max_loras}")
        overlap = config.enable_lora_overlap_loading
        self.config = config
        self.pool = pool                  # device bytes of the slots (owned with the model by the runner)
        self.host_cache = HostCache(*plan_host_cache(config, pool.layout.num_bytes, model.tp.world_size))
        self.buffers = HostBuffers(pin=pool.slots.device.type == "cuda")
        self.packer = PackedReader(pool.layout, self.buffers, read_threads=config.lora_read_threads if overlap else 1,
                                   shard=model)
        self.reader = AdapterReader(self.packer, self.host_cache, config.lora_load_workers,
                                    on_read=followers.read if followers is not None else None)
        # rank 0's decisions
        self.slots = SlotTable(config.max_loras, config.lora_eviction_policy)   # the scheduler's
        self.prefetcher = (Prefetcher(self.slots, self.host_cache, self.reader, window=max(2 * config.max_loras, 8),
                                      max_reads=2 * config.lora_load_workers)
                           if overlap else None)                 # None: blocking loads
        self.registry = AdapterRegistry(config, pool.layout.targets, self.slots, self.host_cache, self.reader)
        self.loads = AdapterLoads(self.reader, self.host_cache, pool, self.slots, self.registry,
                                  on_load=followers.load if followers is not None else None)
        # a follower's reads of its share: in flight, or done outside the host cache (no entry could be had)
        self._shard_reads: dict[AdapterRef, concurrent.futures.Future[tuple[HostAdapter, float]]] = {}

    def settle(self) -> int:
        """Wait until the memory of the adapters being read since startup is page-locked (the gateway asks before it
        serves: page-locking holds up the device's work, lora/host_buffers.py); how many buffers that was."""
        return self.buffers.settle()

    def resident_names(self) -> set[str]:
        """Names whose current version holds a GPU slot (loaded, or its copy in flight)."""
        current = self.registry.refs
        return {ref.name for ref in self.slots.residents() if current.get(ref.name) == ref}

    # a follower rank: what rank 0 announces

    def follow_read(self, ref: AdapterRef, spec: AdapterSpec) -> None:
        """Rank 0 began reading `ref`: read this rank's share beside it, on a reader thread, into the host cache
        (the least recently used entry out at capacity; outside it, until its load, while every entry is being
        read)."""
        self._file_shard_reads()
        if ref in self._shard_reads or self.host_cache.get(ref) is not None:
            return
        self.host_cache.reserve(ref, num_bytes=self.packer.entry_bytes(spec))
        self._shard_reads[ref] = self.reader.submit(spec)

    def follow_load(self, ref: AdapterRef, spec: AdapterSpec, slot: int, rank: int) -> None:
        """Rank 0 issued the copy of `ref` into `slot`: copy this rank's share into the same slot, once read (read
        now if no read was announced or its entry has gone). Raises what a failed read raised."""
        self.follow_read(ref, spec)
        entry = self.host_cache.get(ref)
        if entry is None:
            entry, _ = self._shard_reads.pop(ref).result()     # begun with rank 0's read: usually done
            self._keep(ref, entry)
        self.pool.start_load(slot, entry.packed, rank, ref, entry.layout)

    def _file_shard_reads(self) -> None:
        """Finished reads into the host cache; a failed one gives its entry back and waits for its load to raise."""
        for ref, future in [(r, f) for r, f in self._shard_reads.items() if f.done()]:
            if future.exception() is not None:
                self.host_cache.drop(ref)
            elif self._keep(ref, future.result()[0]):
                del self._shard_reads[ref]

    def _keep(self, ref: AdapterRef, entry: HostAdapter) -> bool:
        """File `entry` in its reserved host-cache entry, or in one made now; False when none can be had."""
        return ((ref in self.host_cache or self.host_cache.reserve(ref, num_bytes=entry.num_bytes))
                and self.host_cache.fill(ref, entry))
