"""vLLM's constraint and token fields, as the gateway hands them to the worker, and their 400s."""
from __future__ import annotations

import json

import pytest
from test_routes import BASE, TOKENIZER, chat_body, completion_body, events, serve

from worker.ipc.messages import StructuredOutput

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_JSON = json.dumps(SCHEMA, separators=(",", ":"))


@pytest.mark.parametrize("fields, expected", [
    (dict(response_format={"type": "text"}), None),
    (dict(response_format={"type": "json_object"}), StructuredOutput("json_object", "")),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}),
     StructuredOutput("json", SCHEMA_JSON)),
    (dict(structured_outputs={"json": SCHEMA}), StructuredOutput("json", SCHEMA_JSON)),
    (dict(structured_outputs={"json": json.dumps(SCHEMA)}), StructuredOutput("json", SCHEMA_JSON)),
    (dict(structured_outputs={"json": SCHEMA, "disable_any_whitespace": True}),
     StructuredOutput("json", SCHEMA_JSON, any_whitespace=False)),
    (dict(structured_outputs={"regex": "[a-z]+"}), StructuredOutput("regex", "[a-z]+")),
    (dict(structured_outputs={"choice": ["yes", "no"]}), StructuredOutput("choice", '["yes","no"]')),
    (dict(structured_outputs={"grammar": 'root ::= "a"'}), StructuredOutput("grammar", 'root ::= "a"')),
    (dict(structured_outputs={"json_object": True}), StructuredOutput("json_object", "")),
    (dict(guided_json=SCHEMA), StructuredOutput("json", SCHEMA_JSON)),
    (dict(guided_regex="[0-9]"), StructuredOutput("regex", "[0-9]")),
    (dict(guided_choice=["a", "b"]), StructuredOutput("choice", '["a","b"]')),
    (dict(guided_grammar='root ::= "b"'), StructuredOutput("grammar", 'root ::= "b"')),
])
@pytest.mark.parametrize("route", ["chat", "completion"])
async def test_each_spelling_reaches_the_worker_as_one_constraint(fields, expected, route):
    path, body = (("/v1/chat/completions", chat_body(**fields)) if route == "chat"
                  else ("/v1/completions", completion_body(**fields)))
    async with serve() as (http, client):
        response = await http.post(path, json={**body, "n": 2})
    assert response.status_code == 200, response.text
    assert [r.params.structured for r in client.requests] == [expected, expected]


async def test_token_fields_reach_the_worker_converted():
    bad = ["hello", " world"]
    async with serve() as (http, client):
        response = await http.post("/v1/completions", json=completion_body(
            logit_bias={"5": 250, "7": -1.5, "9": -300}, allowed_token_ids=[5, 7, 9], bad_words=bad))
    assert response.status_code == 200, response.text
    params = client.requests[0].params
    assert params.logit_bias == {5: 100.0, 7: -1.5, 9: -100.0}
    assert params.allowed_token_ids == [5, 7, 9]
    assert params.bad_words_token_ids == TOKENIZER.bad_words_token_ids(bad)
    assert [TOKENIZER.encode("hello", add_special_tokens=False)] == params.bad_words_token_ids[:1]


BAD = [
    (dict(structured_outputs={"json": SCHEMA, "regex": "a"}), "structured_outputs",
     "You can only use one kind of structured outputs constraint but multiple are specified: json, regex."),
    (dict(guided_regex="a", guided_choice=["b"]), "structured_outputs",
     "You can only use one kind of structured outputs constraint"),
    (dict(structured_outputs={"json": "{not json"}), "structured_outputs", "Invalid JSON schema: "),
    (dict(structured_outputs={"json": 5}), "structured_outputs",
     "Invalid JSON schema: a schema must be a JSON object."),
    (dict(structured_outputs={"choice": []}), "structured_outputs", "`choice` must be a non-empty list of strings."),
    (dict(structured_outputs={"regex": ""}), "structured_outputs", "`regex` must be a non-empty string."),
    (dict(structured_outputs={"structural_tag": "x"}), "structured_outputs",
     "Structured outputs of kind `structural_tag` are not supported by this server."),
    (dict(response_format={"type": "json_schema"}), "response_format",
     "`response_format` of type 'json_schema' needs `json_schema.schema`."),
    (dict(response_format={"type": "xml"}), "response_format", "`response_format.type` must be one of"),
    (dict(logit_bias={"x": 1}), "logit_bias", "Found token_id `x` in logit_bias"),
    (dict(logit_bias={"1": "high"}), "logit_bias", "logit_bias values must be numbers"),
    (dict(allowed_token_ids=[2 ** 70]), "allowed_token_ids", "allowed_token_ids contains out-of-vocab token id!"),
]


@pytest.mark.parametrize("fields, param, message", BAD)
@pytest.mark.parametrize("stream", [False, True])
async def test_malformed_constraints_are_400_before_the_worker(fields, param, message, stream):
    async with serve() as (http, client):
        response = await http.post("/v1/chat/completions", json=chat_body(stream=stream, **fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)
    assert error["message"].startswith(message)
    assert client.requests == []


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
async def test_a_spec_the_worker_refuses_is_a_400_also_when_streamed(route):
    body = (chat_body if "chat" in route else completion_body)(stream=True, structured_outputs={"grammar": "x ::="})
    async with serve() as (http, client):
        client.error, client.error_status = "Invalid grammar: EBNF parser error at line 1", 400
        response = await http.post(route, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == "Invalid grammar: EBNF parser error at line 1"


async def test_a_constrained_stream_streams_as_usual():
    async with serve() as (http, client):
        response = await http.post("/v1/chat/completions", json=chat_body(
            stream=True, model=BASE, response_format={"type": "json_object"}))
    chunks = events(response)
    assert chunks[-1] == "[DONE]"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1]) == "hello world, hello there"
