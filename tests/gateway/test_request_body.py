"""Request bodies: content types, the size limit (checked while reading), bytes and nesting that are not
JSON, and the event loop staying free while a large prompt is tokenized or templated."""
import asyncio
import json
import time

import pytest

from gateway.request_body import MIN_BODY_BYTES, UNSUPPORTED_MEDIA_TYPE, default_max_body_bytes
from gateway_app import BASE, TOKENIZER, error_of, serve

ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
BODY = {"model": BASE, "prompt": "hello", "messages": [{"role": "user", "content": "hi"}], "tokens": [1, 2]}


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonp", ""])
@pytest.mark.parametrize("route", ROUTES)
async def test_a_body_typed_other_than_json_is_refused(route, content_type):
    async with serve() as (http, client, _):
        response = await http.post(route, content=json.dumps(BODY), headers={"Content-Type": content_type})
    assert error_of(response) == (415, UNSUPPORTED_MEDIA_TYPE, "Content-Type")
    assert client.requests == []


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8", None])
async def test_json_with_or_without_a_charset_and_an_untyped_body_are_read_as_json(content_type):
    headers = {} if content_type is None else {"Content-Type": content_type}
    async with serve() as (http, _, _):
        response = await http.post("/tokenize", content=json.dumps({"prompt": "hello"}).encode(), headers=headers)
    assert response.status_code == 200 and response.json()["tokens"] == TOKENIZER.encode("hello")


def test_the_default_body_limit_holds_a_full_context_of_tokens():
    assert default_max_body_bytes(256) == MIN_BODY_BYTES
    assert default_max_body_bytes(131072) == 131072 * 128


async def test_a_body_over_the_limit_is_refused_by_its_declared_length():
    async with serve(max_request_body_bytes=1000) as (http, client, _):
        over = await http.post("/v1/completions", json={"model": BASE, "prompt": "x" * 1000})
        under = await http.post("/v1/completions", json={"model": BASE, "prompt": "hello " * 100, "max_tokens": 5})
    assert error_of(over)[0] == 413 and "larger than 1000 bytes" in error_of(over)[1]
    assert under.status_code == 200 and len(client.requests) == 1


async def test_a_chunked_body_is_refused_once_the_bytes_read_pass_the_limit():
    sent = []

    async def chunks():
        for _ in range(100):
            sent.append(1)
            yield b" " * 512

    async with serve(max_request_body_bytes=4096) as (http, _, _):
        response = await http.post("/tokenize", content=chunks())
    assert error_of(response)[0] == 413
    assert len(sent) < 100      # refused before the rest was read


@pytest.mark.parametrize("raw, message", [
    (b'{"model": "base", "prompt": "\xff\xfe"}', "JSON decode error: 'utf-8' codec can't decode byte 0xff..."),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "JSON decode error: the body is nested too deeply."),
    (b'{"prompt": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}",
     "JSON decode error: the body is nested too deeply."),
    (b"\x00\x01\x02", "JSON decode error: ..."),
])
@pytest.mark.parametrize("route", ROUTES)
async def test_bytes_that_are_not_json_are_a_bad_request(route, raw, message):
    async with serve() as (http, _, _):
        response = await http.post(route, content=raw, headers={"Content-Type": "application/json"})
    status, text, _ = error_of(response)
    assert status == 400 and text.startswith(message.removesuffix("...")), text


async def _health_answer_times(http, busy: asyncio.Task) -> list[float]:
    """When each /health probe was answered, probing every 10 ms until `busy` is done."""
    answered = []
    while not busy.done():
        assert (await http.get("/health")).status_code == 200
        answered.append(time.perf_counter())
        await asyncio.sleep(0.01)
    return answered


@pytest.mark.parametrize("route, body", [
    ("/tokenize", {"prompt": "the quick brown fox " * 100_000}),
    ("/tokenize", {"messages": [{"role": "user", "content": "the quick brown fox " * 100_000}]}),
    ("/v1/completions", {"prompt": "the quick brown fox " * 100_000, "max_tokens": 1}),
    ("/detokenize", {"tokens": TOKENIZER.encode("the quick brown fox ") * 300_000}),
], ids=["tokenize-prompt", "tokenize-chat", "completion", "detokenize"])
async def test_health_answers_throughout_the_processing_of_a_large_input(route, body):
    """The event loop never stalls for half the large request's time: tokenizing on the loop, or on a thread that
    holds the GIL throughout, stalls it for most of that time (no answer at all, or a gap of 0.6 to 1.0 of it),
    against a sixth with the work off the loop on an idle 2-core machine and a third with a second test suite running
    beside it. A ratio of two times of one run, so it holds on a machine of any speed."""
    async with serve(max_request_body_bytes=64 << 20) as (http, _, _):
        raw = json.dumps({"model": BASE, **body}).encode()      # encoded here, not on the loop below
        start = time.perf_counter()
        busy = asyncio.create_task(http.post(route, content=raw, headers={"Content-Type": "application/json"}))
        await asyncio.sleep(0)
        answered = await _health_answer_times(http, busy)
        end = time.perf_counter()
        response = busy.result()
    assert response.status_code in (200, 400), response.text      # 400: the completion's prompt is too long
    times = [start, *answered, end]
    longest_stall = max(b - a for a, b in zip(times, times[1:]))
    assert len(answered) >= 3 and longest_stall < (end - start) / 2, (len(answered), longest_stall, end - start)
