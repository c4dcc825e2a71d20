import random

import pytest

from worker.lora.slot_table import SlotTable
from worker.request import AdapterRef
from tests.worker.lora.slot_refs import refcount

A, B, C = AdapterRef("a", 1), AdapterRef("b", 1), AdapterRef("c", 1)


def test_first_acquire_loads_and_second_reuses():
    table = SlotTable(2)
    assert table.acquire(A) == (0, True)
    assert table.acquire(A) == (0, False)
    assert refcount(table, A) == 2
    assert table.acquire(B) == (1, True)


def test_released_adapter_is_reused_without_load():
    table = SlotTable(2)
    table.acquire(A)
    table.release(A)
    assert refcount(table, A) == 0 and table.slot_of(A) == 0
    assert table.acquire(A) == (0, False)


def test_new_uid_is_a_different_adapter():
    table = SlotTable(2)
    table.acquire(AdapterRef("a", 1))
    assert table.acquire(AdapterRef("a", 2)) == (1, True)


def test_empty_slot_taken_before_evicting():
    table = SlotTable(2)
    table.acquire(A)
    table.release(A)
    assert table.acquire(B) == (1, True)
    assert table.slot_of(A) == 0


def test_refcount_protects_from_eviction():
    table = SlotTable(1)
    table.acquire(A)
    assert not table.can_acquire(B)
    assert table.acquire(B) is None
    assert table.slot_of(A) == 0 and refcount(table, A) == 1
    assert table.can_acquire(A)
    table.acquire(A)
    table.release(A)
    assert table.acquire(B) is None          # still one reference left
    table.release(A)
    assert table.acquire(B) == (0, True)
    assert table.slot_of(A) is None


@pytest.mark.parametrize("policy, victim", [("lru", B), ("fifo", A)])
def test_victim_is_least_recently_released_or_first_loaded(policy, victim):
    table = SlotTable(2, policy)
    table.acquire(A)      # loaded first
    table.acquire(B)
    table.release(B)
    table.release(A)      # released last
    slot = table.slot_of(victim)
    assert table.acquire(C) == (slot, True)
    assert table.slot_of(victim) is None
    survivor = A if victim is B else B
    assert table.slot_of(survivor) is not None


def test_drop_forgets_unreferenced_adapter_and_frees_its_slot():
    table = SlotTable(2)
    table.acquire(A)
    table.acquire(B)
    table.release(A)
    assert table.drop(A) is True
    assert table.slot_of(A) is None
    assert table.drop(A) is False
    assert table.acquire(C) == (0, True)
    with pytest.raises(AssertionError):
        table.drop(B)


def test_release_without_reference_asserts():
    table = SlotTable(1)
    with pytest.raises(AssertionError):
        table.release(A)
    table.acquire(A)
    table.release(A)
    with pytest.raises(AssertionError):
        table.release(A)


def test_unknown_policy_rejected():
    with pytest.raises(ValueError, match="unknown slot eviction policy"):
        SlotTable(2, "random")


@pytest.mark.parametrize("policy", ["lru", "fifo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ops_match_reference_model(policy, seed):
    """Reference: a dict of resident adapters with refcount, release time and load time."""
    rng = random.Random(seed)
    refs = [AdapterRef(f"n{i}", 1) for i in range(7)]
    num_slots = 3
    table = SlotTable(num_slots, policy)
    resident: dict[AdapterRef, dict] = {}   # ref -> {"slot", "refs", "loaded", "released"}
    for t in range(500):
        ref = rng.choice(refs)
        held = [r for r, s in resident.items() if s["refs"] > 0]
        if held and rng.random() < 0.45:
            ref = rng.choice(held)
            table.release(ref)
            resident[ref]["refs"] -= 1
            resident[ref]["released"] = t
            continue
        got = table.acquire(ref)
        if ref in resident:
            assert got == (resident[ref]["slot"], False)
            resident[ref]["refs"] += 1
            continue
        used = {s["slot"] for s in resident.values()}
        free = [s for s in range(num_slots) if s not in used]
        idle = [r for r, s in resident.items() if s["refs"] == 0]
        if not free and not idle:
            assert got is None
            continue
        if free:
            expected_slot = min(free)
        else:
            order = "released" if policy == "lru" else "loaded"
            evicted = min(idle, key=lambda r: resident[r][order])
            expected_slot = resident.pop(evicted)["slot"]
        assert got == (expected_slot, True)
        resident[ref] = {"slot": expected_slot, "refs": 1, "loaded": t, "released": t}
        for r, s in resident.items():
            assert table.slot_of(r) == s["slot"] and refcount(table, r) == s["refs"]
