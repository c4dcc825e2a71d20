"""EventStreamResponse: the headers sse-starlette sent, every event `data: {json}\\n\\n` written as it comes,
[DONE] last; an error after the start is one error event before [DONE]."""
from __future__ import annotations

import json

from fake_worker_client import FakeWorkerClient
from gateway_app import ANSWER_IDS, BASE, TOKENIZER, serve


async def test_a_stream_has_the_event_stream_headers_and_one_event_per_output():
    async with serve() as (http, _, _):
        response = await http.post("/v1/completions", json={"model": BASE, "prompt": "hi", "stream": True,
                                                            "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert (response.headers["cache-control"], response.headers["x-accel-buffering"]) == ("no-store", "no")
    blocks = response.text.split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(block.removeprefix("data: ")) for block in blocks[:-2]]
    assert all(block.startswith("data: {") for block in blocks[:-2])
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == TOKENIZER.decode(ANSWER_IDS)
    assert len(chunks) == len(ANSWER_IDS) + 1                  # the fake's one token an output, then usage
    assert chunks[-1]["usage"]["completion_tokens"] == len(ANSWER_IDS)


async def test_an_error_mid_stream_is_one_error_event_then_done():
    client = FakeWorkerClient(lambda request: list(ANSWER_IDS))
    client.error = "The worker process died (exit code -9)."
    async with serve(client) as (http, _, _):
        response = await http.post("/v1/completions", json={"model": BASE, "prompt": "hi", "stream": True})
    blocks = response.text.split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""] and len(blocks) == 3
    assert json.loads(blocks[0].removeprefix("data: "))["error"]["message"] == client.error
