"""Checks on a request before it is queued; each error names the field and value, as vLLM words it."""
from __future__ import annotations

from worker.ipc.messages import SamplingParams

MAX_LOGPROBS = 20


def validate_request(prompt_token_ids: list[int], params: SamplingParams, vocab_size: int,
                     max_model_len: int) -> None:
    """Raise ValueError with a user-facing message when the request cannot run."""
    if not prompt_token_ids:
        raise ValueError("The prompt cannot be empty.")
    bad = next((t for t in prompt_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"Token id {bad} is out of vocabulary (vocab size {vocab_size}).")
    n = len(prompt_token_ids)
    if n >= max_model_len:
        raise ValueError(f"This model's maximum context length is {max_model_len} tokens. However, your "
                         f"request has {n} input tokens. Please reduce the length of the input messages.")
    _validate_params(params)
    validate_token_fields(params, vocab_size)


def validate_token_fields(p: SamplingParams, vocab_size: int) -> None:
    """logit_bias, allowed_token_ids and bad words name tokens of the vocabulary (vLLM's messages)."""
    bad = sorted(t for t in p.logit_bias or {} if not 0 <= t < vocab_size)
    if bad:
        raise ValueError(f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                         f"Vocabulary size: {vocab_size}")
    if p.allowed_token_ids is not None:
        if not p.allowed_token_ids:
            raise ValueError("allowed_token_ids is not None and empty!")
        if not all(0 <= t < vocab_size for t in p.allowed_token_ids):
            raise ValueError("allowed_token_ids contains out-of-vocab token id!")
    bad = [t for word in p.bad_words_token_ids for t in word if not 0 <= t < vocab_size]
    if bad or any(not word for word in p.bad_words_token_ids):
        raise ValueError(f"The model vocabulary size is {vocab_size}, but the following tokens were specified "
                         f"as bad: {bad}. All token id values should be integers satisfying: "
                         f"0 <= token_id < {vocab_size}.")


def _validate_params(p: SamplingParams) -> None:
    checks = [
        (p.max_tokens >= 1, "max_tokens", p.max_tokens, "must be at least 1"),
        (0 <= p.min_tokens <= p.max_tokens, "min_tokens", p.min_tokens, "must be in [0, max_tokens]"),
        (p.temperature >= 0, "temperature", p.temperature, "must be non-negative"),
        (0 < p.top_p <= 1, "top_p", p.top_p, "must be in (0, 1]"),
        (p.top_k >= -1, "top_k", p.top_k, "must be -1 (disable), 0 (disable) or at least 1"),
        (0 <= p.min_p <= 1, "min_p", p.min_p, "must be in [0, 1]"),
        (-2 <= p.presence_penalty <= 2, "presence_penalty", p.presence_penalty, "must be in [-2, 2]"),
        (-2 <= p.frequency_penalty <= 2, "frequency_penalty", p.frequency_penalty, "must be in [-2, 2]"),
        (p.repetition_penalty > 0, "repetition_penalty", p.repetition_penalty, "must be greater than zero"),
        (p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS, "logprobs", p.logprobs,
         f"must be in [0, {MAX_LOGPROBS}]"),
        (p.prompt_logprobs is None or 0 <= p.prompt_logprobs <= MAX_LOGPROBS, "prompt_logprobs",
         p.prompt_logprobs, f"must be in [0, {MAX_LOGPROBS}]"),
    ]
    for ok, field, value, rule in checks:
        if not ok:
            raise ValueError(f"{field} {rule}, got {value}.")
