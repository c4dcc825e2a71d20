"""GenerationRequest: the fields completions and chat share, with vLLM's names and defaults; vLLM's checks of
them (on the raw JSON values before decoding, then on the decoded fields) with its messages; and their translation
into the worker's SamplingParams.
"""
from __future__ import annotations

import math
from typing import Any

import msgspec

from gateway.api_error import APIError, check
from worker.ipc.messages import SamplingParams, StructuredOutput

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_N = 128   # choices per prompt; a guard against one request fanning out without bound
MAX_CHOICES = 2048   # choices (prompts x n) of one completions request: OpenAI's cap on a batch of prompts
MAX_STOP_CHARS = 16384   # characters of all stop strings: bounds the one-off build of their matcher (stop_strings.py)
LOGIT_BIAS_LIMIT = 100.0   # vLLM clamps each bias to [-100, 100]


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class GenerationRequest(msgspec.Struct, kw_only=True):
    """Fields completions and chat share, with vLLM's defaults."""
    model: str | None = None
    n: int | None = 1
    seed: int | None = None
    stop: str | list[str] | None = []
    stop_token_ids: list[int] | None = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    user: str | None = None
    logit_bias: dict[str, Any] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: dict[str, Any] | None = None      # gateway/structured.py reads the constraint fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def __post_init__(self) -> None:
        if self.n is None:
            self.n = 1
        if self.allowed_token_ids is not None:    # deduplicated once: every choice's copy crosses to the worker
            self.allowed_token_ids = list(dict.fromkeys(self.allowed_token_ids))

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None, index: int,
                        bad_words_token_ids: list[list[int]] | None = None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """The worker's parameters for choice `index` (each choice gets its own seed). `bad_words_token_ids`:
        Tokenizer.bad_words_token_ids of `bad_words`; `structured`: gateway.structured.structured_output."""
        check(self.min_tokens <= max_tokens,
              f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {self.min_tokens}.", None)
        seed = None if self.seed is None or self.seed == -1 else self.seed + index
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_tokens, seed=seed,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None or self.top_k == -1 else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop_token_ids=list(dict.fromkeys(self.stop_token_ids or [])), ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids, bad_words_token_ids=bad_words_token_ids or [],
            structured=structured)

    def validate_sampling(self, max_logprobs: int, logprobs: int | None) -> None:
        """vLLM's SamplingParams checks, with its messages."""
        temperature = 1.0 if self.temperature is None else self.temperature
        check(self.n >= 1, f"n must be at least 1, got {self.n}.", "n")
        check(self.n <= MAX_N, f"n must be at most {MAX_N}, got {self.n}.", "n")
        check(-2.0 <= (self.presence_penalty or 0.0) <= 2.0,
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.", "presence_penalty")
        check(-2.0 <= (self.frequency_penalty or 0.0) <= 2.0,
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.", "frequency_penalty")
        if self.repetition_penalty is not None:
            check(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
                  f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.",
                  "repetition_penalty")
        check(math.isfinite(temperature), f"temperature must be a finite number, got {temperature}.",
              "temperature")
        check(temperature >= 0.0, f"temperature must be non-negative, got {temperature}.", "temperature")
        check(temperature <= 2.0, f"temperature must be in [0, 2], got {temperature}.", "temperature")
        if self.top_p is not None:
            check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        if self.top_k is not None:
            check(self.top_k >= -1, f"top_k must be 0 (disable), or at least 1, got {self.top_k}.", "top_k")
            check(self.top_k <= INT64_MAX, f"top_k must be a 64-bit integer, got {self.top_k}.", "top_k")
        check(all(INT64_MIN <= t <= INT64_MAX for t in self.stop_token_ids or []),
              "stop_token_ids must be 64-bit integers.", "stop_token_ids")
        if self.min_p is not None:
            check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.", "min_p")
        check(self.min_tokens >= 0, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.",
              "min_tokens")
        if self.seed is not None:
            check(INT64_MIN <= self.seed <= INT64_MAX, f"seed must be a 64-bit integer, got {self.seed}.", "seed")
        check(all(self.stop_strings), "stop cannot contain an empty string.", "stop")
        stop_chars = sum(map(len, self.stop_strings))
        check(stop_chars <= MAX_STOP_CHARS,
              f"stop strings may total at most {MAX_STOP_CHARS} characters, got {stop_chars}.", "stop")
        check(all(INT64_MIN <= t <= INT64_MAX for t in self.allowed_token_ids or []),
              "allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids")
        check(temperature > 0.0 or self.n == 1, f"n must be 1 when using greedy sampling, got {self.n}.", "n")
        _check_logprobs_limit("sample", logprobs, max_logprobs, "logprobs")
        _check_logprobs_limit("prompt", self.prompt_logprobs, max_logprobs, "prompt_logprobs")


def check_raw_generation(data: dict[str, Any]) -> None:
    """vLLM's checks that run before field validation, on the raw values."""
    check(not (data.get("stream_options") and not data.get("stream")),
          "Stream options can only be defined when `stream=True`.", "stream_options")
    prompt_logprobs = data.get("prompt_logprobs")
    if _is_number(prompt_logprobs):
        check(not (data.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1)),
              "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        check(prompt_logprobs >= 0 or prompt_logprobs == -1,
              "`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
    logprobs = data.get("logprobs")
    if _is_number(logprobs):
        check(logprobs >= 0, "`logprobs` must be a positive value.", "logprobs")
    top_logprobs = data.get("top_logprobs")
    if _is_number(top_logprobs):
        check(top_logprobs >= 0 or top_logprobs == -1, "`top_logprobs` must be a positive value or -1.",
              "top_logprobs")
        check(not ((top_logprobs == -1 or top_logprobs > 0) and not data.get("logprobs")),
              "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")


def _logit_bias(bias: dict[str, Any] | None) -> dict[int, float] | None:
    """Token ids from the JSON's string keys, each bias clamped to [-100, 100], as vLLM converts them."""
    if not bias:
        return None
    out = {}
    for token_id, value in bias.items():
        try:
            key = int(token_id)
        except ValueError:
            raise APIError(f"Found token_id `{token_id}` in logit_bias but token_id must be an integer or string "
                           "representing an integer", param="logit_bias") from None
        check(_is_number(value), f"logit_bias values must be numbers, got {value!r} for token_id `{token_id}`.",
              "logit_bias")
        check(INT64_MIN <= key <= INT64_MAX, f"token_id(s) [{key}] in logit_bias contain out-of-vocab token ids.",
              "logit_bias")
        out[key] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
    return out


def _check_logprobs_limit(kind: str, requested: int | None, max_logprobs: int, param: str) -> None:
    if requested is not None:
        check(requested <= max_logprobs and requested != -1,
              f"Requested {kind} logprobs of {requested}, which is greater than max allowed: {max_logprobs}",
              param)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
