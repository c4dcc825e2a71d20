import random

import pytest

from worker.kv_cache.block_allocator import BlockAllocator


@pytest.mark.parametrize("block_size, num_tokens, expected", [
    (16, 0, 0), (16, 1, 1), (16, 16, 1), (16, 17, 2), (16, 32, 2), (1, 5, 5), (4, 9, 3),
])
def test_blocks_needed_is_ceil(block_size, num_tokens, expected):
    assert BlockAllocator(4, block_size).blocks_needed(num_tokens) == expected


def test_allocate_hands_out_every_block_once():
    alloc = BlockAllocator(5, 4)
    first, second = alloc.allocate(3), alloc.allocate(2)
    assert sorted(first + second) == [0, 1, 2, 3, 4]
    assert alloc.num_free == 0
    assert alloc.allocate(0) == []


def test_exhaustion_raises_and_leaves_state_unchanged():
    alloc = BlockAllocator(3, 4)
    alloc.allocate(2)
    assert alloc.can_allocate(1) and not alloc.can_allocate(2)
    with pytest.raises(ValueError, match="only 1 are free"):
        alloc.allocate(2)
    assert alloc.num_free == 1
    assert alloc.allocate(1) == [2]


def test_free_returns_blocks_for_reuse():
    alloc = BlockAllocator(2, 4)
    blocks = alloc.allocate(2)
    alloc.free(blocks)
    assert alloc.num_free == 2
    assert sorted(alloc.allocate(2)) == [0, 1]


@pytest.mark.parametrize("bad", [[0, 0], [1], [7]])
def test_double_free_or_foreign_block_asserts(bad):
    alloc = BlockAllocator(4, 4)
    alloc.allocate(1)   # block 0 in use; 1 is free; 7 is out of range
    with pytest.raises(AssertionError):
        alloc.free(bad)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_allocate_free_matches_a_set_model(seed):
    rng = random.Random(seed)
    alloc = BlockAllocator(32, 8)
    owned: list[list[int]] = []
    for _ in range(300):
        if owned and rng.random() < 0.5:
            alloc.free(owned.pop(rng.randrange(len(owned))))
        else:
            n = rng.randint(0, 6)
            in_use = sum(len(b) for b in owned)
            assert alloc.can_allocate(n) == (n <= 32 - in_use)
            if alloc.can_allocate(n):
                owned.append(alloc.allocate(n))
        flat = [b for blocks in owned for b in blocks]
        assert len(set(flat)) == len(flat) and all(0 <= b < 32 for b in flat)
        assert alloc.num_free == 32 - len(flat)


def test_usage_is_the_fraction_of_blocks_handed_out():
    alloc = BlockAllocator(8, 4)
    assert alloc.usage == 0.0
    blocks = alloc.allocate(2)
    assert alloc.usage == 0.25
    alloc.allocate(6)
    assert alloc.usage == 1.0
    alloc.free(blocks)
    assert alloc.usage == 0.75
