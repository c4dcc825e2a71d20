"""bench.input_build: the batches it times are valid decode batches, and it reports a time for each."""
from __future__ import annotations

from bench.input_build import decode_batch, time_build


def test_decode_batch_is_one_token_per_sequence_at_the_end_of_its_context():
    batch = decode_batch(num_seqs=3, context=40, num_slots=2)
    assert [s.num_new_tokens for s in batch.seqs] == [1, 1, 1]
    assert all(s.samples and s.start == 39 and len(s.request.block_ids) * 16 >= 40 for s in batch.seqs)
    assert [s.lora_slot for s in batch.seqs] == [0, 1, 0]


def test_time_build_measures_a_positive_time():
    assert time_build(4, 64, repeats=2) > 0
