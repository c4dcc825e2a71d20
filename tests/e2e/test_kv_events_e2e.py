"""KV-cache events from a real server, consumed as llm-d's router consumes them (tests/kv_event_subscriber.py).

A server with a small KV cache publishes events and a replay socket; a subscriber rebuilds its block index from
them, and for every follow-up request the hit the index predicts, from the ids the render endpoints return, must
be the `cached_tokens` the server reports: for the base model and two adapters, after evictions, across an adapter
reload, and through subscribers restarted mid-way that catch up by replay.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import REPO_ROOT, STARTUP_SECONDS, stop_and_check_cleanup
from tests.kv_event_subscriber import RouterIndex, Subscriber
from tests.server_process import free_port, wait_until_healthy
from worker.demo import ADAPTERS as DEMO_ADAPTERS, SERVED_MODEL_NAME

BLOCK = 16
NUM_BLOCKS = 40
ADAPTERS = tuple(spec.name for spec in DEMO_ADAPTERS[:2])
SHARED = ("Routers send a request to the server that already holds the longest prefix of its prompt in its "
          "cache, which they learn from the events every server publishes about its blocks.")


@pytest.fixture(scope="module")
def kv_server(demo, tmp_path_factory):
    """(base url, PUB endpoint, replay endpoint, topic) of a server publishing KV-cache events."""
    port, pub_port, replay_port = free_port(), free_port(), free_port()
    topic = f"kv@127.0.0.1:{port}@{SERVED_MODEL_NAME}"
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub_port}",
              "replay_endpoint": f"tcp://*:{replay_port}", "topic": topic}
    modules = [f"{name}={demo.adapters[name]}" for name in ADAPTERS]
    command = [sys.executable, "-m", "gateway", "serve", "--model", str(demo.model_dir),
               "--served-model-name", SERVED_MODEL_NAME, "--lora-modules", *modules, "--host", "127.0.0.1",
               "--port", str(port), "--device", "cpu", "--max-loras", "2", "--num-gpu-blocks-override",
               str(NUM_BLOCKS), "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events),
               "--uvicorn-log-level", "warning"]
    log_path = tmp_path_factory.mktemp("kv-events") / "server.log"
    env = {**{k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}, "PYTHONUNBUFFERED": "1",
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url, Path(log_path), STARTUP_SECONDS)
        yield url, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", topic
    finally:
        if process.poll() is None:
            stop_and_check_cleanup(process, Path(log_path))


def run(url: str, model: str, prompt: str | None = None, messages: list | None = None) -> tuple[list[int], int]:
    """(the prompt ids the render endpoint gives, the cached tokens the request then reports)."""
    route, body = (("/v1/chat/completions", {"messages": messages}) if messages is not None
                   else ("/v1/completions", {"prompt": prompt}))
    body = {"model": model, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True, **body}
    rendered = httpx.post(f"{url}{route}/render", json=body, timeout=60)
    assert rendered.status_code == 200, rendered.text
    token_ids = rendered.json()["token_ids"] if messages is not None else rendered.json()[0]["token_ids"]
    answer = httpx.post(f"{url}{route}", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    details = answer.json()["usage"]["prompt_tokens_details"]
    return token_ids, 0 if details is None else details["cached_tokens"]


def check_prediction(url: str, subscriber: Subscriber, model: str, prompt: str | None = None,
                     messages: list | None = None) -> int:
    """Run one request after the subscriber caught up; its cached tokens must be what the index predicted."""
    subscriber.catch_up()
    rendered = httpx.post(f"{url}/v1/{'chat/' if messages is not None else ''}completions/render",
                          json={"model": model, **({"messages": messages} if messages is not None
                                                   else {"prompt": prompt})}, timeout=60).json()
    token_ids = rendered["token_ids"] if messages is not None else rendered[0]["token_ids"]
    predicted = subscriber.index.predicted_hit(token_ids, model)
    ran_with, cached = run(url, model, prompt, messages)
    assert ran_with == token_ids
    assert cached == predicted, (model, cached, predicted)
    return cached


def test_rebuilt_index_predicts_cached_tokens_across_adapters_evictions_and_replays(kv_server, demo):
    url, endpoint, replay_endpoint, topic = kv_server
    index = RouterIndex(SERVED_MODEL_NAME, BLOCK)
    subscriber = Subscriber(endpoint, replay_endpoint, index)
    subscriber.connect()
    try:
        # the shared prefix, computed once per model: each model's follow-up finds its own blocks only
        models = (SERVED_MODEL_NAME, *ADAPTERS)
        for model in models:
            assert check_prediction(url, subscriber, model, SHARED + " First question.") == 0
        hits = [check_prediction(url, subscriber, model, SHARED + " Second question.") for model in models]
        assert hits[0] >= 2 * BLOCK and hits == [hits[0]] * len(models)
        chat = [{"role": "user", "content": SHARED}]
        check_prediction(url, subscriber, ADAPTERS[0], messages=chat)
        assert check_prediction(url, subscriber, ADAPTERS[0], messages=chat + [
            {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "Why?"}]) > 0

        # the subscriber goes away; traffic goes on; it reconnects and replays from where it stopped
        subscriber.disconnect()
        for i in range(3):
            run(url, ADAPTERS[1], f"{SHARED} Missed while away, number {i}, with words of its own.")
        subscriber.connect()
        assert subscriber.replays[-1] > 0
        assert check_prediction(url, subscriber, ADAPTERS[1], f"{SHARED} Missed while away, number 2.") > 0

        # distinct long prompts overflow the 40-block cache: blocks are evicted, announced, and found no more
        for i in range(6):
            check_prediction(url, subscriber, SERVED_MODEL_NAME, f"Eviction filler {i}: " + " ".join(
                f"word{i}x{j}" for j in range(60)))
        assert index.num_events["BlockRemoved"] > 0
        assert check_prediction(url, subscriber, ADAPTERS[0], SHARED + " Third question.") < hits[0]

        # a new subscriber replays everything from 0 and knows what the live one knows
        fresh = Subscriber(endpoint, replay_endpoint, RouterIndex(SERVED_MODEL_NAME, BLOCK))
        fresh.connect()
        subscriber.catch_up()
        fresh.catch_up()
        assert fresh.replays == [0] and fresh.last_seq == subscriber.last_seq
        assert fresh.index.keys == index.keys
        fresh.close()

        # an adapter reloaded in place: its old blocks are removed before the new version stores the same tokens
        check_prediction(url, subscriber, ADAPTERS[0], SHARED + " Before the reload.")
        reload = httpx.post(f"{url}/v1/load_lora_adapter", timeout=60,
                            json={"lora_name": ADAPTERS[0], "lora_path": str(demo.adapters[ADAPTERS[0]]),
                                  "load_inplace": True})
        assert reload.status_code == 200, reload.text
        assert check_prediction(url, subscriber, ADAPTERS[0], SHARED + " After the reload.") == 0
        assert check_prediction(url, subscriber, ADAPTERS[0], SHARED + " After the reload, again.") > 0
        assert subscriber.topics == {topic} and index.dropped_stores == 0
    finally:
        subscriber.close()

