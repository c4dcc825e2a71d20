"""PrefixCache: the hash chain, reference counts, and the LRU of cached blocks nobody uses."""
import pytest

from worker.ipc.messages import SamplingParams
from worker.kv_cache.block_allocator import BlockAllocator
from worker.kv_cache.prefix_cache import PrefixCache, hash_block
from worker.request import AdapterRef, Request

A1, A2, B1 = AdapterRef("a", 1), AdapterRef("a", 2), AdapterRef("b", 3)


def make_request(prompt, adapter=None, prompt_logprobs=None, outputs=()):
    request = Request("r", list(prompt), SamplingParams(prompt_logprobs=prompt_logprobs), 0, adapter)
    request.output_token_ids = list(outputs)
    return request


def computed(cache, request, num_tokens):
    """Give `request` blocks for `num_tokens` computed tokens and cache its full ones."""
    request.block_ids = cache.allocate(cache.blocks_needed(num_tokens))
    request.num_computed_tokens = num_tokens
    cache.cache_computed(request)
    return request.block_ids


@pytest.mark.parametrize("other", [(None, (5, 6), B1), (None, (5, 6), A2), (None, (5, 6), None),
                                   (None, (5, 7), A1), (123, (5, 6), A1)])
def test_block_key_covers_parent_tokens_adapter_and_version(other):
    assert hash_block(None, (5, 6), A1) == hash_block(None, [5, 6], AdapterRef("a", 1))
    assert hash_block(*other) != hash_block(None, (5, 6), A1)


def test_same_block_tokens_after_different_prefixes_differ():
    cache = PrefixCache(BlockAllocator(8, 2))
    first = computed(cache, make_request([1, 2, 9, 9, 0]), 4)
    assert cache.cached_prefix(make_request([3, 4, 9, 9, 0])) == []
    assert cache.cached_prefix(make_request([1, 2, 9, 9, 0])) == first


@pytest.mark.parametrize("prompt_len, expected_blocks", [(8, 3), (9, 4), (7, 3), (3, 1), (2, 0), (1, 0)])
def test_hit_leaves_at_least_the_last_token_to_compute(prompt_len, expected_blocks):
    cache = PrefixCache(BlockAllocator(16, 2))
    computed(cache, make_request(range(10)), 10)
    assert len(cache.cached_prefix(make_request(range(prompt_len)))) == expected_blocks


def test_hit_covers_a_preempted_requests_own_outputs():
    cache = PrefixCache(BlockAllocator(8, 2))
    request = make_request([1, 2, 3], outputs=[7, 8])
    blocks = computed(cache, request, 5)
    assert cache.cached_prefix(make_request([1, 2, 3, 7, 8, 4])) == blocks[:2]


def test_pending_token_blocks_wait_until_the_token_is_known():
    cache = PrefixCache(BlockAllocator(8, 2))
    request = make_request([1, 2, 3])
    request.block_ids = cache.allocate(2)
    request.num_computed_tokens, request.num_pending = 4, 1   # position 3's token is still on the device
    cache.cache_computed(request)
    assert cache.num_cached == 1
    request.num_pending, request.output_token_ids = 0, [7]
    cache.cache_computed(request)
    assert cache.num_cached == 2 and cache.cached_prefix(make_request([1, 2, 3, 7, 0])) == request.block_ids


def test_adapters_and_versions_never_share():
    cache = PrefixCache(BlockAllocator(16, 2))
    prompt = [1, 2, 3, 4, 5]
    blocks = computed(cache, make_request(prompt, A1), 5)
    assert cache.cached_prefix(make_request(prompt, A1)) == blocks[:2]
    for adapter in (A2, B1, None):
        assert cache.cached_prefix(make_request(prompt, adapter)) == []


def test_prompt_logprobs_take_no_hit_and_are_not_counted_but_fill_the_cache():
    cache = PrefixCache(BlockAllocator(8, 2))
    request = make_request([1, 2, 3, 4, 5], prompt_logprobs=1)
    blocks = computed(cache, request, 5)
    assert cache.cached_prefix(request) == []
    cache.start_from(request, [])
    assert (cache.queries, cache.hits) == (0, 0)
    assert cache.cached_prefix(make_request([1, 2, 3, 4, 5])) == blocks[:2]


def test_unused_cached_blocks_are_evicted_only_when_the_free_list_is_empty():
    cache = PrefixCache(BlockAllocator(6, 2))
    blocks = computed(cache, make_request([1, 2, 3, 4, 5]), 5)       # blocks 0, 1 cached, 2 not
    cache.free(blocks)
    assert cache.num_free == 6 and cache.usage == 0.0 and cache.num_cached == 2
    assert cache.allocate(4) == [3, 4, 5, 2]                            # the free list first
    assert cache.num_cached == 2 and cache.cached_prefix(make_request([1, 2, 3, 4, 5])) == blocks[:2]
    assert cache.allocate(1) == [1]                                     # then the tail of the freed chain
    assert cache.cached_prefix(make_request([1, 2, 3, 4, 5])) == [0]
    assert cache.allocate(1) == [0] and cache.num_cached == 0
    assert not cache.can_allocate(1)


def test_eviction_takes_least_recently_freed_first():
    cache = PrefixCache(BlockAllocator(4, 2))
    old = computed(cache, make_request([1, 2, 0]), 2)
    new = computed(cache, make_request([3, 4, 0]), 2)
    cache.free(old)
    cache.free(new)
    cache.allocate(2)   # the free list
    assert cache.allocate(1) == old
    assert cache.cached_prefix(make_request([3, 4, 0])) == new


def test_take_holds_a_cached_block_out_of_the_lru():
    cache = PrefixCache(BlockAllocator(3, 2))
    blocks = computed(cache, make_request([1, 2, 0]), 2)
    cache.free(blocks)
    hit = cache.cached_prefix(make_request([1, 2, 0]))
    assert cache.num_evictable(hit) == 1
    cache.take(hit)
    assert cache.num_evictable(hit) == 0 and cache.num_free == 2 and cache.usage == pytest.approx(1 / 3)
    assert sorted(cache.allocate(2)) == [1, 2] and not cache.can_allocate(1)
    cache.free(hit)
    assert cache.allocate(1) == hit


def test_shared_block_stays_until_its_last_user_frees_it():
    cache = PrefixCache(BlockAllocator(4, 2))
    blocks = computed(cache, make_request([1, 2, 0]), 2)
    cache.take(blocks)
    cache.free(blocks)
    assert cache.num_free == 3
    cache.free(blocks)
    assert cache.num_free == 4
    with pytest.raises(AssertionError, match="double free"):
        cache.free(blocks)


def test_duplicate_block_keeps_the_first_and_goes_to_the_free_list():
    cache = PrefixCache(BlockAllocator(4, 2))
    first = computed(cache, make_request([1, 2, 0]), 2)
    second = computed(cache, make_request([1, 2, 0]), 2)
    assert cache.num_cached == 1 and cache.cached_prefix(make_request([1, 2, 0])) == first
    cache.free(second)
    assert cache.allocator.num_free == 3


def test_disabled_cache_is_the_plain_free_list():
    cache = PrefixCache(BlockAllocator(4, 2), enabled=False)
    request = make_request([1, 2, 3, 4, 5])
    blocks = computed(cache, request, 5)
    assert cache.num_cached == 0 and cache.cached_prefix(make_request([1, 2, 3, 4, 5])) == []
    cache.start_from(request, [])
    assert cache.queries == 0
    cache.free(blocks)
    assert cache.allocator.num_free == 4


def test_start_from_counts_the_lookup_and_keeps_the_first_admissions_cached_tokens():
    cache = PrefixCache(BlockAllocator(8, 2))
    computed(cache, make_request([1, 2, 3, 4, 5]), 5)
    request = make_request([1, 2, 3, 4, 6])
    hit = cache.cached_prefix(request)
    cache.start_from(request, hit)
    assert (request.num_computed_tokens, request.num_cached_blocks, request.num_cached_tokens) == (4, 2, 4)
    assert (cache.queries, cache.hits, cache.num_evictable(hit)) == (5, 4, 0)
    cache.free(hit)                        # preempted: readmitted without the hit, e.g. after an eviction
    cache.start_from(request, [])
    assert (request.num_computed_tokens, request.num_cached_tokens, cache.queries, cache.hits) == (0, 4, 10, 4)
