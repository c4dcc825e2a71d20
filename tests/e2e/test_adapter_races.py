"""Runtime adapter changes racing requests on the real server (issue 21's racing adapter changes).

`load_inplace`: requests already in flight on the old version finish on its weights, requests sent after the
load answered get the new version's, and requests sent while it runs get one or the other; none fails.
Unload: a stream that already started goes on (or ends with a 404 error event, then [DONE]); a request
sent while the unload runs is answered or not found; one sent after it is not found. Never a 5xx.
Every answer's tokens are checked against the offline engine running the same adapter alone. On a server
with a --lora-dir: unloads racing the requests that load an adapter automatically leave the gateway and the
worker holding the same names, and a directory that fails to load leaves none.

The streams in flight ask for STREAM_TOKENS, more than any machine makes while the adapter changes, and the
client leaves each AFTER_TOKENS tokens after the change has answered: they are in flight during the change
whatever the machine's speed, and their tokens after it are checked too.
"""
from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import pytest

from tests.e2e.conftest import API_KEY

STREAM_TOKENS = 2000            # a stream the test leaves long before its end
AFTER_TOKENS = 16               # tokens a stream in flight is read for once the adapter change has answered
WHOLE_TOKENS = 8
PROMPTS = ["The weather", "In the garden", "A public library"]
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


def body(model: str, prompt: str, max_tokens: int, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def alone(reference, prompt: str, adapter: str, max_tokens: int) -> list[int]:
    """The greedy tokens of `prompt` on `adapter`, run alone on the offline engine."""
    return reference.tokens(reference.encode(prompt), adapter, max_tokens=max_tokens, ignore_eos=True)


async def stream(http: httpx.AsyncClient, request: dict, started: asyncio.Event,
                 leave: asyncio.Event | None = None) -> tuple[int, list[int], list]:
    """(status, the token ids streamed, the events: JSON objects or "[DONE]"); `started` set at the first chunk.
    With `leave`: the client leaves AFTER_TOKENS tokens after it sees `leave` set, unless the stream ends first."""
    ids, events, read_when_set = [], [], None
    async with http.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
        if response.status_code != 200:                     # refused before the stream began: a JSON error
            return response.status_code, ids, [json.loads(await response.aread())]
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            event = data if data == "[DONE]" else json.loads(data)
            events.append(event)
            if isinstance(event, dict) and "choices" in event:
                ids += event["choices"][0]["token_ids"]
                started.set()
            if leave is not None and leave.is_set():
                read_when_set = len(ids) if read_when_set is None else read_when_set
                if len(ids) >= read_when_set + AFTER_TOKENS:
                    break
        return response.status_code, ids, events


async def whole(http: httpx.AsyncClient, request: dict) -> tuple[int, list[int] | None]:
    response = await http.post("/v1/completions", json=request)
    answer = response.json()
    return response.status_code, answer["choices"][0]["token_ids"] if response.status_code == 200 else None


async def start_streams(http: httpx.AsyncClient, model: str, leave: asyncio.Event) -> list[asyncio.Task]:
    """One greedy stream per prompt on `model`, left once `leave` is set (stream()), returned once each has its
    first chunk."""
    started = [asyncio.Event() for _ in PROMPTS]
    tasks = [asyncio.create_task(stream(http, body(model, prompt, STREAM_TOKENS), event, leave))
             for prompt, event in zip(PROMPTS, started)]
    for event in started:
        await asyncio.wait_for(event.wait(), 60)
    return tasks


async def test_load_inplace_keeps_requests_in_flight_on_the_old_version_and_new_ones_on_the_new(server, reference):
    name, old, new = "race-inplace", "doctests", "chat"
    short = {version: [alone(reference, p, version, WHOLE_TOKENS) for p in PROMPTS] for version in (old, new)}
    changed = asyncio.Event()
    async with server.http() as http:
        loaded = await http.post(LOAD, json={"lora_name": name, "lora_path": str(server.demo.adapters[old])})
        assert loaded.status_code == 200, loaded.text
        try:
            streams = await start_streams(http, name, changed)
            racing = [asyncio.create_task(whole(http, body(name, p, WHOLE_TOKENS))) for p in PROMPTS]
            replaced = await http.post(LOAD, json={"lora_name": name, "lora_path": str(server.demo.adapters[new]),
                                                   "load_inplace": True})
            still_streaming = not any(task.done() for task in streams)
            changed.set()
            after = await asyncio.gather(*(whole(http, body(name, p, WHOLE_TOKENS)) for p in PROMPTS))
            during = await asyncio.gather(*racing)
            in_flight = await asyncio.gather(*streams)
        finally:
            await http.post(UNLOAD, json={"lora_name": name})
    assert replaced.status_code == 200, replaced.text
    assert still_streaming, "a stream ended before the load: the test raced nothing"
    for (status, ids, events), prompt in zip(in_flight, PROMPTS):       # the old version's, also after the load
        assert status == 200 and all("choices" in e for e in events) and len(ids) >= AFTER_TOKENS
        assert ids == alone(reference, prompt, old, len(ids))
    assert after == [(200, ids) for ids in short[new]]
    for (status, ids), old_ids, new_ids in zip(during, short[old], short[new]):
        assert status == 200 and ids in (old_ids, new_ids)


async def test_unload_racing_requests_finishes_started_streams_and_answers_the_rest_404(server, reference):
    name, source = "race-unload", "asyncio"
    short = [alone(reference, p, source, WHOLE_TOKENS) for p in PROMPTS]
    changed = asyncio.Event()
    not_found = {"message": f"The model `{name}` does not exist.", "type": "NotFoundError", "param": "model",
                 "code": 404}
    async with server.http() as http:
        loaded = await http.post(LOAD, json={"lora_name": name, "lora_path": str(server.demo.adapters[source])})
        assert loaded.status_code == 200, loaded.text
        streams = await start_streams(http, name, changed)
        racing_wholes = [asyncio.create_task(whole(http, body(name, p, WHOLE_TOKENS))) for p in PROMPTS]
        racing_streams = [asyncio.create_task(stream(http, body(name, p, WHOLE_TOKENS), asyncio.Event()))
                          for p in PROMPTS]
        unloaded = await http.post(UNLOAD, json={"lora_name": name})
        still_streaming = not any(task.done() for task in streams)
        changed.set()
        after = await http.post("/v1/completions", json=body(name, PROMPTS[0], WHOLE_TOKENS))
        in_flight = await asyncio.gather(*streams)
        during_wholes = await asyncio.gather(*racing_wholes)
        during_streams = await asyncio.gather(*racing_streams)
    assert unloaded.status_code == 200, unloaded.text
    assert still_streaming, "a stream ended before the unload: the test raced nothing"
    assert (after.status_code, after.json()["error"]) == (404, not_found)
    for (status, ids, events), prompt in zip(in_flight, PROMPTS):     # went on, or ended with a 404 event
        assert status == 200 and ids == alone(reference, prompt, source, len(ids))
        assert all("choices" in e for e in events) or events[-2:] == [{"error": not_found}, "[DONE]"]
    for (status, ids), full in zip(during_wholes, short):
        assert (status, ids) in ((200, full), (404, None))
    for (status, ids, events), full in zip(during_streams, short):
        assert (status, ids, events[-1]) == (200, full, "[DONE]") or events == [{"error": not_found}] or \
            (status, ids, events[-2:]) == (200, [], [{"error": not_found}, "[DONE]"])


# A --lora-dir on a server of its own: automatic loads racing unloads, and a directory that fails to load.

AUTO, BROKEN = "auto", "broken"
ROUNDS = 10


@pytest.fixture(scope="module")
def lora_dir_server(demo, tmp_path_factory):
    """(url, lora_dir) of a server with runtime loading on and a --lora-dir holding `auto` (a demo adapter)
    and `broken` (an unreadable adapter_config.json)."""
    from tests.e2e.test_faults import start_server
    tmp = tmp_path_factory.mktemp("lora-dir-server")
    lora_dir = tmp / "adapters"
    shutil.copytree(demo.adapters["doctests"], lora_dir / AUTO)
    (lora_dir / BROKEN).mkdir()
    (lora_dir / BROKEN / "adapter_config.json").write_text("{not json")
    server = start_server(demo, tmp, "--lora-dir", str(lora_dir), "--allow-runtime-lora-updating")
    yield server.url, lora_dir
    server.process.terminate()
    server.process.wait(30)


async def served_adapters(http: httpx.AsyncClient) -> set[str]:
    """The adapter names served, after checking that /v1/models and /v1/adapters list the same ones and that
    the gateway (base_model) and the worker (version) both hold each."""
    models = {m["id"] for m in (await http.get("/v1/models")).json()["data"] if m["parent"] is not None}
    cards = (await http.get("/v1/adapters")).json()["data"]
    assert {c["id"] for c in cards} == models, (models, cards)
    assert all(c["base_model"] is not None and c["version"] is not None for c in cards), cards
    return models


async def test_unloads_racing_automatic_loads_leave_gateway_and_worker_agreeing(lora_dir_server):
    """Each round: requests naming `auto` (loaded by the first of them), an unload sent among them, more
    requests; then both processes must hold the same names, and `auto` must unload and load again."""
    url, lora_dir = lora_dir_server
    unloads = 0                        # rounds whose unload found `auto` loaded by a request
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        for _ in range(ROUNDS):
            requests = [asyncio.create_task(whole(http, body(AUTO, p, WHOLE_TOKENS))) for p in PROMPTS * 2]
            unload = asyncio.create_task(http.post(UNLOAD, json={"lora_name": AUTO}))
            requests += [asyncio.create_task(whole(http, body(AUTO, p, WHOLE_TOKENS))) for p in PROMPTS * 2]
            unloaded, answers = await unload, await asyncio.gather(*requests)
            assert unloaded.status_code in (200, 404) and all(a[0] in (200, 404) for a in answers), answers
            unloads += unloaded.status_code == 200
            if AUTO in await served_adapters(http):
                assert (await http.post(UNLOAD, json={"lora_name": AUTO})).status_code == 200
            loaded = await http.post(LOAD, json={"lora_name": AUTO, "lora_path": str(lora_dir / AUTO)})
            assert loaded.status_code == 200, loaded.text
            assert (await http.post(UNLOAD, json={"lora_name": AUTO})).status_code == 200
            assert AUTO not in await served_adapters(http)
    assert unloads > 0, "no unload raced a loaded adapter"


async def test_a_directory_that_fails_to_load_leaves_no_name(lora_dir_server):
    url, _ = lora_dir_server
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        failed = await http.post("/v1/completions", json=body(BROKEN, PROMPTS[0], WHOLE_TOKENS))
        names = await served_adapters(http)
        metrics = (await http.get("/metrics")).text
        unloaded = await http.post(UNLOAD, json={"lora_name": BROKEN})
        loaded = await http.post(LOAD, json={"lora_name": BROKEN, "lora_path": "/elsewhere"})
    assert failed.status_code == 400 and "adapter_config.json" in failed.json()["error"]["message"], failed.text
    assert BROKEN not in names and f'lora_name="{BROKEN}"' not in metrics
    assert unloaded.status_code == 404
    assert loaded.status_code == 400 and "outside the directories allowed by --lora-dir" in loaded.text
