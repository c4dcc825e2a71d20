"""JSON text in and out of the gateway: the depth bound, against a reference depth count; every request field that
holds JSON in a string, and a body itself, nested past it a 400 in vLLM's envelope, nested within it accepted; lone
surrogates escaped by the encoders."""
from __future__ import annotations

import json

import pytest
from gateway_app import BASE, error_of, serve
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.api_error import APIError
from gateway.json_text import MAX_JSON_DEPTH, encode, escape_surrogates, parse_json_field, too_deep


def reference_depth(value) -> int:
    """Nesting depth of a JSON value: 0 for a scalar, 1 + the deepest member for a container."""
    members = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    return 0 if members is None else 1 + max(map(reference_depth, members), default=0)


def nested(depth: int, bracket: str, inner: str = "1") -> str:
    """`depth` levels of arrays ("[") or objects ("{"), `inner` at the bottom."""
    if bracket == "[":
        return "[" * depth + inner + "]" * depth
    return '{"a": ' * depth + inner + "}" * depth


json_values = st.recursive(
    st.none() | st.integers() | st.text(alphabet='[]{}"\\ab', max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='[]{}"\\k', max_size=4), inner,
                                                                max_size=3),
    max_leaves=400)


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(value=json_values, wrap=st.integers(0, MAX_JSON_DEPTH + 2), bracket=st.sampled_from("[{"),
       indent=st.sampled_from([None, 1]))
def test_too_deep_counts_nesting_as_a_json_parser_does(value, wrap, bracket, indent):
    """Brackets inside strings (escaped quotes too) do not count; any spacing; str and bytes alike."""
    text = nested(wrap, bracket, json.dumps(value, indent=indent))
    expected = reference_depth(json.loads(text)) > MAX_JSON_DEPTH
    assert too_deep(text) == too_deep(text.encode()) == expected


@pytest.mark.parametrize("bracket", ["[", "{"])
def test_the_bound_is_exact(bracket):
    assert not too_deep(nested(MAX_JSON_DEPTH, bracket)) and too_deep(nested(MAX_JSON_DEPTH + 1, bracket))
    assert not too_deep('"' + "[" * 5000 + '"') and too_deep("[" * 5000)      # unclosed: still too deep


@pytest.mark.parametrize("text, reason", [
    (nested(MAX_JSON_DEPTH + 1, "["), f"nested more than {MAX_JSON_DEPTH} levels deep"),
    ("{" * 100_000, f"nested more than {MAX_JSON_DEPTH} levels deep"),
    ('{"a": ', "Input data was truncated"),
    ('"\\ud800"', "Input data was truncated"),                # msgspec refuses a lone surrogate
])
def test_a_field_holding_bad_json_is_a_400_naming_it(text, reason):
    with pytest.raises(APIError) as e:
        parse_json_field(text, "Invalid JSON schema", "structured_outputs")
    assert (e.value.status, e.value.param) == (400, "structured_outputs")
    assert e.value.message.startswith("Invalid JSON schema: ") and reason in e.value.message


@pytest.mark.parametrize("value", ["\ud800", "a\udfffb", {"k\udc00": ["\ud83d", "😀"]}])
def test_lone_surrogates_are_written_as_escapes(value):
    text = escape_surrogates(json.dumps(value, ensure_ascii=False))
    assert json.loads(text.encode()) == value                                   # UTF-8 holds it, and it reads back
    assert json.loads(encode({"v": value})) == {"v": value}
    assert encode({"v": "é😀"}) == '{"v":"é😀"}'.encode()                     # no escapes otherwise


ARGUMENTS_DEEP = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "1", "type": "function", "function": {"name": "f", "arguments": "DEEP"}}]}]
# (route, body with the string "DEEP" where deep JSON goes, the param the 400 names)
STRING_FIELDS = [
    ("/v1/chat/completions", {"messages": ARGUMENTS_DEEP}, "messages"),
    ("/tokenize", {"messages": ARGUMENTS_DEEP}, "messages"),
    *[(route, {**prompt, **fields}, "structured_outputs")
      for route, prompt in [("/v1/completions", {"prompt": "hi"}),
                            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]
      for fields in [{"guided_json": "DEEP"}, {"structured_outputs": {"json": "DEEP"}},
                     {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "DEEP"}}}]],
]


def with_deep(body: dict, text: str) -> dict:
    return json.loads(json.dumps(body).replace('"DEEP"', json.dumps(text)))


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 1100, 2000, 100_000])
@pytest.mark.parametrize("bracket", ["[", "{"])
@pytest.mark.parametrize("route, body, param", STRING_FIELDS)
async def test_deep_json_in_a_string_field_is_a_400(route, body, param, bracket, depth):
    async with serve() as (http, client, _):
        for stream in ([False, True] if route != "/tokenize" else [False]):
            response = await http.post(route, json={"model": BASE, "max_tokens": 2, "stream": stream,
                                                    **with_deep(body, nested(depth, bracket))})
            status, message, got_param = error_of(response)
            assert (status, got_param) == (400, param) and "nested more than" in message, message
        assert client.requests == []


@pytest.mark.parametrize("route, body, param", STRING_FIELDS)
async def test_json_in_a_string_field_nested_within_the_bound_is_accepted(route, body, param):
    schema = nested(MAX_JSON_DEPTH - 1, "{", '{"type": "object"}').replace('"a"', '"not"')
    async with serve() as (http, client, _):
        response = await http.post(route, json={"model": BASE, "max_tokens": 2, **with_deep(body, schema)})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 900, 5000])
@pytest.mark.parametrize("where", ["tool parameters", "chat_template_kwargs", "guided_json", "messages"])
async def test_a_deep_body_is_a_400(where, depth):
    """Nesting a JSON decoder would hold (900) but the template, the encoders or the worker's compiler might not."""
    deep = {"DEEP": 1}
    body = {"model": BASE, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    if where == "tool parameters":
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    elif where == "chat_template_kwargs":
        body["chat_template_kwargs"] = {"x": deep}
    elif where == "guided_json":
        body["guided_json"] = deep
    else:
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "hi", "x": deep}]}]
    raw = json.dumps(body).replace('{"DEEP": 1}', nested(depth, "{")).encode()
    async with serve() as (http, client, _):
        response = await http.post("/v1/chat/completions", content=raw)
    assert error_of(response)[:2] == (400, "JSON decode error: the body is nested too deeply.")
