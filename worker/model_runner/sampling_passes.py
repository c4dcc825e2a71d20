"""The sampler's passes over a batch and which requests ask for each: the one definition the sampler runs its
passes by, and the launch pacer tells steps apart by (a pass's device time hardly depends on how many rows ask).

A pass runs over the whole batch when at least one row asks for it. A greedy row takes the argmax of its
processed logits, so it asks for no draw and none of the filters before the draw (top-k/top-p, min_p).
Nothing here imports torch.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from worker.ipc.messages import SamplingParams


def asks_draw(params: SamplingParams) -> bool:
    return not params.greedy


def asks_seeded_draw(params: SamplingParams) -> bool:
    """A draw from the request's own generator, so its token depends on nothing else in the batch."""
    return not params.greedy and params.seed is not None


def asks_top_k_top_p(params: SamplingParams) -> bool:
    """The sort top_k and top_p share; top_k 0 or -1 is off (one at or past the vocabulary keeps every token)."""
    return not params.greedy and (params.top_p < 1.0 or params.top_k > 0)


def asks_min_p(params: SamplingParams) -> bool:
    return not params.greedy and params.min_p > 0.0


def asks_penalties(params: SamplingParams) -> bool:
    """Repetition, frequency or presence penalty, all counted over the same tokens."""
    return params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0


def asks_logit_bias(params: SamplingParams) -> bool:
    return bool(params.logit_bias)


def asks_allowed_tokens(params: SamplingParams) -> bool:
    return params.allowed_token_ids is not None


def asks_bad_words(params: SamplingParams) -> bool:
    return bool(params.bad_words_token_ids)


def asks_logprobs(params: SamplingParams) -> bool:
    return params.logprobs is not None


# The passes by letter, as the launch pacer names a step's kind: d random draws, e seeded draws, s a top-k/top-p
# sort, m min_p, p penalties, l logprobs, b logit_bias, allowed_token_ids or bad words.
PASSES: dict[str, Callable[[SamplingParams], bool]] = {
    "d": lambda params: asks_draw(params) and not asks_seeded_draw(params),    # from the sampler's own generator
    "e": asks_seeded_draw,
    "s": asks_top_k_top_p,
    "m": asks_min_p,
    "p": asks_penalties,
    "l": asks_logprobs,
    "b": lambda params: asks_logit_bias(params) or asks_allowed_tokens(params) or asks_bad_words(params),
}


def pass_letters(rows_params: Iterable[SamplingParams]) -> str:
    """The letters of the passes some of the rows ask for, sorted; "" for greedy rows that ask for nothing else."""
    rows_params = list(rows_params)
    return "".join(sorted(letter for letter, asks in PASSES.items() if any(asks(p) for p in rows_params)))
