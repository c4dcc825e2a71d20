"""Tool calling: tool_choice checks, the constraints of "required" and named tools, the Hermes parser over whole
and streamed outputs, and the chat route's messages and chunks with a scripted worker output."""
from __future__ import annotations

import json
from contextlib import asynccontextmanager

import httpx
import pytest
from fake_worker_client import FakeWorkerClient
from test_routes import BASE, MODEL_DIR, TOKENIZER, chat_body, events

from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.protocol import APIError
from gateway.tokenizer import Tokenizer
from gateway.tool_calls import AUTO_NEEDS_FLAGS, ToolChoice, parse_hermes

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": None}}
TOOLS = [WEATHER, TIME]
SCRIPT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def choice(tool_choice, tools=TOOLS, parallel=True, auto=True) -> ToolChoice:
    return ToolChoice.from_request(tools, tool_choice, parallel, auto)


@pytest.mark.parametrize("tool_choice, tools, auto, message", [
    ("auto", TOOLS, False, AUTO_NEEDS_FLAGS),
    (None, TOOLS, False, AUTO_NEEDS_FLAGS),
    ("auto", None, True, "When using `tool_choice`, `tools` must be set."),
    ("sometimes", TOOLS, True, 'Invalid value for `tool_choice`: sometimes! Only named tools, "none", "auto" or '
                               '"required" are supported.'),
    ({"type": "function"}, TOOLS, True, "Invalid value for `function`: `None` in `tool_choice`!"),
    ({"function": {}}, TOOLS, True, "Expected field `name` in `function` in `tool_choice`!"),
    ({"function": {"name": ""}}, TOOLS, True, "Invalid `name` in `function`: `` in `tool_choice`!"),
    ({"function": {"name": "nope"}}, TOOLS, True,
     "The tool specified in `tool_choice` does not match any of the specified `tools`"),
])
def test_tool_choice_is_checked_as_vllm_checks_it(tool_choice, tools, auto, message):
    with pytest.raises(APIError) as e:
        ToolChoice.from_request(tools, tool_choice, True, auto)
    assert e.value.message.startswith(message) and e.value.param == "tool_choice"


def test_modes():
    assert choice(None, tools=None).mode == "none" and choice("none").mode == "none"
    assert choice(None).mode == "auto" and choice("required").mode == "required"
    assert choice("required", tools=[]).mode == "none"            # OpenAI's behaviour: no tools, no call
    named = choice({"type": "function", "function": {"name": "get_time"}})
    assert (named.mode, named.name) == ("named", "get_time")


def test_named_tool_is_constrained_to_its_parameters():
    named = choice({"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.constraint().spec) == WEATHER["function"]["parameters"]
    empty = choice({"type": "function", "function": {"name": "get_time"}})
    assert json.loads(empty.constraint().spec) == {"type": "object", "properties": {}}
    assert choice("auto").constraint() is None and choice("none").constraint() is None


@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_an_array_of_calls_of_the_tools(parallel):
    schema = json.loads(choice("required", parallel=parallel).constraint().spec)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema.get("maxItems") == (None if parallel else 1)
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]


def test_hermes_parses_blocks_and_keeps_the_text_before_them():
    content, calls = parse_hermes(SCRIPT)
    assert content == "Let me check. "
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)


@pytest.mark.parametrize("text", ["no calls here", "<tool_call>{not json</tool_call>", "<tool_call>[1]</tool_call>"])
def test_hermes_output_without_valid_blocks_is_all_content(text):
    assert parse_hermes(text) == (text, [])


def test_hermes_reads_an_unclosed_last_block():
    content, calls = parse_hermes('<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "UTC"})]


def stream_all(tools: ToolChoice, text: str, size: int) -> tuple[str, list[dict]]:
    stream = tools.stream()
    content, deltas = "", []
    for start in range(0, len(text), size):
        more, calls = stream.feed(text[start:start + size])
        content, deltas = content + more, deltas + calls
    more, calls = stream.finish()
    return content + more, deltas + calls


def merged_calls(deltas: list[dict]) -> list[tuple[str, dict]]:
    """The calls a client rebuilds from tool-call deltas: by index, name once, arguments concatenated."""
    calls: dict[int, list] = {}
    for d in deltas:
        entry = calls.setdefault(d["index"], ["", ""])
        entry[0] += d.get("function", {}).get("name", "")
        entry[1] += d.get("function", {}).get("arguments", "")
    return [(name, json.loads(arguments)) for name, arguments in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_streamed_hermes_gives_the_calls_of_the_whole_output(size):
    content, deltas = stream_all(choice("auto"), SCRIPT + " trailing", size)
    assert content == "Let me check. \n trailing"
    assert merged_calls(deltas) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all("id" in d and d["type"] == "function" for d in deltas)


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_streamed_hermes_text_that_looks_like_a_block_start_is_content(size):
    content, deltas = stream_all(choice("auto"), "a <tool_ b <tool_call>{bad}</tool_call> c", size)
    assert content == "a <tool_ b <tool_call>{bad}</tool_call> c" and deltas == []


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_streamed_required_and_named_calls(size):
    required = '[{"name": "get_weather", "parameters": {"city": "a]}\\"b"}}, {"name": "get_time", "parameters": {}}]'
    content, deltas = stream_all(choice("required"), required, size)
    assert content == "" and merged_calls(deltas) == [("get_weather", {"city": 'a]}"b'}), ("get_time", {})]
    named = choice({"type": "function", "function": {"name": "get_weather"}})
    content, deltas = stream_all(named, '{"city": "Oslo"}', size)
    assert content == "" and merged_calls(deltas) == [("get_weather", {"city": "Oslo"})]
    assert "id" in deltas[0] and all("id" not in d for d in deltas[1:])


@asynccontextmanager
async def serve(script_text: str, tokenizer: Tokenizer = TOKENIZER, **config):
    client = FakeWorkerClient(lambda request: TOKENIZER.encode(script_text, add_special_tokens=False) + [2],
                              max_model_len=4096, chunk=3)
    app = build_app(GatewayConfig(model=MODEL_DIR, served_model_names=(BASE,), **config), client, tokenizer)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
            yield http, client


HERMES = dict(enable_auto_tool_choice=True, tool_call_parser="hermes")


async def test_auto_tool_calls_in_a_whole_message():
    async with serve(SCRIPT, **HERMES) as (http, client):
        response = await http.post("/v1/chat/completions", json=chat_body(tools=TOOLS))
    assert response.status_code == 200, response.text
    result = response.json()["choices"][0]
    assert result["finish_reason"] == "tool_calls"
    assert result["message"]["content"] == "Let me check. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert client.requests[0].params.structured is None


async def test_auto_tool_calls_streamed_as_openai_streams_them():
    async with serve(SCRIPT, **HERMES) as (http, client):
        response = await http.post("/v1/chat/completions", json=chat_body(tools=TOOLS, stream=True))
    chunks = [c for c in events(response) if c != "[DONE]"]
    deltas = [d for c in chunks for ch in c["choices"] for d in ch["delta"].get("tool_calls", [])]
    assert merged_calls(deltas) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]) == "Let me check. \n"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_tools_and_tool_call_history_reach_the_chat_template():
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}<{{ m.role }}:"
                "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.tz }}){% endfor %}"
                "{{ m.tool_call_id or '' }}{{ m.content }}>{% endfor %}")
    tokenizer = Tokenizer(TOKENIZER.backend, template, TOKENIZER.special_tokens)
    async with serve("plain answer", tokenizer=tokenizer, **HERMES) as (http, client):
        response = await http.post("/v1/chat/completions", json=chat_body(tools=TOOLS, tool_choice="none", messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}}]},
            {"role": "tool", "content": "noon", "tool_call_id": "1"}]))
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"] == {"role": "assistant", "content": "plain answer"}
    prompt = TOKENIZER.decode(client.requests[0].prompt_token_ids, skip_special_tokens=False)
    assert prompt == "[get_weather][get_time]<user:hi><assistant:get_time(UTC)><tool:1noon>"


@pytest.mark.parametrize("stream", [False, True])
async def test_named_and_required_tool_choice_send_the_schema_and_read_the_call(stream):
    arguments = '{"city": "Rome"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    async with serve(arguments) as (http, client):
        response = await http.post("/v1/chat/completions", json=chat_body(tools=TOOLS, tool_choice=named,
                                                                          stream=stream))
    assert client.requests[0].params.structured.kind == "json"
    if stream:
        chunks = [c for c in events(response) if c != "[DONE]"]
        deltas = [d for c in chunks for ch in c["choices"] for d in ch["delta"].get("tool_calls", [])]
        assert merged_calls(deltas) == [("get_weather", {"city": "Rome"})]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    else:
        message = response.json()["choices"][0]["message"]
        assert message["content"] == "" and message["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                                    "arguments": arguments}
    required = '[{"name": "get_time", "parameters": {}}]'
    async with serve(required) as (http, client):
        response = await http.post("/v1/chat/completions", json=chat_body(tools=TOOLS, tool_choice="required",
                                                                          parallel_tool_calls=False))
    assert json.loads(client.requests[0].params.structured.spec)["maxItems"] == 1
    assert response.json()["choices"][0]["message"]["tool_calls"][0]["function"] == {"name": "get_time",
                                                                                      "arguments": "{}"}


async def test_bad_tool_call_arguments_in_history_are_a_400():
    async with serve("x") as (http, client):
        response = await http.post("/v1/chat/completions", json=chat_body(messages=[
            {"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                  "function": {"name": "f", "arguments": "{oops"}}]}]))
    assert response.status_code == 400 and "Invalid JSON in the arguments of a tool call" in response.text
