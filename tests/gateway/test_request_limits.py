"""Limits on what one request may make the server do: a completions request creates at most MAX_CHOICES choices
(prompts x n) and a request's stop strings total at most MAX_STOP_CHARS characters, both refused with 400 before
anything is queued; a request's allowed_token_ids cross to the worker once each, however often repeated."""
import asyncio

import pytest

from fake_worker_client import FakeWorkerClient
from gateway.generation_request import MAX_CHOICES, MAX_N, MAX_STOP_CHARS
from gateway_app import BASE, error_of, serve


def _post(body: dict):
    """(response, the requests the worker was sent) of one completions request."""
    async def go():
        async with serve(FakeWorkerClient(lambda request: [5])) as (http, client, _):
            return await http.post("/v1/completions", json=body), client.requests
    return asyncio.run(go())


@pytest.mark.parametrize("num_prompts, n", [(MAX_CHOICES // MAX_N, MAX_N), (MAX_CHOICES, 1)])
def test_a_request_of_exactly_max_choices_is_served(num_prompts, n):
    body = {"model": BASE, "prompt": [[5, 6 + i % 7] for i in range(num_prompts)], "n": n, "max_tokens": 1,
            "temperature": 1.0}
    response, sent = _post(body)
    assert response.status_code == 200, response.text[:300]
    assert len(response.json()["choices"]) == len(sent) == MAX_CHOICES


@pytest.mark.parametrize("num_prompts, n", [(MAX_CHOICES // MAX_N + 1, MAX_N), (MAX_CHOICES + 1, 1), (800, 128),
                                            (MAX_CHOICES // 2 + 1, 2)])
@pytest.mark.parametrize("stream", [False, True])
def test_more_choices_than_max_choices_is_a_400_before_anything_is_queued(num_prompts, n, stream):
    body = {"model": BASE, "prompt": [[5, 6]] * num_prompts, "n": n, "max_tokens": 1, "temperature": 1.0,
            "stream": stream}
    response, sent = _post(body)
    status, message, param = error_of(response)
    assert (status, param, response.json()["error"]["type"]) == (400, "prompt", "BadRequestError")
    assert f"{num_prompts * n} choices" in message and str(MAX_CHOICES) in message
    assert sent == []


def test_allowed_token_ids_reach_the_worker_once_each_in_first_seen_order():
    body = {"model": BASE, "prompt": "hi", "max_tokens": 1, "n": 16, "temperature": 1.0,
            "allowed_token_ids": [300, 7] * 50_000 + [9]}
    response, sent = _post(body)
    assert response.status_code == 200, response.text[:300]
    assert len(sent) == 16 and all(r.params.allowed_token_ids == [300, 7, 9] for r in sent)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra", [0, 1])
def test_stop_strings_past_max_stop_chars_are_a_400_before_anything_is_queued(route, extra):
    stops = ["abcd"] * (MAX_STOP_CHARS // 4 - 1) + ["x" * (4 + extra)]
    body = {"model": BASE, "max_tokens": 1, "stop": stops,
            **({"prompt": "hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})}

    async def go():
        async with serve(FakeWorkerClient(lambda request: [5])) as (http, client, _):
            return await http.post(route, json=body), client.requests
    response, sent = asyncio.run(go())
    if not extra:
        assert response.status_code == 200 and len(sent) == 1, response.text[:300]
        return
    assert error_of(response) == (400, f"stop strings may total at most {MAX_STOP_CHARS} characters, got "
                                       f"{MAX_STOP_CHARS + 1}.", "stop")
    assert sent == []
