"""A request's output constraint (vLLM's fields) as one StructuredOutput; a constrained stream's start checked.

vLLM takes a constraint from `response_format` (json_object, json_schema), from `structured_outputs` (json,
regex, choice, grammar, json_object), or from the older `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`. The gateway checks shapes and JSON here (no xgrammar in this process: it imports torch);
the worker compiles the spec and answers a spec xgrammar refuses with a 400 naming the problem.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, TypeVar

import msgspec

from gateway.api_error import APIError
from gateway.json_text import parse_json_field
from gateway.responses import raise_if_failed
from worker.ipc.messages import StructuredOutput

T = TypeVar("T")

KINDS = ("json", "regex", "choice", "grammar", "json_object")
UNSUPPORTED_KINDS = ("structural_tag",)
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_output(body: Any) -> StructuredOutput | None:
    """The one constraint a completion or chat request sets, or None; a 400 naming the field when it is
    malformed."""
    fields = dict(body.structured_outputs or {})
    for name, kind in GUIDED.items():
        if getattr(body, name) is not None:
            fields.setdefault(kind, getattr(body, name))
    from_format = _from_response_format(body.response_format)
    if from_format is not None:
        fields.setdefault(*from_format)
    for kind in UNSUPPORTED_KINDS:
        _check(fields.get(kind) is None, f"Structured outputs of kind `{kind}` are not supported by this server.",
               "structured_outputs")
    given = [k for k in KINDS if fields.get(k) not in (None, False)]
    if not given:
        return None
    _check(len(given) == 1, "You can only use one kind of structured outputs constraint but multiple are "
           f"specified: {', '.join(given)}.", "structured_outputs")
    kind = given[0]
    any_whitespace = not fields.get("disable_any_whitespace", False)
    return StructuredOutput(kind, _spec(kind, fields[kind]), any_whitespace)


def _from_response_format(response_format: dict[str, Any] | None) -> tuple[str, Any] | None:
    if response_format is None:
        return None
    _check(isinstance(response_format, dict), "`response_format` must be an object.", "response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", True)
    if kind == "json_schema":
        json_schema = response_format.get("json_schema")
        _check(isinstance(json_schema, dict) and json_schema.get("schema") is not None,
               "`response_format` of type 'json_schema' needs `json_schema.schema`.", "response_format")
        return ("json", json_schema["schema"])
    _check(kind not in UNSUPPORTED_KINDS, f"`response_format` of type '{kind}' is not supported by this server.",
           "response_format")
    raise APIError(f"`response_format.type` must be one of 'text', 'json_object' or 'json_schema', got {kind!r}.",
                   param="response_format")


def _spec(kind: str, value: Any) -> str:
    """The spec string the worker compiles: a schema's JSON, a choice list's JSON, a regex or grammar as is."""
    if kind == "json_object":
        return ""
    if kind == "json":
        if isinstance(value, str):
            value = parse_json_field(value, "Invalid JSON schema", "structured_outputs")
        _check(isinstance(value, (dict, bool)), "Invalid JSON schema: a schema must be a JSON object.",
               "structured_outputs")
        return msgspec.json.encode(value).decode()
    if kind == "choice":
        _check(isinstance(value, list) and bool(value) and all(isinstance(c, str) for c in value),
               "`choice` must be a non-empty list of strings.", "structured_outputs")
        return msgspec.json.encode(value).decode()
    _check(isinstance(value, str) and bool(value), f"`{kind}` must be a non-empty string.", "structured_outputs")
    return value


def _check(ok: bool, message: str, param: str | None) -> None:
    if not ok:
        raise APIError(message, param=param)


async def checked_start(deltas: AsyncIterator[T]) -> AsyncIterator[T]:
    """`deltas` once its first item is in and is not an error: a spec the worker refused (or a token field it
    found out of vocabulary) is then a 400 response rather than an error event inside a started stream."""
    iterator = aiter(deltas)
    try:
        first = await anext(iterator)
    except StopAsyncIteration:
        first = None
    if first is not None:
        try:
            raise_if_failed(first[1])
        except APIError:
            await iterator.aclose()
            raise

    async def rest() -> AsyncIterator[T]:
        if first is not None:
            yield first
        async for item in iterator:
            yield item
    return rest()


def uses_token_constraints(body: Any) -> bool:
    """Whether the request sets a field the worker may refuse before its first token."""
    return bool(body.logit_bias or body.allowed_token_ids is not None or body.bad_words
                or structured_output(body) is not None)
