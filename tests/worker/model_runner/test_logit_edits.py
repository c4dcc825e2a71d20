"""A request's lists (allowed_token_ids, bad words, logit_bias, stop ids, its prompt) are read once, when its
LogitEdits are built, and never again per step; edits kept across steps give what fresh ones give."""
from __future__ import annotations

import random
import time

import pytest
import torch

from worker.ipc.messages import SamplingParams
from worker.model_runner.sampler import Sampler, SamplingRow

VOCAB = 64
EOS = [2]


class CountedList(list):
    """A list that counts how often it is walked (iterated, sliced, concatenated)."""

    def __init__(self, values):
        super().__init__(values)
        self.reads = 0

    def __iter__(self):
        self.reads += 1
        return super().__iter__()

    def __add__(self, other):
        self.reads += 1
        return list(self) + other

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


class CountedDict(dict):
    def __init__(self, values):
        super().__init__(values)
        self.reads = 0

    def items(self):
        self.reads += 1
        return super().items()

    def __iter__(self):
        self.reads += 1
        return super().__iter__()


def _case(kind: str) -> tuple[SamplingParams, list[int], object]:
    """(params, prompt, the counted container) for one kind of per-request list."""
    prompt = [5, 6, 7]
    if kind == "allowed_token_ids":
        counted = CountedList([3, 9, 9, 30] * 50)
        return SamplingParams(allowed_token_ids=counted), prompt, counted
    if kind == "bad_words":
        counted = CountedList([[4], [7, 8, 9], [8, 10], [1, 2, 3, 4]] * 20)
        return SamplingParams(bad_words_token_ids=counted), prompt, counted
    if kind == "logit_bias":
        counted = CountedDict({t: 1.5 for t in range(0, VOCAB, 3)})
        return SamplingParams(logit_bias=counted), prompt, counted
    if kind == "min_tokens":
        counted = CountedList(list(range(10, 40)))
        return SamplingParams(min_tokens=100, stop_token_ids=counted), prompt, counted
    counted = CountedList(list(range(VOCAB)) * 20)       # penalties: the prompt
    return SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5), counted, counted


@pytest.mark.parametrize("kind", ["allowed_token_ids", "bad_words", "logit_bias", "min_tokens", "penalties"])
def test_lists_are_read_when_the_edits_are_built_and_never_per_step(kind):
    params, prompt, counted = _case(kind)
    sampler = Sampler(VOCAB, eos_token_ids=EOS)
    edits = sampler.logit_edits(params, prompt)
    reads_to_build = counted.reads
    output: list[int] = []
    for step in range(8):
        logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(step))
        output.append(int(sampler(logits, [SamplingRow(params, prompt, list(output), edits=edits)]).token_ids[0]))
    assert counted.reads == reads_to_build


def _random_params(rng: random.Random) -> SamplingParams:
    words = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 4))] for _ in range(rng.randint(1, 30))]
    return SamplingParams(
        temperature=0.0, min_tokens=rng.choice([0, 3]), stop_token_ids=[rng.randrange(VOCAB) for _ in range(3)],
        repetition_penalty=rng.choice([1.0, 1.3]), frequency_penalty=rng.choice([0.0, 0.4]),
        presence_penalty=rng.choice([0.0, -0.3]),
        logit_bias=rng.choice([None, {rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(5)}]),
        allowed_token_ids=rng.choice([None, [rng.randrange(VOCAB) for _ in range(40)]]),
        bad_words_token_ids=rng.choice([[], words]))


@pytest.mark.parametrize("seed", range(6))
def test_edits_kept_across_steps_give_what_fresh_edits_give(seed):
    """Each step: the same rows, once with the edits built at the first step (penalty counts updated by new tokens
    alone) and once with edits built from the whole lists; some steps have the last token pending on the device."""
    rng = random.Random(seed)
    sampler = Sampler(VOCAB, eos_token_ids=EOS)
    params = [_random_params(rng) for _ in range(4)]
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))] for _ in params]
    kept = [sampler.logit_edits(p, prompt) for p, prompt in zip(params, prompts)]
    outputs: list[list[int]] = [[] for _ in params]
    for step in range(12):
        logits = torch.randn(len(params), VOCAB, generator=torch.Generator().manual_seed(100 * seed + step))
        pending = step % 3 == 2 and all(outputs)
        prev = torch.tensor([out[-1] for out in outputs]) if pending else None
        host = [out[:-1] if pending else out for out in outputs]
        rows = [SamplingRow(p, prompt, list(out), int(pending), i if pending else -1)
                for i, (p, prompt, out) in enumerate(zip(params, prompts, host))]
        cached = [SamplingRow(r.params, r.prompt_token_ids, r.output_token_ids, r.num_pending, r.pending_row, e)
                  for r, e in zip(rows, kept)]
        fresh = sampler.process_logits(logits, rows, prev)
        assert torch.equal(sampler.process_logits(logits, cached, prev), fresh)
        for out, t in zip(outputs, fresh.argmax(dim=-1).tolist()):
            out.append(t)


def _best_step_seconds(sampler: Sampler, batches: list[list[SamplingRow]], logits: torch.Tensor) -> list[float]:
    """Each batch's best step time over interleaved repetitions (a neighbour's load hits both alike)."""
    best = [float("inf")] * len(batches)
    for _ in range(9):
        for i, rows in enumerate(batches):
            start = time.perf_counter()
            sampler(logits, rows).token_ids.tolist()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def test_a_step_with_a_100k_allowed_list_costs_what_one_with_a_1_long_list_does():
    """16 choices of a request with allowed_token_ids of 100,000 ids against 16 with one id: the ratio of their
    best step times is near 1 once the lists are masks; walking the lists per step made it about 40."""
    vocab = 32_000
    sampler = Sampler(vocab)
    logits = torch.randn(16, vocab, generator=torch.Generator().manual_seed(0))

    def rows_of(allowed: list[int]) -> list[SamplingRow]:
        params = SamplingParams(max_tokens=10, ignore_eos=True, allowed_token_ids=allowed)
        return [SamplingRow(params, [1], [], edits=sampler.logit_edits(params, [1])) for _ in range(16)]

    long_step, short_step = _best_step_seconds(sampler, [rows_of([300] * 100_000), rows_of([300])], logits)
    assert long_step < 4 * short_step
