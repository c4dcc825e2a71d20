"""logit_bias, allowed_token_ids, bad_words and grammar bitmasks in the sampler, against plain references."""
from __future__ import annotations

import math

import pytest
import torch

from worker.ipc.messages import SamplingParams
from worker.model_runner.penalties_and_bans import apply_token_bitmask
from worker.model_runner.sampler import Sampler, SamplingRow

VOCAB = 40


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _row(output=(), num_pending=0, pending_row=-1, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(temperature=0.0, **params), [1, 2], list(output), num_pending, pending_row)


def test_logit_bias_adds_to_each_named_token():
    logits = _logits(2)
    bias = {3: 2.5, 7: -1.0}
    out = Sampler(VOCAB).process_logits(logits, [_row(logit_bias=bias), _row()])
    expected = logits.clone()
    for t, b in bias.items():
        expected[0, t] += b
    torch.testing.assert_close(out, expected)


def test_logit_bias_minus_100_bans_and_plus_100_forces():
    logits = _logits(2)
    best = int(logits[0].argmax())
    worst = int(logits[1].argmin())
    rows = [_row(logit_bias={best: -100.0}), _row(logit_bias={worst: 100.0})]
    tokens = Sampler(VOCAB)(logits, rows).token_ids.tolist()
    assert tokens[0] != best and tokens[1] == worst


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_allowed_token_ids_restrict_only_their_row(temperature):
    logits = _logits(3, seed=1)
    allowed = [5, 11, 30]
    rows = [SamplingRow(SamplingParams(temperature=temperature, allowed_token_ids=allowed, seed=s), [1], [])
            for s in range(2)] + [_row()]
    out = Sampler(VOCAB).process_logits(logits, rows)
    for r in range(2):
        assert [t for t in range(VOCAB) if math.isfinite(out[r, t])] == allowed
    torch.testing.assert_close(out[2], logits[2])
    tokens = Sampler(VOCAB)(logits, rows).token_ids.tolist()
    assert tokens[0] in allowed and tokens[1] in allowed


def _ref_bad_words(output: list[int], words: list[list[int]]) -> set[int]:
    """Tokens banned after `output` (every token known)."""
    return {w[-1] for w in words if len(output) >= len(w) - 1 and output[len(output) - len(w) + 1:] == w[:-1]}


WORDS = [[4], [7, 8, 9], [8, 10], [1, 2, 3, 4]]


@pytest.mark.parametrize("output", [[], [7], [7, 8], [5, 8], [1, 2, 3], [9, 1, 2], [7, 8, 9]])
@pytest.mark.parametrize("pending", [False, True])
def test_bad_words_ban_the_last_token_after_the_rest(output, pending):
    """With `pending`, the output's last token is still on the device (prev_tokens), not on the host."""
    logits = _logits(1, seed=2)
    if pending and output:
        prev = torch.tensor([0, 0, output[-1]])
        row = _row(output[:-1], num_pending=1, pending_row=2, bad_words_token_ids=WORDS)
    else:
        prev, row = None, _row(output, bad_words_token_ids=WORDS)
    out = Sampler(VOCAB).process_logits(logits, [row], prev)
    banned = {t for t in range(VOCAB) if out[0, t] == -math.inf}
    assert banned == _ref_bad_words(output, WORDS)


def _ref_bitmask(logits: torch.Tensor, allowed: list[set[int]]) -> torch.Tensor:
    out = logits.clone()
    for i, keep in enumerate(allowed):
        for t in range(logits.shape[1]):
            if t not in keep:
                out[i, t] = -math.inf
    return out


@pytest.mark.parametrize("vocab", [31, 32, 70])
def test_token_bitmask_keeps_the_set_bits(vocab):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=g)
    allowed = [{0, 31, vocab - 1}, set(range(vocab)), {t for t in range(vocab) if t % 3 == 0}]
    words = -(-vocab // 32)
    bitmask = torch.zeros(3, words, dtype=torch.int64)
    for i, keep in enumerate(allowed):
        for t in keep:
            bitmask[i, t // 32] |= 1 << (t % 32)
    bitmask = torch.where(bitmask >= 2**31, bitmask - 2**32, bitmask).to(torch.int32)    # two's complement
    torch.testing.assert_close(apply_token_bitmask(logits, bitmask), _ref_bitmask(logits, allowed))


def test_all_ones_bitmask_row_leaves_the_row_alone():
    logits = _logits(2, seed=3)
    bitmask = torch.full((2, 2), -1, dtype=torch.int32)
    bitmask[1] = 0
    bitmask[1, 0] = 1 << 5
    tokens = Sampler(VOCAB)(logits, [_row(), _row()], token_bitmask=bitmask).token_ids.tolist()
    assert tokens == [int(logits[0].argmax()), 5]
