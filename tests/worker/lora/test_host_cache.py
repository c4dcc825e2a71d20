import random

import pytest
import torch

from worker.lora.host_cache import HostAdapter, HostCache
from worker.request import AdapterRef

REFS = [AdapterRef(f"a{i}", 1) for i in range(6)]
A, B, C, D = REFS[:4]


def entry(n: int = 8) -> HostAdapter:
    return HostAdapter(torch.zeros(n, dtype=torch.uint8), rank=4)


def cached(cache: HostCache, *refs: AdapterRef) -> None:
    for ref in refs:
        assert cache.reserve(ref)
        assert cache.fill(ref, entry())


def test_reads_in_flight_count_against_capacity_and_are_never_evicted():
    cache = HostCache(2)
    assert cache.reserve(A)
    assert A in cache and not cache.is_filled(A) and cache.get(A) is None
    cached(cache, B)
    assert cache.reserve(C)              # A is being read: B goes
    assert [r in cache for r in (A, B, C)] == [True, False, True]
    assert not cache.reserve(D)          # both entries are being read
    assert cache.evictions == 1


def test_full_cache_evicts_least_recently_used_filled_entry():
    cache = HostCache(3)
    cached(cache, A, B, C)
    cache.get(A)                         # A is now the most recently used
    assert cache.reserve(D)
    assert B not in cache and [r in cache for r in (A, C, D)] == [True, True, True]
    assert cache.evictions == 1


def test_entries_being_read_pinned_or_protected_are_never_evicted():
    cache = HostCache(3)
    cached(cache, A, B)
    assert cache.reserve(C)              # C: read in flight
    cache.pin(A)
    assert not cache.reserve(D, protected={B})
    assert [r in cache for r in (A, B, C, D)] == [True, True, True, False] and cache.evictions == 0
    assert cache.reserve(D)              # B unprotected now
    assert B not in cache


def test_victim_is_the_adapter_needed_latest_then_never_needed_first():
    cache = HostCache(3)
    cached(cache, A, B, C)
    assert cache.reserve(D, next_use={A: 0, B: 2, C: 1})     # all needed: B is needed last
    assert B not in cache
    cache.drop(D)
    cached(cache, B)
    assert cache.reserve(D, next_use={A: 0, B: 1})           # C is never needed again
    assert C not in cache


def test_unbounded_cache_never_evicts():
    cache = HostCache(None)
    cached(cache, *REFS)
    assert len(cache) == len(REFS) and cache.evictions == 0
    assert cache.num_bytes == 8 * len(REFS)


def test_fill_after_drop_is_refused_and_unpin_makes_evictable():
    cache = HostCache(1)
    assert cache.reserve(A)
    cache.drop(A)
    assert not cache.fill(A, entry()) and A not in cache
    cached(cache, B)
    cache.pin(B)
    assert not cache.reserve(C)
    cache.unpin(B)
    assert cache.reserve(C) and B not in cache


def test_capacity_below_one_is_refused():
    with pytest.raises(ValueError, match="--max-cpu-loras must be at least 1"):
        HostCache(0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ops_match_reference_model(seed):
    """Reference: a list of (ref, filled) in recency order, oldest first."""
    rng = random.Random(seed)
    cache, capacity = HostCache(3), 3
    model: list[list] = []
    pinned: set = set()
    for _ in range(400):
        ref, op = rng.choice(REFS), rng.random()
        present = [r for r, _ in model]
        if op < 0.4 and ref not in present:
            protected = set(rng.sample(REFS, 2))
            evictable = [r for r, filled in model if filled and r not in pinned and r not in protected]
            ok = cache.reserve(ref, protected)
            if len(model) >= capacity:
                assert ok == bool(evictable)
                if not ok:
                    continue
                model = [m for m in model if m[0] != evictable[0]]
            model.append([ref, False])
        elif op < 0.7 and ref in present and not dict(model)[ref]:
            assert cache.fill(ref, entry())
            model = [m for m in model if m[0] != ref] + [[ref, True]]
        elif op < 0.85:
            got = cache.get(ref)
            assert (got is not None) == (ref in present and dict(model)[ref])
            if got is not None:
                model = [m for m in model if m[0] != ref] + [[ref, True]]
        elif op < 0.92:
            cache.pin(ref)
            pinned.add(ref)
        else:
            cache.unpin(ref)
            pinned.discard(ref)
        assert [(r, cache.is_filled(r)) for r in REFS if r in cache] == \
            sorted(((r, f) for r, f in model), key=lambda m: REFS.index(m[0]))


# the byte bound: entries at their own sizes


def test_a_large_entry_evicts_as_many_least_recent_entries_as_its_bytes_need():
    cache = HostCache(None, capacity_bytes=100)
    for ref, size in ((A, 30), (B, 30), (C, 30)):
        assert cache.reserve(ref, num_bytes=size) and cache.fill(ref, entry(size))
    assert cache.num_bytes == 90 and cache.has_room(10) and not cache.has_room(11)
    cache.get(A)                                          # A is now the most recent: B, then C go first
    assert cache.reserve(D, num_bytes=70)
    assert [r in cache for r in (A, B, C, D)] == [True, False, False, True]
    assert cache.num_bytes == 100 and cache.evictions == 2


def test_a_reservation_that_eviction_cannot_make_room_for_evicts_nothing():
    cache = HostCache(None, capacity_bytes=100)
    assert cache.reserve(A, num_bytes=60) and cache.fill(A, entry(60))
    assert cache.reserve(B, num_bytes=30)                 # being read: cannot go
    assert not cache.reserve(C, num_bytes=80)             # A's 60 would leave 70 in use
    assert not cache.reserve(D, num_bytes=101)            # larger than the whole cache
    assert A in cache and B in cache and cache.num_bytes == 90 and cache.evictions == 0
    assert not cache.reserve(C, num_bytes=50, protected={A})
    assert cache.reserve(C, num_bytes=50) and A not in cache and cache.num_bytes == 80


def test_both_bounds_hold_and_bytes_follow_fills_and_drops():
    cache = HostCache(2, capacity_bytes=100)
    assert cache.reserve(A, num_bytes=10) and cache.fill(A, entry(10))
    assert cache.reserve(B, num_bytes=10) and cache.fill(B, entry(10))
    assert cache.reserve(C, num_bytes=10)                 # the count bound: A goes though the bytes fit
    assert A not in cache and cache.num_bytes == 20
    assert cache.fill(C, entry(25))                       # its directory changed since reserved: its real size
    assert cache.num_bytes == 35
    cache.drop(B)
    cache.drop(B)
    assert cache.num_bytes == 25 and len(cache) == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_sized_ops_keep_both_bounds_and_evict_least_recent_first(seed):
    """Reference: entries in recency order with their sizes; eviction takes filled, unpinned ones oldest first."""
    rng = random.Random(seed)
    capacity, capacity_bytes = 4, 100
    cache = HostCache(capacity, capacity_bytes)
    model: list[list] = []              # [ref, filled, size]
    for _ in range(500):
        ref, op = rng.choice(REFS), rng.random()
        present = {m[0]: m for m in model}
        if op < 0.5 and ref not in present:
            size = rng.randint(1, 60)
            evictable = [m for m in model if m[1]]
            count, used, victims = len(model) + 1, sum(m[2] for m in model) + size, []
            for m in evictable:
                if count <= capacity and used <= capacity_bytes:
                    break
                victims.append(m[0])
                count, used = count - 1, used - m[2]
            fits = count <= capacity and used <= capacity_bytes
            assert cache.reserve(ref, num_bytes=size) == fits
            if fits:
                model = [m for m in model if m[0] not in victims] + [[ref, False, size]]
        elif op < 0.8 and ref in present and not present[ref][1]:
            assert cache.fill(ref, entry(present[ref][2]))
            model = [m for m in model if m[0] != ref] + [[ref, True, present[ref][2]]]
        elif op < 0.9:
            got = cache.get(ref)
            assert (got is not None) == (ref in present and present[ref][1])
            if got is not None:
                model = [m for m in model if m[0] != ref] + [present[ref]]
        else:
            cache.drop(ref)
            model = [m for m in model if m[0] != ref]
        assert [r for r in REFS if r in cache] == [r for r in REFS if r in {m[0] for m in model}]
        assert cache.num_bytes == sum(m[2] for m in model) <= capacity_bytes and len(cache) <= capacity
