"""Decoding a request body, and checking a prompt against the model, with vLLM's messages.

Requests decode with msgspec in two steps: JSON to a dict (so a malformed body or a non-object is a 400, and
vLLM's pre-validation checks see the raw values), then the dict to a typed struct (request_types.py). Every
failure is a 400 APIError.
"""
from __future__ import annotations

from typing import TypeVar

import msgspec

from gateway.api_error import APIError, check
from gateway.generation_request import GenerationRequest, check_raw_generation

# Accepted by vLLM, not implemented here: a request that sets one is refused rather than
# silently answered without it.
UNSUPPORTED_FIELDS = ("suffix", "prompt_embeds", "use_beam_search", "continue_final_message", "logits_processors",
                      "chat_template", "truncate_prompt_tokens")

T = TypeVar("T")


def decode_body(raw: bytes, type_: type[T]) -> T:
    """Parse and validate a JSON request body; every failure is a 400 APIError."""
    try:
        data = msgspec.json.decode(raw)
    except (msgspec.MsgspecError, UnicodeDecodeError) as e:      # MsgspecError: 1e999 is a ValidationError
        raise APIError(f"JSON decode error: {e}") from None
    except RecursionError:
        raise APIError("JSON decode error: the body is nested too deeply.") from None
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object.")
    for field in UNSUPPORTED_FIELDS:
        check(data.get(field) in (None, False, "", [], {}),
              f"`{field}` is not supported by this server.", field)
    if issubclass(type_, GenerationRequest):
        check_raw_generation(data)
    try:
        return msgspec.convert(data, type_, strict=False)
    except msgspec.ValidationError as e:
        raise APIError(str(e), param=_param_of(e)) from None


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int,
                       param: str = "max_tokens") -> int:
    """The output budget of one prompt; vLLM's context-length errors when it does not fit."""
    check(num_prompt_tokens < max_model_len,
          f"This model's maximum context length is {max_model_len} tokens. However, your request has "
          f"{num_prompt_tokens} input tokens. Please reduce the length of the input messages.", None)
    if requested is None:
        return max_model_len - num_prompt_tokens
    check(requested >= 1, f"max_tokens must be at least 1, got {requested}.", param)
    check(num_prompt_tokens + requested <= max_model_len,
          f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's maximum "
          f"context length is {max_model_len} tokens and your request has {num_prompt_tokens} input "
          f"tokens ({requested} > {max_model_len} - {num_prompt_tokens}).", None)
    return requested


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """Prompt token ids must exist in the tokenizer's vocabulary, and a prompt must not be empty."""
    check(bool(token_ids), "The decoder prompt cannot be empty", "prompt")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    check(bad is None, f"Token id {bad} is out of vocabulary", "prompt")


def _param_of(error: msgspec.ValidationError) -> str | None:
    """The field msgspec names: `$.messages[0].role` -> "messages[0].role"."""
    message = str(error)
    _, sep, path = message.rpartition(" - at `$")
    if message.startswith("Object missing required field `"):
        field = message.split("`")[1]
        path = f"{path.rstrip('`')}.{field}" if sep else field
        return path.lstrip(".")
    return (path.rstrip("`").lstrip(".") or None) if sep else None
