"""The events' bytes, decoded as vLLM's structs and as the raw msgpack a router reads."""
import msgspec
import pytest

from tests.kv_event_subscriber import DECODER, VllmAllBlocksCleared, VllmBlockRemoved, VllmBlockStored
from worker.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

STORED = BlockStored(block_hashes=[2 ** 64 - 1, 7], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                     lora_id=3, medium="GPU", lora_name="sql", group_idx=0, kv_cache_spec_kind="full_attention")
REMOVED = BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0)


def encoded(*events) -> bytes:
    return msgspec.msgpack.encode(KVEventBatch(1700000000.5, list(events), data_parallel_rank=0))


def test_a_batch_decodes_as_vllms_structs_field_for_field():
    batch = DECODER.decode(encoded(STORED, REMOVED, AllBlocksCleared()))
    assert (batch.ts, batch.data_parallel_rank) == (1700000000.5, 0)
    assert batch.events == [
        VllmBlockStored(block_hashes=[2 ** 64 - 1, 7], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2,
                        lora_id=3, medium="GPU", lora_name="sql", group_idx=0, kv_cache_spec_kind="full_attention"),
        VllmBlockRemoved(block_hashes=[7], medium="GPU", group_idx=0), VllmAllBlocksCleared()]


def test_the_batch_is_positional_and_events_are_type_tagged_maps():
    raw = msgspec.msgpack.decode(encoded(STORED, REMOVED, AllBlocksCleared()))
    assert raw[0] == 1700000000.5 and raw[2] == 0 and len(raw) == 3
    stored, removed, cleared = raw[1]
    # fields without a default are always there (nulls included), the rest only when set, as msgspec's
    # omit_defaults writes vLLM's
    assert list(stored) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                            "medium", "lora_name", "group_idx", "kv_cache_spec_kind"]
    assert stored["type"] == "BlockStored" and stored["parent_block_hash"] is None
    assert removed == {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU", "group_idx": 0}
    assert cleared == {"type": "AllBlocksCleared"}


@pytest.mark.parametrize("lora", [(None, None), (5, "team/sql")])
def test_base_model_blocks_carry_null_lora_fields(lora):
    event = BlockStored(block_hashes=[1], parent_block_hash=9, token_ids=[4, 4], block_size=2, lora_id=lora[0],
                        medium="GPU", lora_name=lora[1])
    raw = msgspec.msgpack.decode(encoded(event))[1][0]
    assert (raw["lora_id"], raw["lora_name"], raw["parent_block_hash"]) == (*lora, 9)
    assert "extra_keys" not in raw
