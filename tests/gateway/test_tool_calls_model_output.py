"""Tool calls from any model output: never a 500 or an error event, and one result (calls, content, finish reason)
whether the output arrives whole or streamed in any pieces. The decisions, as vLLM's streaming Hermes parser makes
them, are in gateway/tool_calls.py's ToolCallStream."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_routes import chat_body, events
from test_tool_calls import HERMES, TOOLS, choice, serve, stream_pieces

from gateway.json_text import MAX_JSON_DEPTH, escape_surrogates

DEEP = 1100
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def rebuilt(deltas: list[dict]) -> list[tuple[str, str]]:
    """(name, arguments) of each call OpenAI's deltas rebuild (arguments need not be JSON: see the decisions)."""
    calls: list[list[str]] = []
    for d in deltas:
        if d["index"] == len(calls):
            calls.append([d["function"]["name"], ""])
        calls[d["index"]][1] += d["function"]["arguments"]
    return [tuple(c) for c in calls]


def whole(tool_choice, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = choice(tool_choice).parse(text)
    return content, [(c.name, c.arguments) for c in calls]


def streamed(tool_choice, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    tools = choice(tool_choice)
    content, deltas = stream_pieces(tools, pieces)
    calls = rebuilt(deltas)
    return (content or None) if tools.mode == "auto" and calls else content, calls


CALL = '<tool_call>{"name": "get_time", "arguments": {"a": 1}}</tool_call>'
# (tool choice, model output, (content, calls)) the cases and their kin
CASES = [
    ("auto", CALL + "<tool_call>bad</tool_call>", ("<tool_call>bad</tool_call>", [("get_time", '{"a": 1}')])),
    ("auto", "<tool_call>[1]</tool_call>" + CALL, ("<tool_call>[1]</tool_call>", [("get_time", '{"a": 1}')])),
    ("auto", "A " + CALL + " B " + CALL + " C", ("A  B  C", [("get_time", '{"a": 1}')] * 2)),
    ("auto", '<tool_call>{"name": "get_time", "name": "get_weather", "arguments": {}, "arguments": [1]}</tool_call>',
     (None, [("get_time", "{}")])),
    ("auto", '<tool_call>{"name": 5, "name": "get_time"}</tool_call>', (None, [("get_time", "{}")])),
    ("auto", "<tool_call>" + "[" * DEEP + "]" * DEEP + "</tool_call>",
     ("<tool_call>" + "[" * DEEP + "]" * DEEP + "</tool_call>", [])),
    ("auto", "<tool_call>" + '{"a": ' * DEEP, ("<tool_call>" + '{"a": ' * DEEP, [])),
    ("auto", '<tool_call>{"name": "get_time", "arguments": ' + "[" * DEEP + "]" * DEEP + "}</tool_call> after",
     (" after", [("get_time", "[" * (MAX_JSON_DEPTH - 1))])),
    ("auto", '<tool_call>{"name": "get_time", "arguments": ' + '{"a": ' * DEEP,
     (None, [("get_time", '{"a": ' * (MAX_JSON_DEPTH - 2) + '{"a": ')])),
    ("auto", '<tool_call>{"name": "get_time", "arguments": {"s": "\\ud800", "t": "x\\udc00\\ud83d\\ude00"}}'
             '</tool_call>', (None, [("get_time", '{"s": "\\ud800", "t": "x\\udc00😀"}')])),
    ("auto", '<tool_call>{"name": "get_\\ud800", "arguments": {}}</tool_call>',
     ('<tool_call>{"name": "get_\\ud800", "arguments": {}}</tool_call>', [])),
    ("auto", 'say "\\ud800" <tool_call>{"arguments": {"\\udc00": 1}, "name": "get_time"}</tool_call>',
     ('say "\\ud800" ', [("get_time", '{"\\udc00": 1}')])),
    ("required", '[{"name": "get_time", "parameters": ' + "[" * DEEP + "]" * DEEP + "}]",
     ("", [("get_time", "[" * (MAX_JSON_DEPTH - 2))])),
    ("required", "[" * DEEP + "]" * DEEP, ("", [])),
    ("required", '[{"name": "get_time", "parameters": {"s": "\\ud800"}}]', ("", [("get_time", '{"s": "\\ud800"}')])),
    ("required", '[{"name": "get_time", "parameters": {"a": ', ("", [("get_time", '{"a": ')])),
    (NAMED, '{"s": "\\ud800"' + "[" * DEEP, ("", [("get_weather", '{"s": "\\ud800"' + "[" * DEEP)])),
]


@pytest.mark.parametrize("tool_choice, text, expected", CASES)
def test_each_output_parses_as_decided_whole_and_in_any_pieces(tool_choice, text, expected):
    assert whole(tool_choice, text) == expected
    for size in (1, 2, 7, 64, len(text)):
        assert streamed(tool_choice, [text[i:i + size] for i in range(0, len(text), size)]) == expected, size


@pytest.mark.parametrize("tool_choice, text, expected", CASES)
async def test_no_output_makes_a_500_and_streamed_answers_equal_whole_ones(tool_choice, text, expected):
    config = HERMES if tool_choice == "auto" else {}
    async with serve(text, chunk=5, max_model_len=32768, **config) as (http, client):
        body = chat_body(tools=TOOLS, tool_choice=tool_choice)
        response = await http.post("/v1/chat/completions", json=body)
        streamed_response = await http.post("/v1/chat/completions", json={**body, "stream": True})
    assert response.status_code == 200 == streamed_response.status_code, response.text
    choice_ = response.json()["choices"][0]
    message = choice_["message"]
    assert (message["content"], [(c["function"]["name"], c["function"]["arguments"])
                                 for c in message["tool_calls"]]) == expected
    chunks = [c for c in events(streamed_response) if c != "[DONE]"]
    assert not any("error" in c for c in chunks), chunks[-1]
    deltas = [d for c in chunks for ch in c["choices"] for d in ch["delta"].get("tool_calls", [])]
    content = "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])
    assert rebuilt(deltas) == expected[1] and content == (expected[0] or "")
    finish = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finish == [choice_["finish_reason"]]
    assert choice_["finish_reason"] == ("tool_calls" if tool_choice == "auto" and expected[1] else "stop")


NAMES = ["get_time", "get_time", "get_weather", "get_weather", "x", 5, None, "get_\\ud800"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=6)
    | st.sampled_from(["\ud800", "a\udc00", "</tool_call>", "<tool_call>", "😀"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)


@st.composite
def call_json(draw) -> str:
    """A call object as a model may write it: keys in any order, repeated or missing, any spacing, escapes."""
    keys = draw(st.sampled_from([["name", "arguments"], ["arguments", "name"], ["name"]])
                | st.lists(st.sampled_from(["name", "arguments", "extra"]), max_size=4))
    members = [(k, draw(st.sampled_from(NAMES)) if k == "name" else draw(json_values)) for k in keys]
    separator = draw(st.sampled_from([", ", ",", " ,\n "]))
    text = "{" + separator.join(f"{json.dumps(k)}: {json.dumps(v, ensure_ascii=draw(st.booleans()))}"
                                for k, v in members) + "}"
    text = escape_surrogates(text)              # generated text is decoded UTF-8: a lone surrogate only as escape
    return draw(st.sampled_from([text] * 4 + [text[:draw(st.integers(0, len(text)))], "[" * DEEP + text,
                                 text.replace(": {", ": " + "[" * (MAX_JSON_DEPTH + 1), 1)]))


@st.composite
def hermes_output(draw) -> str:
    parts = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["text", "block", "block", "unclosed", "junk"]))
        if kind == "text":
            parts.append(draw(st.text(alphabet="ab <>/_\n{}tool_call", max_size=12)))
        elif kind == "junk":
            parts.append("<tool_call>" + draw(st.text(alphabet='{}[]":, a\\', max_size=10)) + "</tool_call>")
        else:
            parts.append("<tool_call>" + draw(st.sampled_from(["", "\n"])) + draw(call_json())
                         + ("</tool_call>" if kind == "block" else ""))
    return "".join(parts)


@st.composite
def pieces(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@settings(max_examples=300, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), mode=st.sampled_from(["auto", "auto", "required", "named"]))
def test_any_output_streamed_in_any_pieces_parses_as_the_whole_output(data, mode):
    if mode == "auto":
        tool_choice, text = "auto", data.draw(hermes_output())
    else:
        calls = data.draw(st.lists(call_json(), max_size=3))
        text = "[" + ", ".join(c.replace('"arguments"', '"parameters"') for c in calls) + "]"
        if data.draw(st.booleans()):
            text = text[:data.draw(st.integers(0, len(text)))]
        tool_choice = "required" if mode == "required" else NAMED
    expected = whole(tool_choice, text)
    event(f"{mode}: {len(expected[1])} calls, {'some' if expected[0] else 'no'} content")
    assert streamed(tool_choice, data.draw(pieces(text))) == expected
    for name, arguments in expected[1]:
        assert isinstance(name, str) and name
        (name + arguments).encode()                 # UTF-8 holds what is sent: no lone surrogate
    (expected[0] or "").encode()
