"""A step as rank 0 sends it and a follower rebuilds it: what the input builder reads of every sequence arrives
unchanged; KV blocks travel as changes (grown in place: the tail; a new list: all of it); ended requests are
forgotten."""
from __future__ import annotations

import pickle

from worker.batch import ScheduledBatch, ScheduledSeq
from worker.ranks.step_mirror import StepDecoder, StepEncoder
from worker.ipc.messages import SamplingParams
from worker.request import Request, RequestStatus


def request(rid: str, prompt: int, blocks: list[int], prompt_logprobs: int | None = None) -> Request:
    r = Request(rid, list(range(100, 100 + prompt)), SamplingParams(max_tokens=8, prompt_logprobs=prompt_logprobs), 0)
    r.block_ids = blocks
    return r


def send(encoder: StepEncoder, decoder: StepDecoder, seqs: list[ScheduledSeq]) -> tuple[ScheduledBatch, int]:
    data = pickle.dumps(encoder.encode(ScheduledBatch(seqs)))
    return decoder.decode(pickle.loads(data)), len(data)


def view(seq: ScheduledSeq) -> tuple:
    end = seq.start + seq.num_new_tokens
    r = seq.request
    return (seq.start, seq.num_new_tokens, seq.lora_slot, seq.samples, seq.token_ids, r.pending_row,
            list(r.block_ids), list(r.prompt_logprob_positions(seq.start, end)), r.params.prompt_logprobs,
            r.num_prompt_tokens)


def test_every_field_the_builder_reads_arrives():
    a = request("a", 10, [3, 4, 5], prompt_logprobs=2)       # a prefill chunk: no token sampled
    b = request("b", 4, [7])
    b.output_token_ids, b.num_pending, b.pending_row = [9], 1, 5   # a decode row whose input is pending
    seqs = [ScheduledSeq(a, 0, 6, 1), ScheduledSeq(b, 5, 1, -1)]
    got, _ = send(StepEncoder(), StepDecoder(), seqs)
    assert [view(s) for s in got.seqs] == [view(s) for s in seqs]
    assert [s.samples for s in got.seqs] == [False, True]


def test_blocks_travel_as_changes():
    encoder, decoder = StepEncoder(), StepDecoder()
    r = request("a", 40, list(range(100)))
    send(encoder, decoder, [ScheduledSeq(r, 0, 40, -1)])
    r.block_ids += [500]                                      # grown in place, as the scheduler grows it
    got, grown_bytes = send(encoder, decoder, [ScheduledSeq(r, 40, 1, -1)])
    assert got.seqs[0].request.block_ids == list(range(100)) + [500]
    r.block_ids = [8, 9]                                      # a new list: admitted again after a preemption
    got, _ = send(encoder, decoder, [ScheduledSeq(r, 0, 8, -1)])
    assert got.seqs[0].request.block_ids == [8, 9]
    _, full_bytes = send(StepEncoder(), StepDecoder(), [ScheduledSeq(request("c", 40, list(range(101))), 40, 1, -1)])
    assert grown_bytes < full_bytes - 100                     # the tail, not the whole list


def test_ended_requests_are_forgotten():
    encoder, decoder = StepEncoder(), StepDecoder()
    r = request("a", 4, [1])
    send(encoder, decoder, [ScheduledSeq(r, 0, 4, -1)])
    r.finish_reason = "stop"
    r.status = RequestStatus.FINISHED
    message = encoder.encode(ScheduledBatch())
    assert message.ended == ["a"]
    decoder.decode(message)
    assert decoder._blocks == {}
