"""POST /v1/completions/render and /v1/chat/completions/render: the token ids a request would run with, in vLLM's
GenerateRequest shape, and nothing sent to the worker."""
import pytest

from gateway_app import ADAPTER, BASE, TOKENIZER, error_of, serve

# vLLM 0.33.0's GenerateRequest fields in order (vllm/entrypoints/scale_out/token_in_token_out/protocol.py)
GENERATE_REQUEST_FIELDS = ["request_id", "token_ids", "token_offsets", "features", "content_parts", "sampling_params",
                           "model", "reasoning_ended", "reasoning_parser_kwargs", "return_token_ids", "output_mode",
                           "parse_context", "stream", "stream_options", "cache_salt", "priority",
                           "kv_transfer_params", "ec_transfer_params"]
CHAT = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]}


@pytest.mark.parametrize("model", [BASE, ADAPTER])
@pytest.mark.parametrize("body", [{"prompt": "the quick brown fox"}, {"prompt": [5, 6, 7, 300]},
                                  {"prompt": ["hello there", "STOP and go"], "n": 2, "max_tokens": 3},
                                  {"prompt": "hello", "add_special_tokens": False, "stream": True}])
async def test_completion_render_gives_the_prompt_ids_the_request_runs_with(model, body):
    async with serve() as (http, client, _):
        rendered = await http.post("/v1/completions/render", json={"model": model, **body})
        assert client.requests == []
        await http.post("/v1/completions", json={"model": model, **body})
    assert rendered.status_code == 200
    answers = rendered.json()
    run_with = [r.prompt_token_ids for r in client.requests][::body.get("n", 1)]   # one per prompt
    assert [a["token_ids"] for a in answers] == run_with
    assert all(list(a) == GENERATE_REQUEST_FIELDS for a in answers)
    assert [a["model"] for a in answers] == [model] * len(answers)
    assert all(a["stream"] is bool(body.get("stream")) and a["features"] is None for a in answers)
    ids = [a["request_id"] for a in answers]
    assert ids[0].startswith("cmpl-") and len(set(ids)) == len(ids)
    assert answers[0]["sampling_params"]["max_tokens"] == client.requests[0].params.max_tokens


@pytest.mark.parametrize("model", [BASE, ADAPTER])
async def test_chat_render_gives_the_templated_prompt_ids(model):
    async with serve() as (http, client, _):
        rendered = await http.post("/v1/chat/completions/render", json={"model": model, **CHAT})
        assert client.requests == []
        await http.post("/v1/chat/completions", json={"model": model, **CHAT})
    answer = rendered.json()
    assert list(answer) == GENERATE_REQUEST_FIELDS and answer["request_id"].startswith("chatcmpl-")
    assert answer["token_ids"] == client.requests[0].prompt_token_ids
    assert answer["token_ids"] == TOKENIZER.encode(
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n",
        False)
    assert answer["parse_context"]["history_tool_call_cnt"] == 0


@pytest.mark.parametrize("route, body, status, param", [
    ("/v1/completions/render", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/chat/completions/render", {"model": "nope", **CHAT}, 404, "model"),
    ("/v1/completions/render", {"model": BASE}, 400, "prompt"),
    ("/v1/completions/render", {"model": BASE, "prompt": "hi", "max_tokens": 10_000}, 400, None),
    ("/v1/chat/completions/render", {"model": BASE, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     400, "messages"),
])
async def test_render_errors_are_the_routes_errors_in_vllms_envelope(route, body, status, param):
    async with serve() as (http, client, _):
        response = await http.post(route, json=body)
        generated = await http.post(route.removesuffix("/render"), json=body)
    assert error_of(response)[0] == status and error_of(response)[2] == param
    assert error_of(response) == error_of(generated)
