"""Concurrent streams on the real server: they never cross, and a client that leaves is aborted."""
from __future__ import annotations

import asyncio
import json
import time

import pytest

from worker.demo import ADAPTERS, SERVED_MODEL_NAME

MODELS = [SERVED_MODEL_NAME, *(spec.name for spec in ADAPTERS)]
PROMPTS = ["The weather", "To cook a simple", "In the garden", "Travelling by train", "A public library",
           "Fixing a bicycle", "Numbers and symbols", "Small adapters can"]
NUM_STREAMS = 32
LONG = 1500                     # tokens: far more than a test waits for
ABORT_SECONDS = 30.0           # a generous wait for the abort to reach the worker: a hang still fails


def stream_requests() -> list[dict]:
    """32 distinct (prompt, model) pairs, greedy: i % 8 and i % 5 never repeat together below 40."""
    return [{"model": MODELS[i % len(MODELS)], "prompt": PROMPTS[i % len(PROMPTS)], "temperature": 0.0,
             "max_tokens": 10, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
            for i in range(NUM_STREAMS)]


def seeded_stream_requests() -> list[dict]:
    """stream_requests(), each sampled with its own seed: the same tokens whatever the batch, and distinct even
    where a small model's greedy answers to two prompts agree."""
    return [{**request, "temperature": 1.0, "seed": i} for i, request in enumerate(stream_requests())]


async def stream_text(client, request: dict) -> tuple[str, list[int]]:
    text, ids = "", []
    async for chunk in await client.completions.create(stream=True, **request):
        for choice in chunk.choices:
            assert choice.index == 0
            text += choice.text
            ids += choice.model_extra["token_ids"]
    return text, ids


def reference_streams(reference, requests: list[dict]) -> list[tuple[str, list[int]]]:
    """(text, token ids) of each request run alone on the in-process reference engine."""
    alone = []
    for request in requests:
        adapter = None if request["model"] == SERVED_MODEL_NAME else request["model"]
        ids = reference.tokens(reference.encode(request["prompt"]), adapter, max_tokens=10, ignore_eos=True,
                               temperature=request["temperature"], seed=request.get("seed"))
        alone.append((reference.decode(ids), ids))
    return alone


async def test_concurrent_mixed_adapter_streams_never_cross(server, reference):
    requests = seeded_stream_requests()
    alone = reference_streams(reference, requests)
    assert len({tuple(ids) for _, ids in alone}) == NUM_STREAMS      # a crossing cannot go unseen
    async with server.async_openai() as client:
        together = await asyncio.gather(*(stream_text(client, r) for r in requests))
    assert together == alone


async def wait_for_no_running_request(server) -> None:
    """Polls until vllm:num_requests_running reads 0; fails after ABORT_SECONDS."""
    start = time.monotonic()
    while server.metric("vllm:num_requests_running") != 0:
        assert time.monotonic() - start < ABORT_SECONDS, "the abandoned request is still running"
        await asyncio.sleep(0.05)


async def leave_stream_after_chunks(server, path: str, body: dict, num_chunks: int) -> None:
    async with server.http() as http:
        async with http.stream("POST", path, json={**body, "stream": True}) as response:
            assert response.status_code == 200
            chunks = 0
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    assert "error" not in json.loads(line.removeprefix("data: "))
                    chunks += 1
                if chunks == num_chunks:
                    assert server.metric("vllm:num_requests_running") >= 1
                    break


async def leave_whole_request(server, path: str, body: dict, num_chunks: int) -> None:
    generated = server.metric("vllm:generation_tokens_total")
    async with server.http() as http:
        task = asyncio.create_task(http.post(path, json=body))
        while server.metric("vllm:generation_tokens_total") < generated + num_chunks:
            await asyncio.sleep(0.05)
        assert server.metric("vllm:num_requests_running") >= 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


@pytest.mark.parametrize("leave, path, body", [
    (leave_stream_after_chunks, "/v1/completions", {"prompt": "The weather"}),
    (leave_stream_after_chunks, "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "n": 2, "temperature": 1.0}),
    (leave_whole_request, "/v1/completions", {"prompt": "The weather", "model": "chat"}),
], ids=["completion-stream", "chat-stream-n2", "completion-whole"])
async def test_client_disconnect_aborts_the_request(server, leave, path, body):
    body = {"model": SERVED_MODEL_NAME, "max_tokens": LONG, "ignore_eos": True, **body}
    n = body.get("n", 1)
    aborted = server.metric("vllm:request_success_total", 'finished_reason="abort"')
    generated = server.metric("vllm:generation_tokens_total")
    await leave(server, path, body, num_chunks=3)
    await wait_for_no_running_request(server)
    assert server.metric("vllm:num_requests_waiting") == 0
    assert server.metric("vllm:request_success_total", 'finished_reason="abort"') == aborted + n
    assert server.metric("vllm:generation_tokens_total") - generated < n * LONG
    assert server.health_status() == 200
