"""Tool calling: tool_choice checks, the constraints of "required" and named tools, the Hermes parser over whole
and streamed outputs, and the chat route's messages and chunks with a scripted worker output."""
from __future__ import annotations

import json
import random
import re
from contextlib import asynccontextmanager

import httpx
import pytest
from fake_worker_client import FakeWorkerClient
from test_routes import BASE, MODEL_DIR, TOKENIZER, chat_body, events

from gateway.api_error import APIError
from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.tokenizer import Tokenizer
from gateway.tool_calls import AUTO_NEEDS_FLAGS, ToolChoice
from worker.config import ModelConfig, WorkerConfig

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": None}}
TOOLS = [WEATHER, TIME]
SCRIPT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def choice(tool_choice, tools=TOOLS, parallel=True, auto=True) -> ToolChoice:
    return ToolChoice.from_request(tools, tool_choice, parallel, auto)


def parse_hermes(text: str):
    return choice("auto").parse(text)


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


def test_hermes_parses_blocks_and_keeps_the_text_outside_them():
    content, calls = parse_hermes(SCRIPT)
    assert content == "Let me check. \n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)


@pytest.mark.parametrize("text", ["no calls here", "<tool_call>{not json</tool_call>", "<tool_call>[1]</tool_call>"])
def test_hermes_output_without_valid_blocks_is_all_content(text):
    assert parse_hermes(text) == (text, [])


def test_hermes_reads_an_unclosed_last_block():
    content, calls = parse_hermes('<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}')
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"tz": "UTC"})]


HARD = ('Sure.\n<tool_call>\n{"arguments": {"q": "a \\"quoted\\" <tag> </tool", "n": [1, -0.5e1, 1E2, true, null, '
        '{}], "u": "\\u00e9\\ud83d\\ude00 日本 \\n\\t/\\/", "nested": {"k": [[], {"x": false}]}}, "name": "search", '
        '"extra": [1, {"a": "b"}]}\n</tool_call>\n<tool_call>{"name":"get_time"}</tool_call><tool_call>\n'
        '{ "name" : "get_weather" , "arguments" : {"city":"Paris"  ,  "days":3} }\n</tool_call>')
UNCLOSED = 'x <tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}'
REQUIRED = ['[{"name": "get_weather", "parameters": {"city": "a]}\\"b"}}, {"name": "get_time", "parameters": {}}]',
            '[\n  {\n    "parameters": {\n      "city": "Lima \\u00e9",\n      "days": 2.50\n    },\n'
            '    "name": "get_weather"\n  }\n]']


def chunkings(text: str) -> list[list[str]]:
    """`text` split one character at a time, one token at a time (the test tokenizer's), in random sizes, whole."""
    ids = TOKENIZER.encode(text, add_special_tokens=False)
    tokens, done = [], ""
    for i in range(1, len(ids) + 1):
        prefix = TOKENIZER.decode(ids[:i], skip_special_tokens=False)
        if not prefix.endswith("\ufffd") or i == len(ids):
            tokens.append(prefix[len(done):])
            done = prefix
    assert "".join(tokens) == text
    out = [list(text), tokens, [text]]
    for seed in range(6):
        rng, pieces, at = random.Random(seed), [], 0
        while at < len(text):
            size = rng.randint(1, 12)
            pieces.append(text[at:at + size])
            at += size
        out.append(pieces)
    return out


def stream_pieces(tools: ToolChoice, pieces: list[str]) -> tuple[str, list[dict]]:
    stream = tools.stream()
    content, deltas = "", []
    for piece in pieces:
        more, calls = stream.feed(piece)
        content, deltas = content + more, deltas + calls
    more, calls = stream.finish()
    return content + more, deltas + calls


def stream_all(tools: ToolChoice, text: str, size: int) -> tuple[str, list[dict]]:
    return stream_pieces(tools, [text[i:i + size] for i in range(0, len(text), size)])


def calls_of(deltas: list[dict]) -> list[tuple[str, str]]:
    """The calls OpenAI's tool-call deltas rebuild, checked as OpenAI streams them: a call's first delta has its
    index (the next one), id, type and name with arguments ""; its later deltas only pieces of its arguments."""
    calls: list[list] = []
    for d in deltas:
        if d["index"] == len(calls):
            assert d["id"].startswith("chatcmpl-tool-") and d["type"] == "function", d
            assert set(d) == {"index", "id", "type", "function"} and d["function"]["arguments"] == "", d
            assert isinstance(d["function"]["name"], str) and d["function"]["name"], d
            calls.append([d["id"], d["function"]["name"], ""])
        else:
            assert d["index"] < len(calls) and set(d) == {"index", "function"}, d
            assert set(d["function"]) == {"arguments"} and d["function"]["arguments"], d
            calls[d["index"]][2] += d["function"]["arguments"]
    assert len({c[0] for c in calls}) == len(calls)
    for _, _, arguments in calls:
        json.loads(arguments)
    return [(name, arguments) for _, name, arguments in calls]


def merged_calls(deltas: list[dict]) -> list[tuple[str, dict]]:
    return [(name, json.loads(arguments)) for name, arguments in calls_of(deltas)]


def whole_calls(tools: ToolChoice, text: str) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in tools.parse(text)[1]]


@pytest.mark.parametrize("text", [SCRIPT + " trailing", HARD, UNCLOSED])
def test_streamed_hermes_arguments_come_in_pieces_that_make_the_whole_outputs_calls(text):
    tools = choice("auto")
    assert whole_calls(tools, text)
    for pieces in chunkings(text):
        content, deltas = stream_pieces(tools, pieces)
        assert calls_of(deltas) == whole_calls(tools, text), pieces
        assert content == re.sub(r"<tool_call>.*?(</tool_call>|$)", "", text, flags=re.DOTALL), pieces
        if len(pieces) == len(text):                # a character at a time: arguments stream as they come
            assert len(deltas) > 2 * len(whole_calls(tools, text))


def test_streamed_hermes_sends_the_name_first_and_the_arguments_as_generated():
    stream = choice("auto").stream()
    steps = ["Hi <tool", "_call>\n{\"name\": \"get_wea", "ther\", ", "\"arguments\": {\"ci", "ty\": \"Pa", "ris\"",
             "}}\n</tool_call>"]
    out = [stream.feed(step) for step in steps] + [stream.finish()]
    assert [content for content, _ in out] == ["Hi ", "", "", "", "", "", "", ""]
    assert [[{k: v for k, v in d.items() if k != "id"} for d in deltas] for _, deltas in out] == [
        [], [], [{"index": 0, "type": "function", "function": {"name": "get_weather", "arguments": ""}}],
        [{"index": 0, "function": {"arguments": '{"ci'}}], [{"index": 0, "function": {"arguments": 'ty": "Pa'}}],
        [{"index": 0, "function": {"arguments": 'ris"'}}], [{"index": 0, "function": {"arguments": "}"}}], []]


def random_value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return "".join(rng.choice('ab "\\/<>\n\t\x01é日😀{}[],:') for _ in range(rng.randrange(6)))
    if kind == 1:
        return rng.choice([0, -7, 12345678901234567890, 1.5, -0.25, 1e-7, 3e20, 2.0])
    if kind in (2, 3):
        return rng.choice([True, False, None])
    if kind in (4, 5):
        return {"".join(rng.choice('k "\\é😀') for _ in range(3)) + str(i): random_value(rng, depth + 1)
                for i in range(rng.randrange(4))}
    return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]


@pytest.mark.parametrize("seed", range(40))
def test_streamed_calls_of_random_json_equal_the_whole_outputs(seed):
    """Arguments of every shape, written with any spacing and escaping, in random pieces: the whole output's
    calls are the generated ones (names, and arguments as JSON values), and the streamed arguments are the whole
    output's, character for character."""
    rng = random.Random(seed)
    calls = [{"name": f"f{i}", "arguments": random_value(rng, 1) if rng.random() < 0.8 else {}} for i in range(3)]

    def dump(value):
        return json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 0, 2]),
                          separators=rng.choice([None, (",", ":"), (" , ", " : ")]))

    auto = "pre " + "\n".join(f"<tool_call>\n{dump(c)}\n</tool_call>" for c in calls)
    required = dump([{"name": c["name"], "parameters": c["arguments"]} for c in calls])
    generated = [(c["name"], c["arguments"]) for c in calls]
    for tools, text in [(choice("auto"), auto), (choice("required"), required)]:
        whole = whole_calls(tools, text)
        assert [(name, json.loads(arguments)) for name, arguments in whole] == generated
        for pieces in [p for i, p in enumerate(chunkings(text)) if i not in (1, 2)]:   # characters, random
            content, deltas = stream_pieces(tools, pieces)
            assert calls_of(deltas) == whole


@pytest.mark.parametrize("size", [1, 4, 1000])
@pytest.mark.parametrize("text", ["a <tool_ b <tool_call>{bad}</tool_call> c", "<tool_call>[1]</tool_call>",
                                  'x<tool_call>{"arguments": {}, "nam": "f"}</tool_call>y', "<tool_call>{\"na"])
def test_streamed_hermes_text_that_is_no_call_is_content(text, size):
    assert stream_all(choice("auto"), text, size) == (text, []) and parse_hermes(text) == (text, [])


@pytest.mark.parametrize("text", REQUIRED)
def test_streamed_required_calls_come_in_pieces_that_make_the_whole_outputs_calls(text):
    tools = choice("required")
    for pieces in chunkings(text):
        content, deltas = stream_pieces(tools, pieces)
        assert content == "" and calls_of(deltas) == whole_calls(tools, text), pieces
    assert merged_calls(stream_all(tools, REQUIRED[0], 1)[1]) == [("get_weather", {"city": 'a]}"b'}),
                                                                   ("get_time", {})]


def test_streamed_named_call_starts_with_its_name_then_streams_the_output():
    named = choice({"type": "function", "function": {"name": "get_weather"}})
    text = '{"city":  "Oslo"}'
    for pieces in chunkings(text):
        content, deltas = stream_pieces(named, pieces)
        assert content == "" and calls_of(deltas) == whole_calls(named, text) == [("get_weather", text)]
    (start,) = stream_pieces(named, [""])[1]              # no output: the call still starts
    assert start["function"] == {"name": "get_weather", "arguments": ""} and start["index"] == 0


@asynccontextmanager
async def serve(script_text: str, tokenizer: Tokenizer = TOKENIZER, chunk: int = 3, max_model_len: int = 4096,
                **config):
    client = FakeWorkerClient(lambda request: TOKENIZER.encode(script_text, add_special_tokens=False) + [2],
                              max_model_len=max_model_len, chunk=chunk)
    app = build_app(GatewayConfig(WorkerConfig(ModelConfig(MODEL_DIR)), served_model_names=(BASE,), **config), client,
                    tokenizer)
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
    assert result["message"]["content"] == "Let me check. \n"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in result["message"]["tool_calls"]] \
        == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert client.requests[0].params.structured is None


def stream_deltas(chunks: list[dict]) -> list[dict]:
    """A stream's tool-call deltas, no chunk naming an index twice."""
    deltas = []
    for chunk in chunks:
        for ch in chunk["choices"]:
            indexes = [d["index"] for d in ch["delta"].get("tool_calls", [])]
            assert len(set(indexes)) == len(indexes), chunk
            deltas += ch["delta"].get("tool_calls", [])
    return deltas


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
@pytest.mark.parametrize("script, content", [(SCRIPT, "Let me check. \n"), (HARD, "Sure.\n\n")])
async def test_auto_tool_calls_streamed_as_openai_streams_them(script, content, chunk):
    async with serve(script, chunk=chunk, **HERMES) as (http, client):
        answer = (await http.post("/v1/chat/completions", json=chat_body(tools=TOOLS))).json()
        response = await http.post("/v1/chat/completions", json=chat_body(tools=TOOLS, stream=True,
                                                                          stream_options={"include_usage": True}))
    whole = answer["choices"][0]
    chunks = [c for c in events(response) if c != "[DONE]"]
    assert calls_of(stream_deltas(chunks)) == [(c["function"]["name"], c["function"]["arguments"])
                                               for c in whole["message"]["tool_calls"]]
    assert "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"]) == content
    assert whole["message"]["content"] == content
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls" == whole["finish_reason"]
    assert chunks[-1]["usage"]["completion_tokens"] == answer["usage"]["completion_tokens"]


@pytest.mark.parametrize("chunk", [1, 4])
async def test_required_tool_calls_streamed_match_the_whole_message(chunk):
    async with serve(REQUIRED[1], chunk=chunk) as (http, client):
        body = chat_body(tools=TOOLS, tool_choice="required")
        whole = (await http.post("/v1/chat/completions", json=body)).json()["choices"][0]["message"]
        response = await http.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [c for c in events(response) if c != "[DONE]"]
    assert calls_of(stream_deltas(chunks)) == [(c["function"]["name"], c["function"]["arguments"])
                                               for c in whole["tool_calls"]] == [("get_weather",
                                                                                  '{"city": "Lima é", "days": 2.5}')]


@pytest.mark.parametrize("chunk", [1, 3, 1000])
async def test_the_openai_sdk_rebuilds_streamed_tool_calls(chunk):
    import openai
    from openai.lib.streaming.chat import ChatCompletionStreamState

    async with serve(HARD, chunk=chunk, **HERMES) as (http, client):
        sdk = openai.AsyncOpenAI(api_key="x", base_url="http://gateway/v1", http_client=http)
        whole = (await sdk.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}],
                                                   tools=TOOLS)).choices[0].message
        state = ChatCompletionStreamState()
        async for chunk_ in await sdk.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}],
                                                              tools=TOOLS, stream=True):
            state.handle_chunk(chunk_)
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Sure.\n\n"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] \
        == [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    assert [c.function.name for c in whole.tool_calls] == ["search", "get_time", "get_weather"]


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
