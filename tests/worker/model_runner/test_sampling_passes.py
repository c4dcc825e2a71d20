"""Which requests ask for which sampler pass: one definition, used by the sampler to skip a pass and by the launch
pacer to tell steps apart. Skipping a pass no row asks for must change no row."""
from __future__ import annotations

import pytest
import torch

from worker.ipc.messages import SamplingParams
from worker.model_runner.penalties_and_bans import apply_penalties
from worker.model_runner.sampler import Sampler, SamplingRow
from worker.model_runner.sampling_passes import (PASSES, asks_min_p, asks_penalties, asks_top_k_top_p,
                                                 pass_letters)

VOCAB = 24


@pytest.mark.parametrize("params", [dict(top_k=3), dict(top_p=0.5), dict(min_p=0.2), dict(seed=4),
                                    dict(top_k=2, top_p=0.9, min_p=0.1, seed=1)])
def test_a_greedy_row_asks_for_no_draw_and_no_filter_before_it(params):
    assert pass_letters([SamplingParams(temperature=0.0, **params)]) == ""
    assert pass_letters([SamplingParams(temperature=0.7, **params)]) != ""


def test_letters_are_sorted_and_each_names_the_pass_some_row_asks_for():
    rows = [SamplingParams(seed=1, top_p=0.9), SamplingParams(temperature=0.0, logprobs=0),
            SamplingParams(temperature=0.0, allowed_token_ids=[1])]
    assert pass_letters(rows) == "bels"
    assert set(PASSES) == set("bdelmps")


@pytest.mark.parametrize("params", [dict(), dict(top_k=0), dict(top_k=-1), dict(top_k=VOCAB), dict(top_k=VOCAB + 5)])
def test_the_top_k_top_p_sort_changes_no_row_that_does_not_ask_for_it(params):
    """top_k at or past the vocabulary asks for the sort, which then keeps every token."""
    params = SamplingParams(**params)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0))
    assert torch.equal(Sampler(VOCAB)._apply_top_k_top_p(logits, [SamplingRow(params, [], [])]), logits)
    assert asks_top_k_top_p(params) == (params.top_k >= VOCAB)


def test_a_greedy_row_takes_the_argmax_beside_rows_that_draw():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3))
    rows = [SamplingRow(SamplingParams(temperature=0.0, top_k=2, top_p=0.3, min_p=0.5), [], []),
            SamplingRow(SamplingParams(seed=9), [], [])]
    assert Sampler(VOCAB)(logits, rows).token_ids[0].item() == logits[0].argmax().item()


def test_min_p_changes_no_row_that_does_not_ask_for_it():
    params = SamplingParams(temperature=0.8)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    assert not asks_min_p(params)
    assert torch.equal(Sampler(VOCAB)._apply_min_p(logits, [SamplingRow(params, [], [])]), logits)


def test_penalties_change_no_row_that_does_not_ask_for_them():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    plain = SamplingRow(SamplingParams(), [1, 2, 3], [4, 4, 5])
    penalised = SamplingRow(SamplingParams(repetition_penalty=1.3, presence_penalty=0.5), [1, 2, 3], [4, 4, 5])
    assert not asks_penalties(plain.params) and asks_penalties(penalised.params)
    edits = [Sampler(VOCAB).logit_edits(r.params, r.prompt_token_ids) for r in (plain, penalised)]
    out = apply_penalties(logits, [plain, penalised], edits, None)
    assert torch.equal(out[0], logits[0]) and not torch.equal(out[1], logits[1])
