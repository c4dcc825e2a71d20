"""Structured outputs and token bans on the real server: every constrained output follows its spec, streamed and
not, chat and completions, on the base model and adapters, in one batch with unconstrained requests."""
from __future__ import annotations

import asyncio
import json

import pytest

from tests.structured_cases import CLOSERS, ENDS_EARLY, SCHEMAS, SPECS, check, ending_bias, whitespace_ban
from worker.demo import ADAPTERS, SERVED_MODEL_NAME

MODELS = [SERVED_MODEL_NAME, *(spec.name for spec in ADAPTERS)]


@pytest.fixture(scope="module")
def no_whitespace(reference) -> dict[str, int]:
    return whitespace_ban(reference.tokenizer)


@pytest.fixture(scope="module")
def closing_json(no_whitespace) -> dict[str, float]:
    """A logit_bias for tool calls: no whitespace, and JSON's closers nudged, so that a call's arguments end."""
    return no_whitespace | {str(t): b for t, b in CLOSERS.items()}


def constraint_fields(kind: str, spec: str, variant: int, no_whitespace: dict[str, int]) -> dict:
    """The request fields of a constraint, in each spelling vLLM accepts (chosen by `variant`); JSON without
    whitespace tokens."""
    if kind == "json":
        schema = json.loads(spec)
        return [{"response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}},
                {"structured_outputs": {"json": schema}}, {"guided_json": spec}][variant % 3] | {
                    "logit_bias": no_whitespace}
    if kind == "json_object":
        return {"response_format": {"type": "json_object"},
                "logit_bias": no_whitespace | {str(t): b for t, b in CLOSERS.items()}}
    if kind == "choice":
        return [{"guided_choice": json.loads(spec)}, {"structured_outputs": {"choice": json.loads(spec)}}][variant % 2]
    return [{f"guided_{kind}": spec}, {"structured_outputs": {kind: spec}}][variant % 2]


async def generate(http, route: str, model: str, prompt: str, fields: dict, stream: bool) -> tuple[str, str]:
    """(text, finish_reason) of one choice."""
    body = {"model": model, "max_tokens": 300, "temperature": 1.0, "stream": stream, **fields}
    if route == "chat":
        path, body = "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    else:
        path, body = "/v1/completions", {**body, "prompt": prompt}
    if not stream:
        response = await http.post(path, json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return (choice["message"]["content"] if route == "chat" else choice["text"]), choice["finish_reason"]
    text, finish = "", None
    async with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                text += (choice["delta"].get("content") or "") if route == "chat" else choice["text"]
                finish = choice["finish_reason"] or finish
    return text, finish


async def test_constrained_outputs_follow_their_specs_beside_free_requests(server, no_whitespace):
    jobs = []
    for i, (kind, spec) in enumerate(SPECS):
        for j, (route, stream) in enumerate([("chat", False), ("chat", True), ("completion", False),
                                             ("completion", True)]):
            fields = {**constraint_fields(kind, spec, i + j, no_whitespace), "seed": 10 * i + j}
            jobs.append((kind, spec, route, MODELS[(i + j) % len(MODELS)], f"case {i} {j}", fields, stream))
    free = [(None, None, route, MODELS[k % len(MODELS)], f"free {k}", {"seed": k, "max_tokens": 40}, k % 2 == 0)
            for k, route in enumerate(["chat", "completion"] * 4)]
    async with server.http() as http:
        results = await asyncio.gather(*(generate(http, route, model, prompt, fields, stream)
                                         for _, _, route, model, prompt, fields, stream in jobs + free))
    for (kind, spec, route, model, _, _, stream), (text, finish) in zip(jobs + free, results):
        if kind is None:
            assert finish in ("stop", "length")
            continue
        assert finish == "stop", (kind, route, model, stream, text)
        check(kind, spec, text)


async def completion(http, body: dict) -> tuple[str, str, dict]:
    """(text, finish_reason, usage) of a one-choice completion, streamed or not."""
    if not body.get("stream"):
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["text"], choice["finish_reason"], response.json()["usage"]
    text, finish, usage = "", None, None
    async with http.stream("POST", "/v1/completions", json={**body, "stream_options": {"include_usage": True}}) \
            as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                for choice in chunk["choices"]:
                    text, finish = text + choice["text"], choice["finish_reason"] or finish
                usage = chunk.get("usage") or usage
    return text, finish, usage


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("kind, spec, forced", ENDS_EARLY)
async def test_an_ignore_eos_request_stays_in_its_grammar_to_max_tokens(server, reference, kind, spec, forced,
                                                                        stream):
    """ignore_eos past the grammar's end: max_tokens tokens, finish reason "length" (vLLM's), and the text is the
    grammar's match, the end tokens after it adding none; the worker logs no token outside the grammar."""
    eos = reference.engine.eos_token_ids[0]
    bias = {str(t): b for t, b in ending_bias(reference.tokenizer, forced, eos).items()}
    body = {"model": SERVED_MODEL_NAME, "prompt": "end", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
            "stream": stream, **constraint_fields(kind, spec, 1, {}), "logit_bias": bias}
    warned = server.log_path.read_text().count("does not follow its grammar")
    async with server.http() as http:
        text, finish, usage = await completion(http, body)
    assert (text, finish, usage["completion_tokens"]) == (forced, "length", 12)
    check(kind, spec, text)
    assert server.log_path.read_text().count("does not follow its grammar") == warned


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     'Invalid JSON schema: Unsupported type "foo"'),
    ({"structured_outputs": {"grammar": 'start ::= "a"'}}, 'The root rule with name "root" is not found'),
    ({"guided_regex": "(ab"}, "Invalid regex: "),
    ({"logit_bias": {"999999": 5}}, "token_id(s) [999999] in logit_bias contain out-of-vocab token ids."),
])
async def test_specs_the_worker_refuses_are_400_in_vllm_envelope(server, fields, message, stream):
    body = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "stream": stream, **fields}
    async with server.http() as http:
        response = await http.post("/v1/chat/completions", json=body)
        assert (await http.get("/health")).status_code == 200
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert message in error["message"]


async def test_logit_bias_bans_and_forces_tokens(server, reference):
    prompt = reference.encode("hello world")
    greedy = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0.0,
              "ignore_eos": True, "return_token_ids": True}
    async with server.http() as http:
        plain = (await http.post("/v1/completions", json=greedy)).json()["choices"][0]["token_ids"]
        banned = (await http.post("/v1/completions", json={**greedy, "logit_bias": {str(plain[0]): -100}}))
        forced = await http.post("/v1/completions", json={**greedy, "temperature": 1.0, "logit_bias": {"77": 100}})
    assert plain[0] not in banned.json()["choices"][0]["token_ids"]
    assert forced.json()["choices"][0]["token_ids"] == [77] * 6


async def test_requests_with_one_schema_one_after_another_validate(server):
    """The second request with the same schema takes the cached grammar (and still validates)."""
    schema = SCHEMAS["enum"]
    fields = {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    async with server.http() as http:
        for seed in range(2):
            text, finish = await generate(http, "chat", SERVED_MODEL_NAME, "again", {**fields, "seed": seed}, False)
            assert finish == "stop"
            check("json", json.dumps(schema), text)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "days"],
    "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["tz"],
    "properties": {"tz": {"enum": ["UTC", "CET"]}}}}}
TOOLS = [WEATHER, TIME]


def calls_of(message_or_deltas, streamed: bool) -> list[tuple[str, dict]]:
    if not streamed:
        return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in message_or_deltas["tool_calls"]]
    calls: list[list[str]] = []          # as OpenAI streams them: the name (arguments "") first, then arguments
    for d in message_or_deltas:
        if d["index"] == len(calls):
            assert d["id"].startswith("chatcmpl-tool-") and d["type"] == "function", d
            assert d["function"]["arguments"] == "" and d["function"]["name"], d
            calls.append([d["function"]["name"], ""])
        else:
            assert d["index"] < len(calls) and set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
            calls[d["index"]][1] += d["function"]["arguments"]
    return [(name, json.loads(arguments)) for name, arguments in calls]


async def chat_tool_calls(http, model: str, fields: dict, stream: bool, seed: int,
                          logit_bias: dict[str, float]) -> list[tuple[str, dict]]:
    body = {"model": model, "messages": [{"role": "user", "content": f"call {seed}"}], "tools": TOOLS,
            "max_tokens": 300, "temperature": 1.0, "seed": seed, "stream": stream, "logit_bias": logit_bias,
            **fields}
    if not stream:
        response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and choice["message"]["content"] == ""
        return calls_of(choice["message"], False)
    deltas = []
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    deltas += choice["delta"].get("tool_calls") or []
    return calls_of(deltas, True)


@pytest.mark.parametrize("stream", [False, True])
async def test_named_and_required_tool_choice_always_give_valid_calls(server, stream, closing_json):
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    jobs = []
    for seed in range(6):
        model = MODELS[seed % len(MODELS)]
        named = {"tool_choice": {"type": "function", "function": {"name": ["get_weather", "get_time"][seed % 2]}}}
        jobs += [(named, model, seed), ({"tool_choice": "required", "parallel_tool_calls": seed % 2 == 0}, model, seed)]
    async with server.http() as http:
        results = await asyncio.gather(*(chat_tool_calls(http, model, fields, stream, seed, closing_json)
                                         for fields, model, seed in jobs))
    for (fields, _, _), calls in zip(jobs, results):
        assert calls, fields
        if fields["tool_choice"] != "required":
            assert [name for name, _ in calls] == [fields["tool_choice"]["function"]["name"]]
        elif not fields["parallel_tool_calls"]:
            assert len(calls) == 1
        for name, arguments in calls:
            jsonschema.validate(arguments, schemas[name])


async def test_auto_tool_choice_needs_the_parser_flags(server):
    body = {"model": SERVED_MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS}
    async with server.http() as http:
        response = await http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == ('"auto" tool choice requires --enable-auto-tool-choice and '
                                                   "--tool-call-parser to be set")


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_the_openai_sdk_reads_tool_calls_whole_and_streamed(server, tool_choice, closing_json):
    from openai.lib.streaming.chat import ChatCompletionStreamState

    kwargs = dict(model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                  tool_choice=tool_choice, max_tokens=200, seed=3, logit_bias=closing_json)
    message = server.openai.chat.completions.create(**kwargs).choices[0].message
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather" or tool_choice == "required"
    state, deltas = ChatCompletionStreamState(), []
    for chunk in server.openai.chat.completions.create(stream=True, **kwargs):
        state.handle_chunk(chunk)
        deltas += [c.model_dump(exclude_none=True) for choice in chunk.choices for c in choice.delta.tool_calls or []]
    streamed = state.get_final_completion().choices[0].message.tool_calls
    assert calls_of(deltas, True) == calls_of(message.model_dump(), False)                # same seed, same calls
    assert [(c.function.name, c.function.arguments) for c in streamed] \
        == [(c.function.name, c.function.arguments) for c in message.tool_calls]
