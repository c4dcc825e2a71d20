"""Sampler against plain per-row float64 references written out below."""
from __future__ import annotations

import math

import pytest
import torch

from worker.ipc.messages import SamplingParams
from worker.model_runner.logprobs import compute_logprobs
from worker.model_runner.sampler import Sampler, SamplingRow

DTYPES = [torch.float32, torch.bfloat16]
FILTERS = [
    dict(top_k=3),
    dict(top_p=0.6),
    dict(min_p=0.2),
    dict(temperature=0.7, top_p=0.8),
    dict(temperature=1.5, top_k=6, top_p=0.9, min_p=0.05),
]


def _logits(num_rows: int, vocab: int, dtype=torch.float32, seed: int = 0, ties: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, vocab, generator=g) * 2
    return (x.round() if ties else x).to(dtype)


def _row(prompt=(), output=(), **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output))


# ---- references: one row at a time, float64, plain loops ----

def _ref_process(logits: list[float], row: SamplingRow, eos: list[int]) -> list[float]:
    p = row.params
    out = list(logits)
    for t in range(len(out)):
        count = row.output_token_ids.count(t)
        if t in row.prompt_token_ids or count:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        out[t] -= p.frequency_penalty * count
        out[t] -= p.presence_penalty * (count > 0)
    if len(row.output_token_ids) < p.min_tokens:
        for t in p.stop_token_ids + ([] if p.ignore_eos else eos):
            out[t] = -math.inf
    return out


def _ref_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """Temperature, top_k, top_p, min_p, renormalised: the distribution a random row draws from."""
    scaled = [x / p.temperature for x in logits]
    keep = set(range(len(scaled)))
    if 0 < p.top_k < len(scaled):
        kth = sorted(scaled, reverse=True)[p.top_k - 1]
        keep = {t for t in keep if scaled[t] >= kth}
    probs = _softmax(scaled, keep)
    if p.top_p < 1.0:
        mass, kept = 0.0, set()
        for t in sorted(keep, key=lambda t: (-probs[t], t)):
            if mass >= p.top_p:
                break
            kept.add(t)
            mass += probs[t]
        keep = kept
        probs = _softmax(scaled, keep)
    if p.min_p > 0.0:
        keep = {t for t in keep if probs[t] >= p.min_p * max(probs)}
    return _softmax(scaled, keep)


def _softmax(x: list[float], keep: set[int]) -> list[float]:
    m = max(x[t] for t in keep)
    e = [math.exp(x[t] - m) if t in keep else 0.0 for t in range(len(x))]
    return [v / sum(e) for v in e]


def _ref_argmax(x: list[float]) -> int:
    best = 0
    for t, v in enumerate(x):
        if v > x[best]:
            best = t
    return best


def _ref_logprob(logits: torch.Tensor, token: int, k: int) -> tuple[float, int, list[int], list[float]]:
    x = logits.double()
    lp = torch.log_softmax(x, dim=-1)
    rank = 1 + sum(1 for v in x.tolist() if v > x[token].item())
    top = sorted(range(len(x)), key=lambda t: (-x[t].item(), t))[:k]
    return lp[token].item(), rank, top, [lp[t].item() for t in top]


def _chi_square(counts: list[int], probs: list[float]) -> tuple[float, int]:
    n = sum(counts)
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs) if p > 0)
    return stat, sum(p > 0 for p in probs) - 1


# ---- greedy and penalties ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_size", [1, 5])
@pytest.mark.parametrize("ties", [False, True])
def test_greedy_equals_argmax_lowest_index_on_ties(dtype, batch_size, ties):
    logits = _logits(batch_size, 40, dtype, seed=batch_size, ties=ties)
    rows = [_row(temperature=0.0, top_k=2, seed=i) for i in range(batch_size)]
    out = Sampler(40)(logits, rows)
    assert out.token_ids.dtype == torch.int64
    assert out.token_ids.tolist() == [_ref_argmax(r) for r in logits.double().tolist()]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_size", [1, 6])
def test_penalties_match_reference(dtype, batch_size):
    vocab = 30
    g = torch.Generator().manual_seed(11)
    logits = _logits(batch_size, vocab, dtype, seed=3)
    rows = []
    for i in range(batch_size):
        prompt = torch.randint(0, vocab, (7,), generator=g).tolist()
        output = torch.randint(0, vocab, (9,), generator=g).tolist()   # repeats likely
        rows.append(_row(prompt, output, temperature=0.0, repetition_penalty=[1.0, 1.3, 0.8][i % 3],
                         frequency_penalty=[0.0, 0.4, -0.3][(i + 1) % 3],
                         presence_penalty=[0.0, 0.7, -0.5][(i + 2) % 3]))
    sampler = Sampler(vocab)
    expected = [_ref_process(x, r, []) for x, r in zip(logits.double().tolist(), rows)]
    torch.testing.assert_close(sampler.process_logits(logits, rows).double(),
                               torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-5)
    assert sampler(logits, rows).token_ids.tolist() == [_ref_argmax(e) for e in expected]


def test_process_logits_leaves_input_unchanged():
    logits = _logits(2, 16)
    before = logits.clone()
    rows = [_row([1, 2], [3], repetition_penalty=1.5, min_tokens=4, stop_token_ids=[5])] * 2
    Sampler(16, eos_token_ids=[0]).process_logits(logits, rows)
    assert torch.equal(logits, before)


def test_min_tokens_masks_eos_and_stop_ids():
    vocab, eos = 10, [0, 9]
    logits = torch.zeros(4, vocab)
    rows = [
        _row(output=[1], min_tokens=3, stop_token_ids=[4]),          # short: eos and 4 masked
        _row(output=[1, 2, 3], min_tokens=3, stop_token_ids=[4]),    # reached min_tokens
        _row(min_tokens=2, ignore_eos=True, stop_token_ids=[5]),     # eos ignored: only 5
        _row(stop_token_ids=[6]),                                    # no min_tokens
    ]
    masked = Sampler(vocab, eos_token_ids=eos).process_logits(logits, rows)
    expected = [[t for t in range(vocab) if masked[i, t] == -math.inf] for i in range(4)]
    assert expected == [[0, 4, 9], [], [5], []]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_never_picks_eos(temperature):
    vocab = 8
    logits = torch.tensor([[9.0, 0, 0, 0, 0, 0, 0, 8.5]]).repeat(64, 1)   # eos 0 and stop 7 lead
    rows = [_row(output=[1], min_tokens=2, stop_token_ids=[7], temperature=temperature)] * 64
    tokens = Sampler(vocab, eos_token_ids=[0])(logits, rows).token_ids
    assert not set(tokens.tolist()) & {0, 7}


# ---- temperature and filters ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("params", FILTERS)
def test_sampling_probs_match_reference(dtype, params):
    logits = _logits(4, 24, dtype, seed=5)
    rows = [_row(**params)] * 4
    expected = [_ref_probs(x, rows[0].params) for x in logits.double().tolist()]
    probs = Sampler(24).sampling_probs(logits.float(), rows)
    expected = torch.tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(probs.double(), expected, rtol=0, atol=1e-6)
    assert torch.equal(probs == 0, expected == 0)


@pytest.mark.parametrize("logits, params", [
    ([0.0, 0.0, 0.0, 0.0], dict(top_p=0.5)),    # two tokens reach 0.5 exactly: the third goes
    ([1.0, 1.0, 0.0, 0.0], dict(min_p=1.0)),    # prob equal to min_p * max stays
])
def test_filters_at_exact_boundary(logits, params):
    probs = Sampler(4).sampling_probs(torch.tensor([logits]), [_row(**params)])
    assert probs.tolist() == [[0.5, 0.5, 0.0, 0.0]] == [_ref_probs(logits, SamplingParams(**params))]


def test_top_p_one_keeps_tail_tokens():
    # float32 cumsum reaches 1.0 after the first token; the tail must still be kept, also when
    # a batch mate's top_p sends the batch through the filter
    logits = torch.tensor([[20.0, 0.0, 0.0, 0.0]]).repeat(2, 1)
    probs = Sampler(4).sampling_probs(logits, [_row(top_p=1.0), _row(top_p=0.5)])
    assert (probs[0] > 0).all()


@pytest.mark.parametrize("params", FILTERS)
def test_filters_never_sample_masked_token(params):
    vocab = 24
    logits = _logits(1, vocab, seed=6).repeat(256, 1)
    rows = [_row(**params)] * 256
    allowed = {t for t, p in enumerate(_ref_probs(logits[0].double().tolist(), rows[0].params)) if p > 0}
    sampler = Sampler(vocab, seed=1)
    drawn = set()
    for _ in range(8):
        drawn |= set(sampler(logits, rows).token_ids.tolist())
    assert drawn <= allowed
    assert len(allowed) < vocab   # the filter did mask something


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("params", [dict(), FILTERS[3], FILTERS[4]])
def test_draws_follow_filtered_distribution(seeded, params):
    vocab, n = 12, 3000
    logits = _logits(1, vocab, seed=8).repeat(n, 1)
    rows = [_row(seed=i if seeded else None, **params) for i in range(n)]
    expected = _ref_probs(logits[0].double().tolist(), rows[0].params)
    counts = torch.bincount(Sampler(vocab, seed=2)(logits, rows).token_ids, minlength=vocab).tolist()
    stat, df = _chi_square(counts, expected)
    assert all(c == 0 for c, p in zip(counts, expected) if p == 0)
    assert stat < df + 5 * math.sqrt(2 * df)     # about p = 0.001


# ---- seeds ----

@pytest.mark.parametrize("dtype", DTYPES)
def test_seeded_row_ignores_batch_mates_and_row_index(dtype):
    vocab = 32
    target = _logits(1, vocab, dtype, seed=9)
    for step in range(6):
        row = _row(output=[3] * step, seed=1234, top_p=0.95)
        alone = Sampler(vocab, seed=0)(target, [row]).token_ids.tolist()
        for index in (0, 3, 7):
            mates = _logits(8, vocab, dtype, seed=10 + index)
            mates[index] = target[0]
            rows = [_row(seed=s, temperature=t) for s, t in
                    zip([None, 5, None, 6, 7, None, 8, None], [1.0, 0.5, 0.0, 1.0, 1.0, 2.0, 0.0, 1.0])]
            rows[index] = row
            batch = Sampler(vocab, seed=index + 1)(mates, rows).token_ids.tolist()
            assert batch[index] == alone[0]


def test_seeded_row_varies_with_step():
    logits = torch.zeros(1, 32)     # uniform: a repeated token at every step would be a fluke
    sampler = Sampler(32)
    tokens = [sampler(logits, [_row(output=[0] * s, seed=42)]).token_ids.item() for s in range(6)]
    assert len(set(tokens)) > 1


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("penalties", [dict(), dict(repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=0.3)])
def test_a_pending_token_counts_as_generated(temperature, penalties):
    """Async scheduling: a row whose last token is still on the device samples exactly as the same
    row with that token known: min_tokens and the per-step seed count it, penalties count its id,
    read from the previous step's sampler output (`prev_tokens`) at the row's `pending_row`."""
    vocab = 16
    logits = _logits(1, vocab, seed=14).repeat(2, 1)
    logits[:, 4] = 50.0    # the stop token leads: masked only while min_tokens is not reached
    for known_output in ([3], [3, 5], [3, 5, 5, 7]):
        known = _row(output=known_output, min_tokens=3, stop_token_ids=[4], seed=9, temperature=temperature,
                     **penalties)
        prev_tokens = torch.tensor([11, 12, known_output[-1], 13])
        pending = SamplingRow(known.params, known.prompt_token_ids, known_output[:-1], num_pending=1, pending_row=2)
        sampler = Sampler(vocab)
        masked = sampler.process_logits(logits, [known, pending], prev_tokens)
        assert torch.equal(masked[0], masked[1])
        assert (masked[0, 4] == -math.inf) == (len(known_output) < 3)
        both = sampler(logits, [known, pending], prev_tokens).token_ids.tolist()
        assert both == [sampler(logits[:1], [known]).token_ids.item()] * 2
    if penalties:    # the pending id matters: counted as another token, the row would differ
        wrong = torch.tensor([11, 12, 0, 13])
        assert not torch.equal(sampler.process_logits(logits[:1], [pending], wrong)[0], masked[0])


def test_unseeded_rows_reproducible_from_sampler_seed():
    logits = torch.zeros(16, 32)
    rows = [_row()] * 16

    def draw(seed):
        return [Sampler(32, seed=seed)(logits, rows).token_ids.tolist() for _ in range(2)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


# ---- logprobs ----

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize("k", [0, 3, 20])
@pytest.mark.parametrize("ties", [False, True])
def test_logprobs_are_raw_log_softmax_with_exact_ranks(dtype, batch_size, k, ties):
    vocab = 48
    logits = _logits(batch_size, vocab, dtype, seed=12, ties=ties)
    params = [dict(), dict(temperature=0.0), dict(temperature=0.5, top_k=4, repetition_penalty=1.5),
              dict(min_p=0.1, frequency_penalty=1.0)]
    rows = [_row([1, 2], [2, 3], logprobs=k, **params[i % 4]) for i in range(batch_size)]
    token_ids, logprobs, _ = Sampler(vocab)(logits, rows).copy_to_host().wait()
    for i, (token, entry) in enumerate(zip(token_ids, logprobs, strict=True)):
        logprob, rank, top_ids, top_lps = _ref_logprob(logits[i], token, k)
        assert entry.token_id == token
        assert abs(entry.logprob - logprob) < 1e-5
        assert entry.rank == rank
        assert [t for t, _ in entry.top] == top_ids
        assert all(abs(a - b) < 1e-5 for (_, a), b in zip(entry.top, top_lps))


def test_logprobs_per_row_k_and_none():
    logits = _logits(1, 16).repeat(3, 1)
    rows = [_row(logprobs=None), _row(logprobs=2), _row(logprobs=5)]
    _, logprobs, _ = Sampler(16)(logits, rows).copy_to_host().wait()
    assert logprobs[0] is None
    assert [len(e.top) for e in logprobs[1:]] == [2, 5]
    assert logprobs[1].top == logprobs[2].top[:2]


def test_top_logprobs_break_ties_by_lower_id():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0]])
    [entry] = compute_logprobs(logits, [4], k=2)
    assert (entry.token_id, entry.rank) == (4, 1)
    assert [t for t, _ in entry.top] == [1, 2]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ties", [False, True])
def test_compute_logprobs_scores_given_tokens(dtype, ties):
    logits = _logits(6, 40, dtype, seed=13, ties=ties)
    tokens = [0, 39, 5, 5, 17, 22]
    for i, entry in enumerate(compute_logprobs(logits, tokens, k=4)):
        logprob, rank, top_ids, top_lps = _ref_logprob(logits[i], tokens[i], 4)
        assert (entry.token_id, entry.rank) == (tokens[i], rank)
        assert abs(entry.logprob - logprob) < 1e-5
        assert [t for t, _ in entry.top] == top_ids
        assert all(abs(a - b) < 1e-5 for (_, a), b in zip(entry.top, top_lps))


# ---- extreme accepted values give a sensible distribution ----

@pytest.mark.parametrize("temperature", [1e-45, 1e-7, 9.9e-6])
def test_temperature_below_sampling_eps_samples_greedily(temperature):
    logits = _logits(4, 40, seed=3)
    sampler = Sampler(40, seed=0)
    rows = [_row(temperature=temperature, seed=s) for s in (None, 1, 2, 3)]
    assert all(r.params.greedy for r in rows)
    assert sampler(logits, rows).token_ids.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_p", [1e-300, 1e-45, 1e-9])
def test_top_p_that_rounds_to_zero_keeps_the_best_token(top_p):
    logits = _logits(3, 40, seed=4)
    sampler = Sampler(40, seed=0)
    rows = [_row(top_p=top_p, seed=s) for s in (None, 5, 6)]
    probs = sampler.sampling_probs(logits, rows)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(dim=-1), 40).float())
    assert sampler(logits, rows).token_ids.tolist() == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("penalty", [1e-300, 1e-45, 1e300, float(torch.finfo(torch.float32).max) * 10])
@pytest.mark.parametrize("temperature", [1.0, 1e-5])
def test_extreme_repetition_penalties_keep_a_finite_distribution_of_the_expected_tokens(penalty, temperature):
    """A penalty near 0 makes the seen tokens with positive logits overwhelm the rest: every row, greedy or
    drawn, takes the best of them. A huge one bans the seen tokens with negative logits."""
    logits = _logits(1, 40, seed=5)
    seen = [int(i) for i in logits[0].argsort()[::4]]       # a spread of seen tokens, good and bad
    row = _row(prompt=seen, repetition_penalty=penalty, temperature=temperature, seed=7)
    sampler = Sampler(40, seed=0)
    processed = sampler.process_logits(logits, [row])
    probs = sampler.sampling_probs(processed, [row])
    assert torch.isfinite(processed).all() and torch.isfinite(probs).all()
    assert probs.sum().item() == pytest.approx(1.0, abs=1e-5)
    positive_seen = [t for t in seen if logits[0, t] > 0]
    if penalty < 1:
        best = max(positive_seen, key=lambda t: logits[0, t])
        assert probs[0, best].item() == 1.0
        assert all(sampler(logits, [_row(prompt=seen, repetition_penalty=penalty, temperature=temperature,
                                         seed=s)]).token_ids.item() == best for s in range(8))
    else:
        negative_seen = [t for t in seen if logits[0, t] < 0]
        assert probs[0, negative_seen].max().item() == 0.0


def test_rows_with_a_nan_or_inf_logit_are_reported_with_the_tokens():
    logits = _logits(4, 16, seed=8)
    logits[1, 3], logits[3, 0] = float("nan"), float("inf")
    rows = [_row(temperature=0.0), _row(temperature=0.0), _row(temperature=0.8, seed=1), _row(logprobs=2)]
    token_ids, logprobs, nonfinite = Sampler(16)(logits, rows).copy_to_host().wait()
    assert nonfinite == [1, 3] and len(token_ids) == 4
    assert token_ids[0] == logits[0].argmax().item() and logprobs[3] is not None
