"""Every user error of the issue answers its status and vLLM's envelope, and the server stays healthy."""
from __future__ import annotations

from dataclasses import dataclass

import httpx
import openai
import pytest

from worker.demo import SERVED_MODEL_NAME

MAX_MODEL_LEN = 2048          # the demo model's max_position_embeddings
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
TOO_LONG_FOR_OUTPUT = ("'max_tokens' or 'max_completion_tokens' is too large: 100. This model's maximum context "
                       "length is 2048 tokens and your request has 2000 input tokens (100 > 2048 - 2000).")
STREAM_OPTIONS = "Stream options can only be defined when `stream=True`."
DEEP_ARRAYS, DEEP_OBJECTS = "[" * 1000 + "]" * 1000, '{"a": ' * 2000 + "1" + "}" * 2000
DEEP_ARGUMENTS = [*HI, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "1", "type": "function", "function": {"name": "f", "arguments": DEEP_ARRAYS}}]}]


@dataclass(frozen=True)
class Case:
    path: str
    body: dict | bytes
    status: int
    param: str | None
    message: str                     # the whole message, or its start when it ends with "..."


def case(path, body, param, message, status=400):
    return pytest.param(Case(path, body, status, param, message))


CASES = {
    "malformed-json": case(COMPLETIONS, b'{"prompt": ', None, "JSON decode error: ..."),
    "empty-body": case(CHAT, b"", None, "JSON decode error: ..."),
    "array-body": case(COMPLETIONS, b"[1, 2]", None, "The request body must be a JSON object."),
    "string-body": case(CHAT, b'"hello"', None, "The request body must be a JSON object."),
    "null-body": case(COMPLETIONS, b"null", None, "The request body must be a JSON object."),
    "max-tokens-type": case(COMPLETIONS, {"prompt": "x", "max_tokens": "many"}, "max_tokens", "Expected `int..."),
    "temperature-type": case(COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature", "Expected `float..."),
    "n-not-integer": case(COMPLETIONS, {"prompt": "x", "n": 1.5}, "n", "Expected `int..."),
    "stop-type": case(COMPLETIONS, {"prompt": "x", "stop": 5}, "stop", "Expected `str..."),
    "prompt-object": case(COMPLETIONS, {"prompt": {"text": "x"}}, "prompt", "Expected `str..."),
    "prompt-mixed-list": case(COMPLETIONS, {"prompt": [1, "a"]}, "prompt", "prompt must be a string, ..."),
    "messages-missing": case(CHAT, {"model": SERVED_MODEL_NAME}, "messages",
                             "Object missing required field `messages`"),
    "messages-not-list": case(CHAT, {"messages": "hi"}, "messages", "Expected `array`, got `str`..."),
    "role-missing": case(CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role",
                         "Object missing required field `role`..."),
    "content-type": case(CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
                         "Expected `str..."),
    "tool-arguments-too-deep": case(CHAT, {"messages": DEEP_ARGUMENTS}, "messages",
                                    "Invalid JSON in the arguments of a tool call: nested more than 200 levels deep."),
    "guided-json-too-deep": case(COMPLETIONS, {"prompt": "x", "guided_json": DEEP_OBJECTS}, "structured_outputs",
                                 "Invalid JSON schema: nested more than 200 levels deep."),
    "structured-json-too-deep-stream": case(CHAT, {"messages": HI, "structured_outputs": {"json": DEEP_ARRAYS},
                                                   "stream": True}, "structured_outputs",
                                            "Invalid JSON schema: nested more than 200 levels deep."),
    "json-schema-string-too-deep": case(CHAT, {"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": DEEP_OBJECTS}}}, "structured_outputs",
        "Invalid JSON schema: nested more than 200 levels deep."),
    "body-too-deep": case(CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
                                b'"function": {"name": "f", "parameters": ' + b'{"a": ' * 900 + b"1" + b"}" * 900
                                + b"}}]}", None, "JSON decode error: the body is nested too deeply."),
    "completion-unknown-model": case(COMPLETIONS, {"model": "nope", "prompt": "x"}, "model",
                                     "The model `nope` does not exist.", 404),
    "completion-unknown-model-stream": case(COMPLETIONS, {"model": "nope", "prompt": "x", "stream": True}, "model",
                                            "The model `nope` does not exist.", 404),
    "chat-unknown-model-stream": case(CHAT, {"model": "loraplex-demo:nope", "messages": HI, "stream": True}, "model",
                                      "The model `loraplex-demo:nope` does not exist.", 404),
    "prompt-too-long": case(COMPLETIONS, {"prompt": [5] * MAX_MODEL_LEN}, None,
                            "This model's maximum context length is 2048 tokens. However, your request has 2048 "
                            "input tokens. Please reduce the length of the input messages."),
    "chat-prompt-too-long": case(CHAT, {"messages": [{"role": "user", "content": "the " * 2100}], "stream": True},
                                 None, "This model's maximum context length is 2048 tokens. However, your ..."),
    "prompt-plus-output-too-long": case(COMPLETIONS, {"prompt": [5] * 2000, "max_tokens": 100}, None,
                                        TOO_LONG_FOR_OUTPUT),
    "chat-prompt-plus-output-too-long": case(CHAT, {"messages": HI, "max_completion_tokens": 3000}, None,
                                             "'max_tokens' or 'max_completion_tokens' is too large: 3000. This "
                                             "model's maximum context length is 2048 tokens and your request ..."),
    "out-of-vocab": case(COMPLETIONS, {"prompt": [1, 2, 1536]}, "prompt", "Token id 1536 is out of vocabulary"),
    "negative-token-id": case(COMPLETIONS, {"prompt": [[3], [-1]]}, "prompt", "Token id -1 is out of vocabulary"),
    "empty-prompt": case(COMPLETIONS, {"prompt": ""}, "prompt",
                         "Either prompt or prompt_embeds must be provided and non-empty."),
    "empty-token-prompt": case(COMPLETIONS, {"prompt": [[]]}, "prompt", "The decoder prompt cannot be empty"),
    "logprobs-over-20": case(COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs",
                             "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    "top-logprobs-over-20": case(CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, "logprobs",
                                 "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    "max-tokens-zero": case(COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens",
                            "max_tokens must be at least 1, got 0."),
    "max-completion-tokens-negative": case(CHAT, {"messages": HI, "max_completion_tokens": -1},
                                           "max_completion_tokens", "max_tokens must be at least 1, got -1."),
    "stream-options-without-stream": case(COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}},
                                          "stream_options", STREAM_OPTIONS),
    "chat-stream-options-stream-false": case(CHAT, {"messages": HI, "stream": False,
                                                    "stream_options": {"include_usage": True}},
                                             "stream_options", STREAM_OPTIONS),
}


@pytest.mark.parametrize("error", CASES.values(), ids=CASES.keys())
async def test_user_error_answers_status_and_envelope_then_server_stays_healthy(server, error):
    async with server.http() as http:
        if isinstance(error.body, bytes):
            response = await http.post(error.path, content=error.body, headers={"Content-Type": "application/json"})
        else:
            response = await http.post(error.path, json=error.body)
    assert response.status_code == error.status
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    assert list(body) == ["error"] and sorted(body["error"]) == ["code", "message", "param", "type"]
    assert body["error"]["code"] == error.status
    assert body["error"]["type"] == {400: "BadRequestError", 404: "NotFoundError"}[error.status]
    assert body["error"]["param"] == error.param
    if error.message.endswith("..."):
        assert body["error"]["message"].startswith(error.message.removesuffix("...")), body["error"]["message"]
    else:
        assert body["error"]["message"] == error.message
    assert server.health_status() == 200


def test_sdk_raises_not_found_for_an_unknown_model(server):
    with pytest.raises(openai.NotFoundError) as raised:
        server.openai.chat.completions.create(model="nope", messages=HI, stream=True)
    assert raised.value.status_code == 404
    assert raised.value.body["message"] == "The model `nope` does not exist."
    assert server.health_status() == 200


def test_sdk_raises_bad_request_for_a_prompt_beyond_the_context(server):
    with pytest.raises(openai.BadRequestError) as raised:
        server.openai.completions.create(model=SERVED_MODEL_NAME, prompt=[5] * 2000, max_tokens=100)
    assert raised.value.body["message"] == TOO_LONG_FOR_OUTPUT
    assert server.health_status() == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "e2e-secret"}],
                         ids=["no-key", "wrong-key", "no-bearer"])
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", COMPLETIONS), ("POST", CHAT),
                                          ("POST", "/v1/load_lora_adapter")])
def test_v1_paths_need_the_api_key(server, headers, method, path):
    response = httpx.request(method, f"{server.url}{path}", headers=headers, json={"prompt": "x", "messages": HI})
    assert (response.status_code, response.json()) == (401, {"error": "Unauthorized"})


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_paths_outside_v1_need_no_key(server, path):
    assert httpx.get(f"{server.url}{path}").status_code == 200


def test_sdk_with_a_wrong_key_raises_authentication_error(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
