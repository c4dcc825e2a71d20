"""A step's ScheduledBatch as rank 0 sends it to the other ranks of a tensor-parallel group, and as they rebuild it.

Every rank builds the same inputs from the same batch (model_runner/input_builder.py, cuda_graph.py), so a follower
needs what those read of each sequence: its positions, new known tokens, pending-token row, KV blocks, LoRA slot and
prompt-logprob positions; never the request's whole prompt. KV block lists travel as changes: a request's blocks
only grow while it runs (the scheduler extends its list in place), so rank 0 sends the new tail, or the whole list
when the request has a new one (admitted again after a preemption), and names the requests that ended so the
follower forgets their blocks.

Running example: a request with blocks [4, 9] sent last step that now has [4, 9, 12] is sent as (2, [12]); after a
preemption that gave it [7] it is sent as (0, [7]).
"""
from __future__ import annotations

from dataclasses import dataclass

from worker.batch import ScheduledBatch, ScheduledSeq
from worker.request import Request

# (request id, start, new tokens, LoRA slot, samples, known new token ids, pending row,
#  (kept blocks, new blocks), (first, end) of prompt-logprob positions, prompt_logprobs, prompt tokens)
SeqMessage = tuple[str, int, int, int, bool, list[int], int, tuple[int, list[int]], tuple[int, int], "int | None",
                   int]


@dataclass(frozen=True)
class StepMessage:
    seqs: list[SeqMessage]
    ended: list[str]          # requests the follower may forget (their blocks are no longer sent as changes)


class StepEncoder:
    """Rank 0's side: the batch as a StepMessage, blocks as changes against what was sent before."""

    def __init__(self) -> None:
        # request id -> (request, its block list object when last sent, how many of its blocks the followers hold);
        # the scheduler extends a request's block list in place and gives it a new list when it starts over
        self._sent: dict[str, tuple[Request, list[int], int]] = {}

    def encode(self, batch: ScheduledBatch) -> StepMessage:
        ended = [rid for rid, (request, _, _) in self._sent.items() if request.is_finished]
        for rid in ended:
            del self._sent[rid]
        return StepMessage([self._seq(s) for s in batch.seqs], ended)

    def _seq(self, seq: ScheduledSeq) -> SeqMessage:
        request = seq.request
        blocks = request.block_ids
        _, held, num_held = self._sent.get(request.request_id, (None, None, 0))
        kept = num_held if held is blocks and num_held <= len(blocks) else 0
        self._sent[request.request_id] = (request, blocks, len(blocks))
        scored = request.prompt_logprob_positions(seq.start, seq.start + seq.num_new_tokens)
        return (request.request_id, seq.start, seq.num_new_tokens, seq.lora_slot, seq.samples, seq.token_ids,
                request.pending_row, (kept, blocks[kept:]), (scored.start, scored.stop),
                request.params.prompt_logprobs, request.num_prompt_tokens)


@dataclass(slots=True)
class _Params:
    prompt_logprobs: int | None


class MirroredRequest:
    """What the input builder and the graph runner read of a Request, as rank 0 sent it for one step."""

    __slots__ = ("request_id", "params", "num_prompt_tokens", "num_tokens", "pending_row", "block_ids",
                 "_tokens", "_scored")

    def __init__(self, request_id: str, params: _Params, num_prompt_tokens: int, num_tokens: int, pending_row: int,
                 block_ids: list[int], tokens: list[int], scored: tuple[int, int]):
        self.request_id, self.params, self.num_prompt_tokens = request_id, params, num_prompt_tokens
        self.num_tokens, self.pending_row, self.block_ids = num_tokens, pending_row, block_ids
        self._tokens, self._scored = tokens, scored

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        return self._tokens          # the step's known new tokens: the only slice the builder asks for

    def prompt_logprob_positions(self, start: int, end: int) -> range:
        return range(*self._scored)


class StepDecoder:
    """A follower's side: StepMessages back into ScheduledBatches, keeping each running request's blocks."""

    def __init__(self) -> None:
        self._blocks: dict[str, list[int]] = {}

    def decode(self, message: StepMessage) -> ScheduledBatch:
        for rid in message.ended:
            self._blocks.pop(rid, None)
        batch = ScheduledBatch()
        for (rid, start, num_new, slot, samples, tokens, pending_row, (kept, new_blocks), scored, prompt_logprobs,
             num_prompt) in message.seqs:
            blocks = self._blocks.get(rid)
            if blocks is not None and kept == len(blocks):
                blocks += new_blocks                  # the common case: the same list, grown
            else:
                blocks = self._blocks[rid] = (blocks or [])[:kept] + new_blocks
            # ScheduledSeq derives `samples` from num_tokens: one past the step's end when it does not sample
            num_tokens = start + num_new + (0 if samples else 1)
            request = MirroredRequest(rid, _Params(prompt_logprobs), num_prompt, num_tokens, pending_row, blocks,
                                      tokens, scored)
            batch.seqs.append(ScheduledSeq(request, start, num_new, slot))
        return batch
