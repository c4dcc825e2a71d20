"""JSON text in and out of the gateway: a depth bound on every JSON text a client or the model gives (a request
body, JSON held in a request's string field, tool-call JSON the model writes), and encoders that never fail on a
lone surrogate.

Deep nesting is refused by its depth, counted before parsing, not by catching RecursionError: whether a parser
recurses out depends on how deep the stack already is, and a value that parses at 900 levels may still recurse out
later, in the chat template's tojson, an encoder or the worker's grammar compiler. MAX_JSON_DEPTH is far beyond
any real schema or arguments, and far within what each of those holds.
"""
from __future__ import annotations

import json
import re
from itertools import accumulate
from typing import Any

import msgspec

from gateway.api_error import APIError

MAX_JSON_DEPTH = 200
_NESTING = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")             # +1, +1, -1, -1 read as signed bytes
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_SURROGATE = re.compile("[\ud800-\udfff]")


def too_deep(text: str | bytes) -> bool:
    """Whether a JSON text nests arrays and objects more than MAX_JSON_DEPTH deep (brackets inside strings
    do not count). Linear and C-speed (no regular expression, no Python loop): a text with few brackets is answered
    by counting them."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return False
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")      # now each quote opens or closes a string
    outside_strings = b"".join(unescaped.split(b'"')[::2])
    brackets = outside_strings.translate(_NESTING, _NOT_BRACKETS)
    return max(accumulate(memoryview(brackets).cast("b")), default=0) > MAX_JSON_DEPTH


def parse_json_field(text: str, error: str, param: str) -> Any:
    """The JSON value a request's string field holds; a 400 naming `param`, its message `error` and the reason,
    when it is not JSON or nests more than MAX_JSON_DEPTH deep."""
    if too_deep(text):
        raise APIError(f"{error}: nested more than {MAX_JSON_DEPTH} levels deep.", param=param)
    try:
        return msgspec.json.decode(text)
    except (msgspec.DecodeError, RecursionError) as e:
        raise APIError(f"{error}: {e}", param=param) from None


def json_or(text: str, default: Any) -> Any:
    """json.loads(text), or `default` when text is not JSON or nests more than MAX_JSON_DEPTH deep (model output,
    where what is not JSON is text)."""
    if too_deep(text):
        return default
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError, RecursionError):
        return default


def escape_surrogates(json_text: str) -> str:
    """A JSON text with every lone surrogate written as its \\uXXXX escape (the same JSON value)."""
    return _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", json_text)


def has_surrogate(text: str) -> bool:
    return _SURROGATE.search(text) is not None


_encode = msgspec.json.Encoder().encode


def encode(value: Any) -> bytes:
    """msgspec's JSON bytes of `value`; where a string holds a lone surrogate (an echoed request field), the same
    JSON with it escaped, as json.dumps writes it, instead of an UnicodeEncodeError."""
    try:
        return _encode(value)
    except UnicodeEncodeError:
        return json.dumps(msgspec.to_builtins(value), separators=(",", ":")).encode()
