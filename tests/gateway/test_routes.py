"""The HTTP surface in process: FakeWorkerClient stands in for the worker, the app runs its lifespan."""
import asyncio
import json
import subprocess
import sys
from contextlib import asynccontextmanager
from http import HTTPStatus

import httpx
import pytest

from fake_worker_client import IM_END, FakeWorkerClient, build_tokenizer
from gateway.app import build_app
from gateway.config import GatewayConfig, LoRAModulePath
from worker.config import LoRAConfig, ModelConfig, WorkerConfig
from worker.ipc.messages import AdapterCommandResult

TOKENIZER = build_tokenizer()
ANSWER = "hello world, hello there"
ANSWER_IDS = TOKENIZER.encode(ANSWER)
BASE, ADAPTER, MODEL_DIR, ADAPTER_DIR = "base", "sql", "/models/base", "/adapters/sql"


def answer(request):
    return list(ANSWER_IDS)


@asynccontextmanager
async def serve(script=answer, *, api_key=None, lora_dirs=(), runtime_loading=False, **client_args):
    client = FakeWorkerClient(script, **client_args)
    worker = WorkerConfig(ModelConfig(MODEL_DIR), lora=LoRAConfig(lora_dirs=lora_dirs))
    config = GatewayConfig(worker, served_model_names=(BASE,), api_key=api_key,
                           lora_modules=(LoRAModulePath(ADAPTER, ADAPTER_DIR),),
                           allow_runtime_lora_updating=runtime_loading)
    app = build_app(config, client, TOKENIZER)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            yield http, client


def events(response: httpx.Response) -> list:
    """The SSE events of a response: parsed JSON, or the string "[DONE]"."""
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.text.endswith("data: [DONE]\n\n")
    out = []
    for block in response.text.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        data = block.removeprefix("data: ")
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def chat_body(**fields):
    return {"model": BASE, "messages": [{"role": "user", "content": "hello"}], **fields}


def completion_body(**fields):
    return {"model": BASE, "prompt": "hello", **fields}


async def test_completion_returns_the_worker_text_with_usage():
    async with serve() as (http, client):
        response = await http.post("/v1/completions", json=completion_body(max_tokens=50))
    assert response.status_code == 200
    body = response.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == BASE
    assert [(c["index"], c["text"], c["finish_reason"], c["stop_reason"]) for c in body["choices"]] == \
        [(0, ANSWER, "length", None)]
    assert body["usage"] == {"prompt_tokens": 1, "completion_tokens": len(ANSWER_IDS),
                             "total_tokens": 1 + len(ANSWER_IDS), "prompt_tokens_details": None}
    request = client.requests[0]
    assert (request.prompt_token_ids, request.lora_name, request.params.max_tokens) == \
        (TOKENIZER.encode("hello"), None, 50)


async def test_chat_applies_the_template_and_answers_as_assistant():
    async with serve() as (http, client):
        response = await http.post("/v1/chat/completions", json=chat_body())
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    prompt = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert client.requests[0].prompt_token_ids == TOKENIZER.encode(prompt, add_special_tokens=False)
    # no max_tokens: the rest of the context
    assert client.requests[0].params.max_tokens == 256 - len(client.requests[0].prompt_token_ids)


@pytest.mark.parametrize("route, body", [("/v1/completions", completion_body), ("/v1/chat/completions", chat_body)])
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("stop", [None, ["lo th"], ["zzz"]])
async def test_streamed_text_equals_non_streamed_text(route, body, chunk, stop):
    script = lambda request: TOKENIZER.encode("une fenêtre 😀 日本語 hello there")  # noqa: E731
    async with serve(script, chunk=chunk) as (http, client):
        whole = (await http.post(route, json=body(stop=stop, max_tokens=40))).json()
        streamed = events(await http.post(route, json=body(stop=stop, max_tokens=40, stream=True)))
    if route == "/v1/completions":
        whole_text, pieces = whole["choices"][0]["text"], [e["choices"][0]["text"] for e in streamed[:-1]]
    else:
        whole_text = whole["choices"][0]["message"]["content"]
        pieces = [e["choices"][0]["delta"]["content"] for e in streamed[:-1]]
    assert "".join(pieces) == whole_text
    assert all("\ufffd" not in piece for piece in pieces)
    expected_finish = streamed[-2]["choices"][0]["finish_reason"]
    assert expected_finish == whole["choices"][0]["finish_reason"] == ("stop" if stop == ["lo th"] else "length")
    full = "une fenêtre 😀 日本語 hello there"
    assert whole_text == (full[:full.index("lo th")] if stop == ["lo th"] else full)


async def test_stop_string_aborts_the_worker_request():
    async with serve() as (http, client):
        body = (await http.post("/v1/completions", json=completion_body(stop="world", max_tokens=50))).json()
    assert (body["choices"][0]["text"], body["choices"][0]["finish_reason"], body["choices"][0]["stop_reason"]) == \
        ("hello ", "stop", "world")
    assert client.aborted == [client.requests[0].request_id]


@pytest.mark.parametrize("model, lora_name", [(BASE, None), (ADAPTER, ADAPTER), (f"{BASE}:{ADAPTER}", ADAPTER),
                                              (None, None)])
@pytest.mark.parametrize("stream", [False, True])
async def test_model_field_picks_the_adapter_and_is_echoed(model, lora_name, stream):
    async with serve() as (http, client):
        response = await http.post("/v1/completions", json={"model": model, "prompt": "hello", "stream": stream})
    first = events(response)[0] if stream else response.json()
    assert first["model"] == (model or BASE)
    assert client.requests[0].lora_name == lora_name


@pytest.mark.parametrize("route, body", [("/v1/completions", completion_body), ("/v1/chat/completions", chat_body)])
@pytest.mark.parametrize("stream", [False, True])
async def test_unknown_model_is_404_before_anything_is_queued(route, body, stream):
    async with serve() as (http, client):
        response = await http.post(route, json=body(model="nope", stream=stream))
    assert response.status_code == 404
    assert response.json() == {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError",
                                         "param": "model", "code": 404}}
    assert client.requests == []


BAD_COMPLETIONS = [
    (b"{not json", None, "JSON decode error"),
    (b"[1, 2]", None, "The request body must be a JSON object."),
    (b'"hello"', None, "The request body must be a JSON object."),
    (completion_body(max_tokens="many"), "max_tokens", "Expected `int | null`, got `str`"),
    (completion_body(stream_options={"include_usage": True}), "stream_options",
     "Stream options can only be defined when `stream=True`."),
    (completion_body(logprobs=21), "logprobs",
     "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    (completion_body(logprobs=-1), "logprobs", "`logprobs` must be a positive value."),
    (completion_body(prompt=""), "prompt", "Either prompt or prompt_embeds must be provided and non-empty."),
    (completion_body(prompt=[]), "prompt", "Either prompt or prompt_embeds must be provided and non-empty."),
    (completion_body(max_tokens=0), "max_tokens", "max_tokens must be at least 1, got 0."),
    (completion_body(prompt=[5, 320]), "prompt", "Token id 320 is out of vocabulary"),
    (completion_body(prompt=[-1]), "prompt", "Token id -1 is out of vocabulary"),
    (completion_body(prompt=[7] * 256), None,
     "This model's maximum context length is 256 tokens. However, your request has 256 input tokens. "
     "Please reduce the length of the input messages."),
    (completion_body(prompt=[7] * 200, max_tokens=100), None,
     "'max_tokens' or 'max_completion_tokens' is too large: 100. This model's maximum context length is 256 "
     "tokens and your request has 200 input tokens (100 > 256 - 200)."),
    (completion_body(n=2, temperature=0), "n", "n must be 1 when using greedy sampling, got 2."),
    (completion_body(temperature=-1), "temperature", "temperature must be non-negative, got -1.0."),
    (completion_body(top_p=0), "top_p", "top_p must be in (0, 1], got 0.0."),
    (completion_body(stop=["", "x"]), "stop", "stop cannot contain an empty string."),
    (completion_body(min_tokens=5, max_tokens=2), None, "min_tokens must be less than or equal to max_tokens=2"),
    (completion_body(logit_bias={"a": 1.0}), "logit_bias",
     "Found token_id `a` in logit_bias but token_id must be an integer or string representing an integer"),
    (completion_body(prompt=[1, "a"]), "prompt", "prompt must be a string"),
]


@pytest.mark.parametrize("raw, param, message", BAD_COMPLETIONS)
@pytest.mark.parametrize("stream", [False, True])
async def test_bad_completion_requests_are_400_with_the_envelope(raw, param, message, stream):
    if isinstance(raw, dict) and stream and "stream_options" not in raw:
        raw = {**raw, "stream": True}
    content = raw if isinstance(raw, bytes) else json.dumps(raw).encode()
    async with serve() as (http, client):
        response = await http.post("/v1/completions", content=content)
        assert (await http.get("/health")).status_code == 200
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)
    assert error["message"].startswith(message)
    assert client.requests == []


BAD_CHATS = [
    ({"model": BASE}, "messages", "Object missing required field `messages`"),
    (chat_body(messages=[{"content": "x"}]), "messages[0].role", "Object missing required field `role`"),
    (chat_body(logprobs=True, top_logprobs=21), "logprobs",
     "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    (chat_body(top_logprobs=2), "top_logprobs", "when using `top_logprobs`, `logprobs` must be set to true."),
    (chat_body(max_completion_tokens=0), "max_completion_tokens", "max_tokens must be at least 1, got 0."),
    (chat_body(max_tokens=250), None, "'max_tokens' or 'max_completion_tokens' is too large: 250."),
    (chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages", "Unsupported content part type: 'image_url'"),
    (chat_body(stream_options={"include_usage": True}), "stream_options",
     "Stream options can only be defined when `stream=True`."),
    (chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), "tool_choice",
     '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'),
    (chat_body(tool_choice="sometimes"), "tool_choice", "When using `tool_choice`, `tools` must be set."),
    (chat_body(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice",
     "When using `tool_choice`, `tools` must be set."),
    (chat_body(response_format="json"), "response_format", "Expected `object | null`, got `str`"),
    (chat_body(response_format={"type": "structural_tag"}), "response_format",
     "`response_format` of type 'structural_tag' is not supported by this server."),
    (chat_body(truncate_prompt_tokens=4), "truncate_prompt_tokens",
     "`truncate_prompt_tokens` is not supported by this server."),
]


@pytest.mark.parametrize("raw, param, message", BAD_CHATS)
async def test_bad_chat_requests_are_400_with_the_envelope(raw, param, message):
    async with serve() as (http, client):
        response = await http.post("/v1/chat/completions", json=raw)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("BadRequestError", param, 400)
    assert error["message"].startswith(message)
    assert client.requests == []


async def test_chat_content_parts_join_as_text():
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    async with serve() as (http, client):
        await http.post("/v1/chat/completions", json=chat_body(messages=[{"role": "user", "content": parts}]))
    prompt = "<|im_start|>user\nhel\nlo<|im_end|>\n<|im_start|>assistant\n"
    assert client.requests[0].prompt_token_ids == TOKENIZER.encode(prompt, add_special_tokens=False)


async def test_completion_fans_out_prompts_and_samples():
    prompts = ["hello", "hello world"]
    async with serve() as (http, client):
        body = (await http.post("/v1/completions", json=completion_body(prompt=prompts, n=2, seed=7))).json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert [r.prompt_token_ids for r in client.requests] == [TOKENIZER.encode(p) for p in prompts for _ in range(2)]
    assert [r.params.seed for r in client.requests] == [7, 8, 7, 8]
    assert body["usage"]["prompt_tokens"] == sum(len(TOKENIZER.encode(p)) for p in prompts)
    assert body["usage"]["completion_tokens"] == 4 * len(ANSWER_IDS)


async def test_token_id_prompts_and_echo():
    async with serve() as (http, client):
        body = (await http.post("/v1/completions", json=completion_body(prompt=[[272], [272, 270]], echo=True,
                                                                         max_tokens=1))).json()
    assert [c["text"] for c in body["choices"]] == ["hellohello", "hello worhello"]


async def test_completion_logprobs_have_the_completions_format():
    async with serve() as (http, client):
        body = (await http.post("/v1/completions", json=completion_body(max_tokens=2, logprobs=2))).json()
    first, second = ANSWER_IDS[:2]
    text = TOKENIZER.token_text
    assert body["choices"][0]["logprobs"] == {
        "tokens": [text(first), text(second)],
        "token_logprobs": [-0.25, -0.5],
        "top_logprobs": [{text(first): -0.25, text(first + 1): -1.25},
                         {text(second): -0.5, text(second + 1): -1.5}],
        "text_offset": [0, len(text(first))],
    }


async def test_echo_logprobs_start_with_the_prompt():
    async with serve() as (http, client):
        body = (await http.post("/v1/completions", json=completion_body(prompt=[272, 270], max_tokens=1,
                                                                         logprobs=0, echo=True))).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["hello", " wor", TOKENIZER.token_text(ANSWER_IDS[0])]
    assert logprobs["token_logprobs"] == [None, -1.0, -0.25]
    assert logprobs["text_offset"] == [0, 5, 9]


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs_have_the_chat_format(stream):
    async with serve() as (http, client):
        response = await http.post("/v1/chat/completions", json=chat_body(max_tokens=1, logprobs=True,
                                                                           top_logprobs=2, stream=stream))
    logprobs = events(response)[1]["choices"][0]["logprobs"] if stream else response.json()["choices"][0]["logprobs"]
    token = ANSWER_IDS[0]

    def item(t, lp):
        return {"token": TOKENIZER.token_text(t), "logprob": lp, "bytes": list(TOKENIZER.token_text(t).encode())}
    top = [item(token, -0.25), item(token + 1, -1.25)]
    assert logprobs == {"content": [{**item(token, -0.25), "top_logprobs": top}]}


async def test_chat_stream_sends_the_role_first_then_content_then_usage():
    async with serve() as (http, client):
        response = await http.post("/v1/chat/completions", json=chat_body(
            max_tokens=3, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    chunks = events(response)
    assert chunks[-1] == "[DONE]"
    first, *middle, usage = chunks[:-1]
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}]
    assert all("role" not in c["choices"][0]["delta"] for c in middle)
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == TOKENIZER.decode(ANSWER_IDS[:3])
    assert middle[-1]["choices"][0]["finish_reason"] == "length"
    num_prompt = len(client.requests[0].prompt_token_ids)
    assert [c["usage"]["completion_tokens"] for c in [first, *middle]] == [0, 1, 2, 3]
    assert usage["choices"] == [] and usage["usage"]["prompt_tokens"] == num_prompt
    assert usage["usage"]["completion_tokens"] == 3
    assert {c["object"] for c in chunks[:-1]} == {"chat.completion.chunk"}


async def test_completion_stream_without_usage_has_no_usage_chunk():
    async with serve() as (http, client):
        chunks = events(await http.post("/v1/completions", json=completion_body(max_tokens=3, stream=True)))
    assert all(c["choices"] for c in chunks[:-1])
    assert all(c["usage"] is None for c in chunks[:-1])


@pytest.mark.parametrize("stream", [False, True])
async def test_worker_failure_ends_the_request_with_an_error(stream):
    failure = "The worker process died (exit code -9)."
    async with serve() as (http, client):
        client.error = failure
        response = await http.post("/v1/completions", json=completion_body(stream=stream))
    expected = {"error": {"message": failure, "type": "InternalServerError", "param": None, "code": 500}}
    if stream:
        assert events(response)[-2:] == [expected, "[DONE]"]
    else:
        assert (response.status_code, response.json()) == (500, expected)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_worker_error_keeps_the_status_the_worker_gave_it(stream):
    """A request the worker refuses (here: too long for the whole KV pool) is the client's fault: 400, not 500."""
    failure = "The request needs more KV-cache blocks than the pool has (8 blocks of 16 tokens)."
    async with serve() as (http, client):
        client.error, client.error_status = failure, 400
        response = await http.post("/v1/completions", json=completion_body(stream=stream))
    expected = {"error": {"message": failure, "type": "BadRequestError", "param": None, "code": 400}}
    if stream:
        assert events(response)[-2:] == [expected, "[DONE]"]
    else:
        assert (response.status_code, response.json()) == (400, expected)


async def test_client_disconnect_aborts_the_worker_request():
    client = FakeWorkerClient(lambda request: [272] * 5000, delay=0.001, max_model_len=8000)
    app = build_app(GatewayConfig(WorkerConfig(ModelConfig(MODEL_DIR)), served_model_names=(BASE,)), client, TOKENIZER)
    body = json.dumps(completion_body(max_tokens=5000, stream=True)).encode()
    received, disconnected, chunks = [], asyncio.Event(), []

    async def receive():
        if not received:
            received.append(True)
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            if len(chunks) == 3:
                disconnected.set()

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("c", 1),
             "server": ("s", 80), "state": {}}
    async with app.router.lifespan_context(app):
        await asyncio.wait_for(app(scope, receive, send), 10)
        metrics = app.state.server.metrics.render(client.stats)
    assert client.aborted == [client.requests[0].request_id]
    assert 'vllm:request_success_total{engine="0",finished_reason="abort",model_name="base"} 1.0' in metrics


async def test_models_list_the_base_and_adapters_with_lineage():
    async with serve() as (http, client):
        listed = (await http.get("/v1/models")).json()
        one = (await http.get(f"/v1/models/{ADAPTER}")).json()
        missing = await http.get("/v1/models/nope")
    assert listed["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"], m["root"], m["parent"], m["max_model_len"])
            for m in listed["data"]] == [(BASE, "model", "vllm", MODEL_DIR, None, 256),
                                         (ADAPTER, "model", "vllm", ADAPTER_DIR, BASE, None)]
    assert one["id"] == ADAPTER and one["permission"][0]["object"] == "model_permission"
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "The model `nope` does not exist."


async def test_startup_loads_the_lora_modules():
    async with serve() as (http, client):
        assert client.adapter_commands == [("load", ADAPTER, ADAPTER_DIR, False, False)]


async def test_startup_failure_raises_the_worker_message():
    client = FakeWorkerClient(answer, startup_error="CUDA out of memory while loading weights")
    app = build_app(GatewayConfig(WorkerConfig(ModelConfig(MODEL_DIR))), client, TOKENIZER)
    with pytest.raises(RuntimeError, match="CUDA out of memory while loading weights"):
        async with app.router.lifespan_context(app):
            pass


async def test_load_and_unload_adapter_pass_through_the_worker():
    async with serve(runtime_loading=True) as (http, client):
        loaded = await http.post("/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": "/adapters/poet"})
        again = await http.post("/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": "/adapters/poet"})
        inplace = await http.post("/v1/load_lora_adapter", json={"lora_name": "poet", "lora_path": "/adapters/p2",
                                                                  "load_inplace": True})
        ids = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
        await http.post("/v1/completions", json=completion_body(model="poet"))
        unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "poet"})
        gone = await http.post("/v1/completions", json=completion_body(model="poet"))
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'poet' added successfully.")
    assert again.status_code == 400 and again.json()["error"]["message"] == (
        "The lora adapter 'poet' has already been loaded. If you want to load the adapter in place, set "
        "'load_inplace' to True.")
    assert inplace.status_code == 200
    assert ids == [BASE, ADAPTER, "poet"]
    assert client.requests[0].lora_name == "poet"
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'poet' removed successfully.")
    assert gone.status_code == 404
    assert client.adapter_commands[1:] == [("load", "poet", "/adapters/poet", False, False),
                                           ("load", "poet", "/adapters/p2", True, False),
                                           ("unload", "poet", None, False, False)]


@pytest.mark.parametrize("route, body, status, message", [
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path' must be provided."),
    ("/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/adapters/bad"}, 404,
     "Loading adapter 'bad' failed: no adapter_config.json"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc/x"}, 400,
     "The lora adapter path '/etc/x' is outside the directories allowed by --lora-dir."),
    ("/v1/unload_lora_adapter", {}, 400, "'lora_name' needs to be provided to unload a LoRA adapter."),
    ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "The lora adapter 'nope' cannot be found."),
])
async def test_adapter_route_errors(route, body, status, message):
    async with serve(lora_dirs=("/adapters",), runtime_loading=True) as (http, client):
        client.adapter_results["bad"] = AdapterCommandResult(
            0, ok=False, status_code=404, message="Loading adapter 'bad' failed: no adapter_config.json")
        response = await http.post(route, json=body)
    assert response.status_code == status
    assert response.json()["error"]["message"] == message and response.json()["error"]["code"] == status


@pytest.mark.parametrize("headers, status", [({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                                             ({"Authorization": "Basic secret"}, 401),
                                             ({"Authorization": "Bearer secret"}, 200)])
async def test_api_key_guards_v1_routes(headers, status):
    async with serve(api_key="secret") as (http, client):
        response = await http.get("/v1/models", headers=headers)
        health = await http.get("/health")
    assert response.status_code == status
    if status == 401:
        assert response.json() == {"error": "Unauthorized"}
    assert health.status_code == 200


async def test_health_turns_503_when_the_worker_is_gone():
    async with serve() as (http, client):
        alive = await http.get("/health")
        client.healthy = False
        dead = await http.get("/health")
        version = await http.get("/version")
    assert (alive.status_code, alive.content) == (200, b"")
    assert dead.status_code == 503
    assert "version" in version.json()


async def test_tokenize_and_detokenize():
    async with serve() as (http, client):
        tokens = (await http.post("/tokenize", json={"model": BASE, "prompt": "hello world",
                                                     "return_token_strs": True})).json()
        chat = (await http.post("/tokenize", json={"messages": [{"role": "user", "content": "hello"}]})).json()
        text = (await http.post("/detokenize", json={"tokens": TOKENIZER.encode("hello world")})).json()
        bad = await http.post("/detokenize", json={"tokens": [999]})
    ids = TOKENIZER.encode("hello world")
    assert tokens == {"count": len(ids), "max_model_len": 256, "tokens": ids,
                      "token_strs": [TOKENIZER.backend.id_to_token(t) for t in ids]}
    assert chat["tokens"] == TOKENIZER.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
                                              add_special_tokens=False)
    assert text == {"prompt": "hello world"}
    assert bad.status_code == 400


async def test_tokenize_counts_messages_longer_than_the_context():
    """As vLLM's /tokenize: a count, not a refusal, for messages as for a prompt (the context is 256 here)."""
    long = "hello " * 400
    async with serve() as (http, client):
        chat = await http.post("/tokenize", json={"messages": [{"role": "user", "content": long}],
                                                  "add_generation_prompt": False})
        prompt = await http.post("/tokenize", json={"prompt": long})
        generate = await http.post("/v1/chat/completions", json=chat_body(messages=[{"role": "user",
                                                                                     "content": long}]))
    expected = TOKENIZER.encode(f"<|im_start|>user\n{long}<|im_end|>\n", add_special_tokens=False)
    assert chat.status_code == 200 and chat.json()["tokens"] == expected and chat.json()["count"] > 256
    assert prompt.status_code == 200 and prompt.json()["count"] == len(TOKENIZER.encode(long))
    assert generate.status_code == 400                     # generating from it is still refused


@pytest.mark.parametrize("fields, message", [
    ({"best_of": 2}, "vLLM V1 does not yet support best_of."),
    ({"best_of": 0}, "best_of must be at least 1, got 0"),
    ({"best_of": 1, "n": 2, "temperature": 1.0}, "best_of must be greater than or equal to n, got n=2 and best_of=1."),
    ({"best_of": 3, "n": 3, "temperature": 1.0}, "vLLM V1 does not yet support best_of."),
])
@pytest.mark.parametrize("route, body", [("/v1/completions", completion_body), ("/v1/chat/completions", chat_body)])
async def test_best_of_above_one_is_refused_as_vllm_v1_refuses_it(route, body, fields, message):
    async with serve() as (http, client):
        response = await http.post(route, json=body(**fields))
    assert response.status_code == 400
    assert response.json()["error"] == {"message": message, "type": "BadRequestError", "param": "best_of",
                                        "code": 400}
    assert client.requests == []


@pytest.mark.parametrize("best_of", [None, 1])
@pytest.mark.parametrize("route, body", [("/v1/completions", completion_body), ("/v1/chat/completions", chat_body)])
async def test_best_of_one_or_unset_is_served(route, body, best_of):
    async with serve() as (http, client):
        response = await http.post(route, json=body(best_of=best_of, max_tokens=2))
    assert response.status_code == 200


@pytest.mark.parametrize("method, route, status, type_", [
    ("GET", "/v1/completions", 405, "MethodNotAllowedError"),
    ("DELETE", "/v1/chat/completions", 405, "MethodNotAllowedError"),
    ("POST", "/health", 405, "MethodNotAllowedError"),
    ("PUT", "/tokenize", 405, "MethodNotAllowedError"),
    ("GET", "/v1/nothing", 404, "NotFoundError"),
    ("POST", "/v2/completions", 404, "NotFoundError"),
])
async def test_starlette_errors_answer_in_vllms_envelope(method, route, status, type_):
    async with serve() as (http, client):
        response = await http.request(method, route)
    assert response.status_code == status
    assert response.json() == {"error": {"message": HTTPStatus(status).phrase, "type": type_, "param": None,
                                         "code": status}}
    if status == 405:
        assert response.headers["allow"]


async def test_eos_token_ends_the_choice_without_text():
    eos = TOKENIZER.backend.token_to_id(IM_END)
    async with serve(lambda request: TOKENIZER.encode("hello") + [eos, 272], eos_token_ids=(eos,)) as (http, client):
        body = (await http.post("/v1/chat/completions", json=chat_body())).json()
    assert body["choices"][0]["message"]["content"] == "hello"
    assert (body["choices"][0]["finish_reason"], body["choices"][0]["stop_reason"]) == ("stop", None)
    assert body["usage"]["completion_tokens"] == 2


async def test_unknown_route_uses_the_error_envelope():
    async with serve() as (http, client):
        response = await http.get("/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == 404


@pytest.mark.parametrize("module", ["gateway.app", "gateway.__main__", "gateway.worker_client"])
def test_gateway_never_imports_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
