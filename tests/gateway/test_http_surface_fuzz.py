"""A generative test of the HTTP surface: every route, with bodies from valid ones with fields replaced by
any JSON value, arbitrary JSON, and raw bytes, under any content type and key. No answer is a 500, none
hangs, every error is in vLLM's envelope with one of its type names (a method a route does not take too), every stream
ends with [DONE], and /health answers 200 after each batch. The edge values include specs no output satisfies,
`best_of`, and messages past the context.

The stand-in worker encodes each request as the rings do (msgpack), so a value the real worker could not
be sent fails here too. Derandomized, with a fixed budget: one batch per POST route and one of GETs,
EXAMPLES_PER_BATCH generated cases each, plus RAW_EXAMPLES on every POST route and a /health: 423 in all.
Edge values and raw bodies include fan-out (prompts x n past MAX_CHOICES) and long token lists.
"""
import asyncio
import json
import re
import string
from urllib.parse import quote

import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fake_worker_client import FakeWorkerClient
from gateway.request_types import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, LoadLoRAAdapterRequest,
                                   TokenizeRequest, UnloadLoRAAdapterRequest)
from gateway_app import ADAPTER, ANSWER_IDS, BASE, serve
from worker.config import LoRAConfig

EXAMPLES_PER_BATCH = 50
CHAT = [{"role": "user", "content": "hello"}]
# route -> (a valid body, the fields worth replacing)
POST_ROUTES = {
    "/v1/completions": ({"model": BASE, "prompt": "hello", "max_tokens": 3}, CompletionRequest),
    "/v1/chat/completions": ({"model": ADAPTER, "messages": CHAT, "max_tokens": 3}, ChatCompletionRequest),
    "/tokenize": ({"model": BASE, "messages": CHAT}, TokenizeRequest),
    "/detokenize": ({"model": BASE, "tokens": [1, 2]}, DetokenizeRequest),
    "/v1/load_lora_adapter": ({"lora_name": "poet", "lora_path": "LORA_DIR/found"}, LoadLoRAAdapterRequest),
    "/v1/unload_lora_adapter": ({"lora_name": ADAPTER}, UnloadLoRAAdapterRequest),
}
GET_ROUTES = ["/v1/models", "/v1/models/{}", "/v1/adapters", "/v1/adapters/{}", "/health", "/version", "/metrics"]
# JSON nested past the gateway's bound, held in strings: alone (guided_json) and where a request holds JSON in a
# string (structured_outputs.json, a json_schema's schema, an assistant's tool-call arguments).
DEEP_JSON = ["[" * 1000 + "]" * 1000, '{"a": ' * 2000 + "1" + "}" * 2000]
DEEP_JSON_FIELDS = [*DEEP_JSON, {"json": DEEP_JSON[1]},
                    {"type": "json_schema", "json_schema": {"name": "x", "schema": DEEP_JSON[0]}},
                    [{"role": "assistant", "tool_calls": [{"id": "1", "type": "function",
                                                           "function": {"name": "f", "arguments": DEEP_JSON[0]}}]}]]
EDGE_VALUES = [*DEEP_JSON_FIELDS, -1, 2 ** 64, 10 ** 30, "__1e999__", 1e308, "", "\x00", "a" * 300, "found", [], {}, None, True,
               [[1, 2], []], [-5], {"type": "json_object"}, [{"role": "user", "content": [{"type": "image"}]}],
               {"include_usage": True}, 128, [[5, 6]] * 800, [300] * 20_000, ["ab"] * 3000,
               # specs no output satisfies (the worker refuses them; here they must reach it intact), best_of
               {"$ref": "#"}, '{"$ref": "#"}', "root ::= x\nx ::= y\ny ::= x", {"$ref": "https://example.com/s.json"},
               {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}, {"json": {"enum": []}},
               {"grammar": 'root ::= root "a"'}, 2, 0,
               # messages past the context (256 tokens): /tokenize counts them, generation refuses them
               [{"role": "user", "content": "hello " * 400}]]
CONTENT_TYPES = [None, "application/json", "application/json; charset=utf-8", "APPLICATION/JSON", "text/plain",
                 "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""]
AUTHORIZATION = [None, "Bearer secret", "Bearer wrong", "secret", "Bearer "]
# Known bad bodies, sent to every POST route on top of the generated cases.
RAW_EXAMPLES = [b"[" * 5000 + b"]" * 5000, b'{"prompt": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}",
                b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
                b'{"name": "f", "parameters": ' + b'{"a": ' * 900 + b"1" + b"}" * 900 + b"}}]}",   # decodable, too deep
                b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "guided_json": "'
                + b"[" * 2000 + b'"}',
                b'{"model": "base", "prompt": "\xff\xfe"}', b'{"prompt": [1, 1e999]}', b'{"top_k": 1e999}',
                b'{"lora_name": "x", "lora_path": "LORA_DIR/\\u0000", "model": "a\\u0000b", "tokens": [1]}',
                b'{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "top_k": 100000000000000000000000,'
                b' "chat_template_kwargs": {"add_generation_prompt": 1, "messages": 2}, "max_tokens": 2}',
                *(json.dumps(body).encode() for body in [       # fan-out and long lists, each once per request
                    {"model": "base", "prompt": [[5, 6]] * 800, "n": 128, "max_tokens": 1, "temperature": 1},
                    {"model": "base", "prompt": [[5, 6]] * 2048, "max_tokens": 1, "ignore_eos": True},
                    {"model": "base", "prompt": "hi", "messages": CHAT, "max_tokens": 10, "ignore_eos": True, "n": 16,
                     "temperature": 1, "allowed_token_ids": [300] * 100_000, "stop_token_ids": [7] * 50_000,
                     "min_tokens": 5},
                    {"model": "base", "prompt": [list(range(200))] * 40, "messages": CHAT, "max_tokens": 2,
                     "bad_words": ["ab", "c d"] * 2000, "stop": [f"zz{i}" for i in range(2000)],
                     "logit_bias": {str(t): 1 for t in range(320)}, "repetition_penalty": 1.2}])]
GOOD_HEADERS = {"Authorization": "Bearer secret", "Content-Type": "application/json"}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | st.sampled_from(EDGE_VALUES),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
header_text = st.text(alphabet=string.printable.strip("\r\n\x0b\x0c"), max_size=40)


@st.composite
def post_requests(draw, route: str) -> tuple[str, str, bytes, dict[str, str]]:
    base, struct = POST_ROUTES[route]
    fields = [*struct.__struct_fields__, "response_format", "stream", "stream_options", "tools"]
    kind = draw(st.sampled_from(["fields"] * 6 + ["json", "bytes"]))
    if kind == "fields":
        values = st.sampled_from(EDGE_VALUES) | json_values
        body = {**base, **draw(st.dictionaries(st.sampled_from(fields), values, min_size=1, max_size=3))}
        raw = json.dumps(body).encode().replace(b'"__1e999__"', b"1e999")     # a number msgspec cannot hold
    elif kind == "json":
        raw = json.dumps(draw(json_values)).encode()
    else:
        raw = draw(st.sampled_from([b"{", b'{"a": "\xff"}', b"[" * 3000, b"1e999", b"\x00"]) | st.binary(max_size=64))
    return draw(st.sampled_from(["POST"] * 8 + ["GET", "PUT", "DELETE"])), route, raw, draw(headers())


@st.composite
def get_requests(draw) -> tuple[str, str, bytes, dict[str, str]]:
    route = draw(st.sampled_from(GET_ROUTES))
    name = draw(st.sampled_from([BASE, ADAPTER, "found", "nope"]) | st.text(min_size=1, max_size=20))
    method = draw(st.sampled_from(["GET"] * 6 + ["POST", "PATCH", "OPTIONS"]))
    return method, route.format(quote(name, safe="")), b"", draw(headers())


@st.composite
def headers(draw) -> dict[str, str]:
    """Four times in five the gates pass (a JSON type or none, and the key); else anything."""
    if draw(st.integers(0, 4)):
        return {"Authorization": "Bearer secret", **draw(st.sampled_from([{}, {"Content-Type": "application/json"}]))}
    out = {}
    content_type = draw(st.sampled_from(CONTENT_TYPES) | header_text)
    authorization = draw(st.sampled_from(AUTHORIZATION))
    if content_type is not None:
        out["Content-Type"] = content_type
    if authorization is not None:
        out["Authorization"] = authorization
    return out


class WireClient(FakeWorkerClient):
    """The stand-in worker, sent each request as WorkerClient sends it: msgpack-encoded."""

    def generate(self, request, on_output=None):
        msgspec.msgpack.encode(request)
        return super().generate(request, on_output)


def check_answer(route: str, response) -> None:
    assert response.status_code < 500, (route, response.status_code, response.text[:500])
    if response.status_code == 401:
        assert response.json() == {"error": "Unauthorized"}
    elif response.status_code >= 400:
        error = response.json()["error"]
        assert sorted(error) == ["code", "message", "param", "type"] and error["code"] == response.status_code
        assert re.fullmatch(r"(?:[A-Z][a-z]+)+", error["type"]), error    # vLLM's names: NotFoundError, InvalidUserInput
        if response.status_code == 405:
            assert response.headers["allow"]
    elif response.headers.get("content-type", "").startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n"), response.text[-300:]
        for block in response.text.split("\n\n")[:-2]:
            event = json.loads(block.removeprefix("data: "))
            assert event.get("error", {}).get("code", 200) < 500, event


@pytest.mark.parametrize("batch", [*POST_ROUTES, "GET"])
def test_no_request_gets_a_500_or_hangs(tmp_path, batch):
    (tmp_path / "found").mkdir()
    (tmp_path / "found" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    loop = asyncio.new_event_loop()
    app = serve(WireClient(lambda request: list(ANSWER_IDS)), api_key="secret", lora=LoRAConfig(lora_dirs=(str(tmp_path),)),
                allow_runtime_lora_updating=True)
    http, client, _ = loop.run_until_complete(app.__aenter__())
    cases = []

    async def send(method: str, route: str, raw: bytes, request_headers: dict[str, str]) -> None:
        raw = raw.replace(b"LORA_DIR", str(tmp_path).encode())
        response = await http.request(method, route, content=raw or None, headers=request_headers)
        check_answer(route, response)

    @settings(max_examples=EXAMPLES_PER_BATCH, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(request=get_requests() if batch == "GET" else post_requests(batch))
    @example(request=("GET", "/health", b"", {}))
    def one_case(request):
        cases.append(request)
        loop.run_until_complete(asyncio.wait_for(send(*request), timeout=10))

    for raw in RAW_EXAMPLES if batch in POST_ROUTES else ():
        one_case = example(request=("POST", batch, raw, GOOD_HEADERS))(one_case)
    try:
        one_case()
        assert loop.run_until_complete(http.get("/health")).status_code == 200
        assert client.healthy
    finally:
        loop.run_until_complete(app.__aexit__(None, None, None))
        loop.close()
    assert len(cases) > EXAMPLES_PER_BATCH
    print(f"{batch}: {len(cases)} cases")
