"""Automatic prefix caching: full KV blocks found again by a hash chain over their tokens and adapter.

`PrefixCache` sits on the free list (block_allocator.py) and is what the scheduler allocates from. A block
is in one of three states:

    in use     refs > 0; it may also be cached (other requests share it)
    cached     refs == 0, still findable by its hash; evictable, least recently freed first
    free       on the allocator's free list, holding nothing anyone can find

Running example, block_size 4, two requests on adapter A (version uid 7) sharing 8 prompt tokens:

    r1 prompt [5 6 7 8 | 9 9 9 9 | 3]    hashes h0 = H(None, (5,6,7,8), A7), h1 = H(h0, (9,9,9,9), A7)
    r1 computes 9 tokens in blocks [0, 1, 2]; blocks 0 and 1 are full: insert(0, h0), insert(1, h1)
    r2 prompt [5 6 7 8 | 9 9 9 9 | 4 4]  lookup([h0, h1]) -> [0, 1]: 8 tokens cached, r2 computes 2
    r1 and r2 finish: blocks 0, 1 wait in the LRU (refs 0), block 2 and r2's tail go to the free list
    on r3 under adapter B, H(None, (5,6,7,8), B..) differs from h0: no hit, whatever the tokens

The adapter's identity is part of every hash (a prefix computed with one adapter's LoRA deltas never serves
another adapter or the base model), and so is its version uid: after load_inplace or unload, `drop_adapter`
takes the old version's blocks out of the cache at once. `allocate` takes the free list first and evicts cached
blocks only when it runs dry. Keys are Python's tuple hash read as an unsigned 64-bit int, every chain rooted in
a secret of the process, and they never leave it; a wrong hit would take two different (parent, tokens, adapter)
triples colliding in 64 bits, with no way to search for one from outside.

KV-cache events (worker/kv_events/events.py), recorded when `record_events` is on and taken by the engine after
each step: BlockStored for each run of blocks made findable (its parent is always findable when it is stored:
a block whose parent was evicted is not cached, so a router never hears of a child before its parent),
BlockRemoved for each eviction or dropped adapter version, AllBlocksCleared for a reset. A block's id in the
events is `event_hash` of its key, a keyed BLAKE2b (the key another secret of the process), so what subscribers
see tells nothing about the keys: the same id in BlockStored and BlockRemoved, unique per prefix and adapter
version (two ids meet with probability 2^-64), never 0, stable while the process lives (a router that sees the
sequence restart forgets this server's blocks).
"""
from __future__ import annotations

import hashlib
import secrets
from collections import OrderedDict
from collections.abc import Hashable, Sequence

from worker.kv_cache.block_allocator import BlockAllocator
from worker.kv_events.events import FULL_ATTENTION, MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored
from worker.request import AdapterRef, Request

# The first block's parent: a secret of this process, so no one outside it can compute a key, let alone craft
# tokens whose chain collides with another request's (Python's hash of ints is not keyed; of strs it is).
_ROOT = secrets.randbits(63)
_UINT64 = (1 << 64) - 1
_EVENT_KEY = secrets.token_bytes(16)      # keys the ids KV-cache events give blocks


def hash_block(parent: int | None, token_ids: Sequence[int], adapter: Hashable | None) -> int:
    """The key of one full block: its parent's key (None for the first), its tokens, the adapter version; an
    unsigned 64-bit int."""
    return hash((_ROOT if parent is None else parent, tuple(token_ids), adapter)) & _UINT64


def event_hash(block_hash: int) -> int:
    """A block's id in KV-cache events: its key through BLAKE2b keyed by a secret, 64 bits, never 0 (a router
    reads a parent of 0 as none)."""
    digest = hashlib.blake2b(block_hash.to_bytes(8, "big"), digest_size=8, key=_EVENT_KEY).digest()
    return int.from_bytes(digest, "big") or 1


class PrefixCache:
    """Reference-counted KV blocks over the free list, with a hash -> block map of the cached ones.

    With `enabled` False nothing is ever inserted or found, and blocks go straight back to the free list:
    the allocator's behaviour exactly.
    """

    def __init__(self, allocator: BlockAllocator, enabled: bool = True, record_events: bool = False):
        self.allocator = allocator
        self.enabled = enabled
        self.block_size = allocator.block_size
        self.num_blocks = allocator.num_blocks
        self._refs = [0] * allocator.num_blocks          # requests holding each block
        self._block_of: dict[int, int] = {}              # hash -> cached block
        self._hash_of: dict[int, int] = {}               # cached block -> its hash
        self._evictable: OrderedDict[int, None] = OrderedDict()   # cached, refs 0; least recently freed first
        self._adapter_of: dict[int, AdapterRef | None] = {}      # cached block -> the version that computed it
        self._dropped: set[AdapterRef] = set()           # versions retired by drop_adapter: never cached again
        self.events: list | None = [] if record_events and enabled else None   # KV-cache events since take_events
        self.queries = 0   # prompt tokens looked up, since start (vLLM's `vllm:prefix_cache_queries`)
        self.hits = 0      # of those, tokens found cached (`vllm:prefix_cache_hits`)

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: the free list and the cached blocks nobody uses."""
        return self.allocator.num_free + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        """The fraction of blocks in use by requests, 0 to 1 (cached blocks without users count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return self.allocator.blocks_needed(num_tokens)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """`n` blocks with one reference each: from the free list, then by evicting least recently freed."""
        if n > self.num_free:
            raise ValueError(f"asked for {n} KV blocks but only {self.num_free} are free")
        from_list = min(n, self.allocator.num_free)
        block_ids = self.allocator.allocate(from_list)
        evicted = []
        for _ in range(n - from_list):
            block_id, _ = self._evictable.popitem(last=False)
            evicted.append(self._uncache(block_id))
            block_ids.append(block_id)
        self._record_removed(evicted)
        for block_id in block_ids:
            self._refs[block_id] = 1
        return block_ids

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block. Unused cached blocks wait in the LRU, the rest go back to the
        free list. Freed last to first, so a chain's tail is evicted before its head (heads are shared more)."""
        to_list = []
        for block_id in reversed(block_ids):
            assert self._refs[block_id] > 0, f"double free of KV block {block_id}"
            self._refs[block_id] -= 1
            if self._refs[block_id] == 0:
                if block_id in self._hash_of:
                    self._evictable[block_id] = None
                else:
                    to_list.append(block_id)
        self.allocator.free(to_list)

    def lookup(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (at most `max_blocks`); no reference taken."""
        if not self.enabled:
            return []
        found = []
        for block_hash in hashes[:max_blocks]:
            block_id = self._block_of.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def num_evictable(self, block_ids: Sequence[int]) -> int:
        """How many of `block_ids` sit in the LRU (taking them shrinks what allocate may take)."""
        return sum(1 for block_id in block_ids if self._refs[block_id] == 0)

    def take(self, block_ids: Sequence[int]) -> None:
        """One more reference on each of `block_ids` (found by lookup); unused ones leave the LRU."""
        for block_id in block_ids:
            if self._refs[block_id] == 0:
                del self._evictable[block_id]
            self._refs[block_id] += 1

    def insert(self, block_id: int, block_hash: int, adapter: AdapterRef | None = None) -> bool:
        """Make a full, computed block findable; True if it now is. A hash already cached keeps its block (this
        one is then an uncached duplicate, freed to the list when its request ends)."""
        if self.enabled and block_hash not in self._block_of and block_id not in self._hash_of:
            self._block_of[block_hash] = block_id
            self._hash_of[block_id] = block_hash
            self._adapter_of[block_id] = adapter
            return True
        return False

    def drop_adapter(self, adapter: AdapterRef) -> None:
        """Retire an adapter version (unloaded, or replaced by load_inplace): its blocks stop being findable now,
        the unused ones go back to the free list, and its requests still running cache nothing more. A router
        keys blocks on the adapter's name alone, so the old version's blocks must be gone before the new one's
        same tokens are announced."""
        self._dropped.add(adapter)
        dropped = [block_id for block_id, owner in self._adapter_of.items() if owner == adapter]
        to_list = [block_id for block_id in dropped if self._refs[block_id] == 0]
        self._record_removed([self._uncache(block_id) for block_id in dropped])
        for block_id in to_list:
            del self._evictable[block_id]
        self.allocator.free(to_list)

    def reset(self) -> bool:
        """Forget every cached block, as vLLM's reset_prefix_cache: only when no request holds a block (False,
        and nothing changes, otherwise)."""
        if self.num_free != self.num_blocks:
            return False
        to_list = list(self._evictable)
        self._evictable.clear()
        self._block_of.clear()
        self._hash_of.clear()
        self._adapter_of.clear()
        self.allocator.free(to_list)
        if self.events is not None:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list:
        """The KV-cache events recorded since the last call, oldest first (empty when not recording)."""
        if not self.events:
            return []
        events, self.events = self.events, []
        return events

    def cached_prefix(self, request: Request) -> list[int]:
        """The cached blocks a request being admitted (all its tokens known) may start from, no reference
        taken. Capped at num_tokens - 1 rounded down to whole blocks: the last token is always computed, for
        its logits. Requests with prompt logprobs take no hit: every prompt position must be scored."""
        if not self.enabled or request.params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.lookup(self._hashes(request, max_blocks), max_blocks)

    def start_from(self, request: Request, hit: list[int]) -> None:
        """An admitted request takes its cached prefix `hit` (from cached_prefix): a reference on each block,
        its tokens counted as computed, the lookup counted (vLLM counts none for a request that skips the cache),
        and on its first admission, its cached tokens for the response's usage."""
        self.take(hit)
        request.num_cached_blocks = len(hit)
        request.num_computed_tokens = len(hit) * self.block_size
        if self.enabled and request.params.prompt_logprobs is None:
            self.queries += request.num_tokens
            self.hits += request.num_computed_tokens
        if request.num_cached_tokens is None:
            request.num_cached_tokens = request.num_computed_tokens

    def cache_computed(self, request: Request) -> None:
        """Make findable the request's full blocks whose tokens are all computed and known (a pending token,
        sampled by the step in flight, is not known yet)."""
        if not self.enabled:
            return
        num_known = request.num_tokens - request.num_pending
        num_full = min(request.num_computed_tokens, num_known) // self.block_size
        if num_full <= request.num_cached_blocks:
            return
        first = request.num_cached_blocks
        request.num_cached_blocks = num_full
        if request.adapter in self._dropped:
            return
        hashes = self._hashes(request, num_full)
        stored = []                                   # indices of the blocks made findable now
        for i in range(first, num_full):
            # a block whose parent left the cache stays out of it (unreachable anyway), and so do its successors
            if i > 0 and hashes[i - 1] not in self._block_of:
                break
            if self.insert(request.block_ids[i], hashes[i], request.adapter):
                stored.append(i)
        if self.events is not None and stored:
            self._record_stored(request, hashes, stored)

    def _uncache(self, block_id: int) -> int:
        """Make a cached block unfindable; its hash."""
        block_hash = self._hash_of.pop(block_id)
        del self._block_of[block_hash]
        del self._adapter_of[block_id]
        return block_hash

    def _record_stored(self, request: Request, hashes: list[int], stored: list[int]) -> None:
        """One BlockStored per contiguous run of the blocks `stored` (indices into the request's chain)."""
        size, adapter = self.block_size, request.adapter
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            self.events.append(BlockStored(
                block_hashes=[event_hash(hashes[i]) for i in run],
                parent_block_hash=event_hash(hashes[run[0] - 1]) if run[0] else None,
                token_ids=request.token_ids_slice(run[0] * size, (run[-1] + 1) * size), block_size=size,
                lora_id=None if adapter is None else adapter.uid, medium=MEDIUM_GPU,
                lora_name=None if adapter is None else adapter.name, group_idx=0, kv_cache_spec_kind=FULL_ATTENTION))

    def _record_removed(self, block_hashes: list[int]) -> None:
        if self.events is not None and block_hashes:
            self.events.append(BlockRemoved(block_hashes=[event_hash(h) for h in block_hashes], medium=MEDIUM_GPU,
                                            group_idx=0))

    def _hashes(self, request: Request, num_blocks: int) -> list[int]:
        """request.block_hashes, extended to cover its first `num_blocks` blocks (their tokens known)."""
        hashes, size = request.block_hashes, self.block_size
        for i in range(len(hashes), num_blocks):
            tokens = request.token_ids_slice(i * size, (i + 1) * size)
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens, request.adapter))
        return hashes
