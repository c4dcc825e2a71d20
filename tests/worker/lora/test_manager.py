"""The adapter tiers' owner (lora/manager.py): every tier built from one LoRAConfig and wired to the others, the GPU
pool as the model's ranks hold it, and a follower rank's reads kept in the host cache (LRU at its capacity)."""
from __future__ import annotations

import concurrent.futures

import pytest
import torch

from tests.hf_fixtures import ADAPTERS
from tests.worker.lora.engine_runs import InlineExecutor, ManualExecutor
from worker.config import KernelConfig, LoRAConfig
from worker.distributed.tensor_parallel import SINGLE, TensorParallel
from worker.ipc.messages import LoadedAdapter
from worker.lora.adapter import AdapterSpec
from worker.lora.host_cache import HostAdapter
from worker.lora.manager import AdapterManager, build_gpu_pool
from worker.models.builder import build_model
from worker.request import AdapterRef

CPU = torch.device("cpu")
A, B, C = (AdapterRef(name, 1) for name in "abc")


def make_model(model_dir, tp: TensorParallel = SINGLE):
    return build_model(model_dir, torch.float32, CPU, "dummy", 64, KernelConfig(), tp=tp)


def make_manager(model_dir, config: LoRAConfig, followers=None) -> AdapterManager:
    model = make_model(model_dir)
    pool = build_gpu_pool(model, config, torch.float32, CPU, side_stream=False)
    return AdapterManager(config, pool, model, followers)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "blocking"])
def test_every_tier_is_built_from_one_lora_config(llama, overlap):
    config = LoRAConfig(max_loras=3, max_lora_rank=8, max_cpu_loras=5, enable_lora_overlap_loading=overlap,
                        lora_eviction_policy="fifo", lora_load_workers=3, lora_read_threads=2)
    m = make_manager(llama, config)
    assert (m.pool.num_slots, m.slots.num_slots, m.slots.policy) == (3, 3, "fifo")
    assert m.pool.max_rank == m.packer.layout.max_rank == 8 and m.packer.layout is m.pool.layout
    assert m.host_cache.capacity == 5
    assert m.packer.read_threads == (2 if overlap else 1) and not m.packer.buffers.pin and m.packer.buffers is m.buffers
    assert m.reader.read is m.packer and m.reader.host is m.host_cache and m.reader.on_read is None
    assert (m.registry.slots, m.registry.host_cache, m.registry.reader) == (m.slots, m.host_cache, m.reader)
    assert (m.loads.reader, m.loads.host_cache, m.loads.pool, m.loads.slots, m.loads.registry, m.loads.on_load) == (
        m.reader, m.host_cache, m.pool, m.slots, m.registry, None)
    if overlap:
        p = m.prefetcher
        assert (p.slots, p.host, p.reader, p.window, p.max_reads) == (m.slots, m.host_cache, m.reader, 8, 6)
    else:
        assert m.prefetcher is None


def test_a_gpu_pool_of_another_size_than_max_loras_is_refused(llama):
    model = make_model(llama)
    pool = build_gpu_pool(model, LoRAConfig(max_loras=2), torch.float32, CPU, side_stream=False)
    with pytest.raises(ValueError, match="the GPU pool has 2 slots but max_loras is 4"):
        AdapterManager(LoRAConfig(max_loras=4), pool, model)


def test_fully_sharded_loras_shrink_a_slot_only_over_several_ranks(llama):
    """--fully-sharded-loras cuts lora_A of column-parallel and lora_B of row-parallel projections too: a rank's
    slot takes fewer bytes than under the default scheme; at world size 1 it changes nothing."""
    def slot_bytes(tp: TensorParallel, fully_sharded: bool) -> int:
        config = LoRAConfig(max_loras=1, fully_sharded_loras=fully_sharded)
        return build_gpu_pool(make_model(llama, tp), config, torch.float32, CPU, side_stream=False).layout.num_bytes

    tp2 = TensorParallel(rank=1, world_size=2)
    assert slot_bytes(tp2, True) < slot_bytes(tp2, False) < slot_bytes(SINGLE, False) == slot_bytes(SINGLE, True)


class RecordingFollowers:
    def __init__(self):
        self.told: list[tuple] = []

    def read(self, ref, spec):
        self.told.append(("read", ref, spec))

    def load(self, ref, spec, slot, rank):
        self.told.append(("load", ref, spec, slot, rank))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "blocking"])
def test_followers_are_told_of_each_read_as_it_starts_and_each_copy_as_it_is_issued(llama, variants, overlap):
    followers = RecordingFollowers()
    m = make_manager(llama, LoRAConfig(max_loras=2, enable_lora_overlap_loading=overlap), followers)
    m.reader.executor = InlineExecutor()
    m.registry.add("v0", variants["v0"], warm=overlap)
    ref = m.registry.refs["v0"]
    spec = m.reader.spec(ref)
    assert followers.told == ([("read", ref, spec)] if overlap else [])
    m.loads.collect()
    assert m.loads.issue([(ref, 1)]) == []       # blocking: read here, first
    assert followers.told == [("read", ref, spec), ("load", ref, spec, 1, spec.rank)]


def test_resident_names_are_the_current_versions_holding_a_slot(llama, variants):
    m = make_manager(llama, LoRAConfig(max_loras=2))
    m.registry.add("x", variants["v0"])
    m.registry.add("y", variants["v1"])
    old_x = m.registry.acquire("x")              # a running request keeps this version alive
    m.slots.reserve(old_x)
    assert m.resident_names() == {"x"}
    m.registry.add("x", variants["v2"], load_inplace=True)
    assert m.resident_names() == set()           # the slot holds an older version of x
    m.slots.reserve(m.registry.refs["y"])
    assert m.resident_names() == {"y"}


def test_loaded_adapters_list_each_current_version_once_by_its_fastest_tier(llama, variants):
    """vllm:lora_adapter_loaded's series: "gpu" once a slot's copy is done, "cpu" for a filled host-cache entry."""
    m = make_manager(llama, LoRAConfig(max_loras=2))
    m.registry.add("x", variants["v0"])
    m.registry.add("y", variants["v1"], pinned=True)
    x, y = m.registry.refs["x"], m.registry.refs["y"]
    rank = {"x": ADAPTERS[0].r, "y": ADAPTERS[1].r}               # v0, v1: the fixtures' first two, scaled
    m.slots.reserve(x)                           # its copy in flight
    assert m.registry.loaded_adapters() == []
    m.slots.mark_loaded(x)
    m.host_cache.reserve(x)
    m.host_cache.fill(x, HostAdapter(torch.zeros(1, dtype=torch.uint8), rank["x"]))
    m.host_cache.reserve(y)
    assert m.registry.loaded_adapters() == [LoadedAdapter("x", "gpu", False, rank["x"])]    # y's read in flight
    m.host_cache.fill(y, HostAdapter(torch.zeros(1, dtype=torch.uint8), rank["y"]))
    assert m.registry.loaded_adapters() == [LoadedAdapter("x", "gpu", False, rank["x"]),
                                            LoadedAdapter("y", "cpu", True, rank["y"])]
    m.registry.acquire("x")                      # a running request keeps this version alive
    m.registry.add("x", variants["v2"], load_inplace=True)
    assert [a.name for a in m.registry.loaded_adapters()] == ["y"]      # the tiers hold an older version of x
    m.registry.remove("y")
    assert m.registry.loaded_adapters() == []


# a follower rank


class FollowerReads:
    """A follower's manager whose reads give each adapter `slot_bytes` bytes of a value of its own (its name's
    code), recording which adapters were read."""

    def __init__(self, model_dir, max_cpu_loras: int, executor: concurrent.futures.Executor):
        self.manager = make_manager(model_dir, LoRAConfig(max_loras=2, max_cpu_loras=max_cpu_loras))
        self.manager.reader.executor = executor
        self.manager.reader.read = self._read
        self.reads: list[str] = []
        self.failing: set[str] = set()

    def _read(self, spec: AdapterSpec, out: torch.Tensor | None = None) -> HostAdapter:
        self.reads.append(spec.name)
        if spec.name in self.failing:
            raise OSError(f"{spec.name} is gone")
        return HostAdapter(self.packed(spec.name), rank=4)

    def packed(self, name: str) -> torch.Tensor:
        return torch.full((self.manager.pool.layout.num_bytes,), ord(name), dtype=torch.uint8)

    def cached(self) -> list[bool]:
        return [ref in self.manager.host_cache for ref in (A, B, C)]


def spec(ref: AdapterRef) -> AdapterSpec:
    return AdapterSpec(ref.name, f"/adapters/{ref.name}", 4, ("q_proj",))


def test_follower_reads_are_kept_least_recently_used_at_the_host_cache_capacity(llama):
    f = FollowerReads(llama, max_cpu_loras=2, executor=InlineExecutor())
    m = f.manager
    for ref in (A, B, A):
        m.follow_read(ref, spec(ref))            # announced twice, A is read once and is now the most recent
    m.follow_read(C, spec(C))
    assert f.reads == ["a", "b", "c"] and f.cached() == [True, False, True] and m.host_cache.evictions == 1
    m.follow_load(B, spec(B), 1, 4)              # evicted: read again, in place of A (used least recently)
    m.follow_load(C, spec(C), 0, 4)              # cached: no read
    assert f.reads == ["a", "b", "c", "b"] and f.cached() == [False, True, True]
    assert torch.equal(m.pool.slots[1], f.packed("b")) and torch.equal(m.pool.slots[0], f.packed("c"))
    assert m.pool.ranks_host == [4, 4]


def test_a_follower_load_without_an_announced_read_reads_first(llama):
    f = FollowerReads(llama, max_cpu_loras=2, executor=InlineExecutor())
    f.manager.follow_load(A, spec(A), 0, 4)
    assert f.reads == ["a"] and f.cached() == [True, False, False]
    assert torch.equal(f.manager.pool.slots[0], f.packed("a"))


def test_a_follower_read_starts_at_once_even_while_every_entry_is_being_read(llama):
    """Capacity 1, A still being read: B's read starts beside it, outside the cache, and its load uses it."""
    executor = ManualExecutor()
    f = FollowerReads(llama, max_cpu_loras=1, executor=executor)
    m = f.manager
    m.follow_read(A, spec(A))
    m.follow_read(B, spec(B))
    assert len(executor.held) == 2 and f.cached() == [True, False, False]
    executor.run_all()
    m.follow_load(B, spec(B), 1, 4)
    assert f.reads == ["a", "b"] and f.cached() == [False, True, False]      # B took A's place once A was read
    assert torch.equal(m.pool.slots[1], f.packed("b"))


def test_a_failed_follower_read_gives_its_entry_back_and_raises_at_its_load(llama):
    f = FollowerReads(llama, max_cpu_loras=1, executor=InlineExecutor())
    f.failing.add("a")
    m = f.manager
    m.follow_read(A, spec(A))
    m.follow_read(B, spec(B))                    # the cache's one entry is B's: A's failed read holds none
    assert f.cached() == [False, True, False]
    with pytest.raises(OSError, match="a is gone"):
        m.follow_load(A, spec(A), 0, 4)
