"""The KV-cache events PrefixCache records: what becomes findable, what stops being, in the order a router needs."""
import random

import pytest

from worker.ipc.messages import SamplingParams
from worker.kv_cache.block_allocator import BlockAllocator
from worker.kv_cache.prefix_cache import PrefixCache, event_hash, hash_block
from worker.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored
from worker.request import AdapterRef, Request

A1, A2 = AdapterRef("sql", 1), AdapterRef("sql", 2)


def make_request(prompt, adapter=None, request_id="r"):
    return Request(request_id, list(prompt), SamplingParams(), 0, adapter)


def compute(cache, request, num_tokens):
    """Give `request` blocks for `num_tokens` computed tokens (after its cached prefix) and cache its full ones."""
    hit = cache.cached_prefix(request)
    cache.start_from(request, hit)
    request.block_ids = hit + cache.allocate(cache.blocks_needed(num_tokens) - len(hit))
    request.num_computed_tokens = num_tokens
    cache.cache_computed(request)


def stored(hashes, parent, tokens, adapter=None, size=2):
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens, block_size=size,
                       lora_id=None if adapter is None else adapter.uid, medium="GPU",
                       lora_name=None if adapter is None else adapter.name, group_idx=0,
                       kv_cache_spec_kind="full_attention")


@pytest.mark.parametrize("adapter", [None, A1])
def test_a_run_of_new_blocks_is_one_event_with_its_parent_and_tokens(adapter):
    cache = PrefixCache(BlockAllocator(8, 2), record_events=True)
    first = make_request([1, 2, 3, 4, 5], adapter)
    compute(cache, first, 5)
    h0 = hash_block(None, [1, 2], adapter)
    h1 = hash_block(h0, [3, 4], adapter)
    assert cache.take_events() == [stored([event_hash(h0), event_hash(h1)], None, [1, 2, 3, 4], adapter)]
    second = make_request([1, 2, 3, 4, 7, 7, 8], adapter, "r2")
    compute(cache, second, 7)
    assert cache.take_events() == [stored([event_hash(hash_block(h1, [7, 7], adapter))], event_hash(h1), [7, 7],
                                          adapter)]
    assert cache.take_events() == []


def test_evicted_blocks_are_removed_with_the_hashes_they_were_stored_with():
    cache = PrefixCache(BlockAllocator(3, 2), record_events=True)
    first = make_request([1, 2, 3, 4, 5])
    compute(cache, first, 5)
    announced = cache.take_events()[0].block_hashes
    cache.free(first.block_ids)
    compute(cache, make_request([9, 9, 9, 9, 9, 9], request_id="r2"), 6)   # needs every block: both evicted
    events = cache.take_events()
    assert events[0] == BlockRemoved(block_hashes=announced[::-1], medium="GPU", group_idx=0)  # tail first
    assert isinstance(events[1], BlockStored)


def test_a_block_whose_parent_was_evicted_is_not_cached_nor_announced():
    cache = PrefixCache(BlockAllocator(6, 2), record_events=True)
    owner = make_request([1, 2, 0])
    compute(cache, owner, 2)                                 # block [1, 2] cached by `owner`
    late = make_request([1, 2, 3, 4, 0], request_id="late")
    late.block_ids = cache.allocate(2)                       # computed [1, 2] again beside it: a duplicate
    late.num_computed_tokens = 2
    cache.cache_computed(late)
    cache.free(owner.block_ids)
    cache.allocate(cache.allocator.num_free + 1)             # evicts the cached [1, 2]
    cache.take_events()
    late.num_computed_tokens = 4
    cache.cache_computed(late)                               # [3, 4]'s parent is no longer findable
    assert cache.take_events() == [] and cache.num_cached == 0


def test_dropping_an_adapter_version_removes_its_blocks_and_frees_the_unused_ones():
    cache = PrefixCache(BlockAllocator(8, 2), record_events=True)
    done, running, base = make_request([1, 2, 3], A1, "done"), make_request([5, 6, 7], A1, "run"), make_request(
        [1, 2, 3], None, "base")
    for request in (done, running, base):
        compute(cache, request, 2)
    cache.free(done.block_ids)
    cache.take_events()
    cache.drop_adapter(A1)
    assert cache.take_events() == [BlockRemoved(block_hashes=[event_hash(hash_block(None, [1, 2], A1)),
                                                              event_hash(hash_block(None, [5, 6], A1))],
                                                medium="GPU", group_idx=0)]
    assert cache.allocator.num_free == 8 - 2 and cache.num_cached == 1      # `done`'s block is free again
    running.num_computed_tokens = 4
    running.prompt_token_ids += [8]
    cache.cache_computed(running)                            # a retired version caches nothing more
    assert cache.take_events() == [] and cache.cached_prefix(make_request([1, 2, 3], A2)) == []
    cache.free(running.block_ids)
    assert cache.allocator.num_free == 8 - 1


def test_reset_clears_everything_only_when_no_block_is_in_use():
    cache = PrefixCache(BlockAllocator(4, 2), record_events=True)
    request = make_request([1, 2, 3])
    compute(cache, request, 2)
    cache.take_events()
    assert not cache.reset() and cache.take_events() == [] and cache.num_cached == 1
    cache.free(request.block_ids)
    assert cache.reset() and cache.take_events() == [AllBlocksCleared()]
    assert cache.num_cached == 0 and cache.allocator.num_free == 4


def test_nothing_is_recorded_unless_asked():
    cache = PrefixCache(BlockAllocator(4, 2))
    compute(cache, make_request([1, 2, 3]), 2)
    assert cache.events is None and cache.take_events() == []


def test_event_ids_are_nonzero_64_bit_stable_and_distinct_per_prefix_tokens_and_version():
    rng = random.Random(0)
    ids = {}
    for _ in range(2000):
        parent = rng.choice([None, rng.getrandbits(64)])
        tokens = tuple(rng.randrange(50) for _ in range(2))
        adapter = rng.choice([None, A1, A2])
        key = hash_block(parent, tokens, adapter)
        assert 0 <= key < 2 ** 64 and hash_block(parent, list(tokens), adapter) == key
        block_id = event_hash(key)
        assert 0 < block_id < 2 ** 64 and event_hash(key) == block_id
        assert ids.setdefault(block_id, (parent, tokens, adapter)) == (parent, tokens, adapter)
    assert event_hash(0) != 0
