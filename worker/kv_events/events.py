"""KV-cache events as vLLM publishes them, for prefix-aware routers (llm-d's precise prefix-cache scorer).

The wire shapes of vLLM 0.33.0 (`vllm/distributed/kv_events.py`), which llm-d's router decodes
(`pkg/kvevents/engineadapter/vllm_adapter.go`, llm-d/llm-d-router ebab6879):

    payload   msgpack of KVEventBatch, a positional array [ts, events, data_parallel_rank]
    event     a map with a "type" key: {"type": "BlockStored", "block_hashes": [...], ...};
              fields without a default are always present (null included), those with one only when set

    BlockStored       block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name,
                      then the optional extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window,
                      locality, ownership, session_id, lookahead_token_ids
    BlockRemoved      block_hashes, medium, then the optional group_idx, locality, ownership
    AllBlocksCleared  no field

Running example, block_size 4, adapter "sql" (lora_id 3), a prompt of 9 tokens computed in one step:

    BlockStored(block_hashes=[h0, h1], parent_block_hash=None, token_ids=[5,6,7,8, 9,9,9,9], block_size=4,
                lora_id=3, medium="GPU", lora_name="sql", group_idx=0, kv_cache_spec_kind="full_attention")
    a later request extends it by one block:  BlockStored([h2], parent_block_hash=h1, token_ids=[4,4,4,4], ...)
    h0 is evicted:                            BlockRemoved(block_hashes=[h0], medium="GPU", group_idx=0)

The router keys blocks on their own `token_ids`, `lora_name` (or the topic's model when null) and block size, and
treats the hashes as opaque ids (worker/kv_cache/prefix_cache.py says what ours are). Unlike vLLM, no `extra_keys`
are sent: vLLM puts the adapter's name there, which router builds before llm-d-router #2929 misread as a
multimodal hash; without it both old and new builds match adapter blocks (no multimodal input or cache_salt is
served, the other things vLLM puts there). One unknown event type fails a whole batch in the router, so only these
three are ever sent.
"""
from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"                 # vLLM's tier name for the device KV cache, whatever the device
FULL_ATTENTION = "full_attention"  # the cache spec kind the router indexes (others are skipped)


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Full blocks newly findable in the prefix cache: one contiguous run of a request's chain."""
    block_hashes: list[int]
    parent_block_hash: int | None      # the block before the run; None when the run starts the chain
    token_ids: list[int]               # exactly the tokens of these blocks, len == block_size * len(block_hashes)
    block_size: int
    lora_id: int | None                # the adapter version's id; None for the base model
    medium: str | None
    lora_name: str | None              # the adapter's name as requests give it in `model`; None for the base
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks no longer findable: evicted for reuse, or dropped with their adapter version."""
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Nothing is findable any more (a prefix-cache reset)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step, published as one message."""
    ts: float                          # time.time() when the step's events were gathered
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None
