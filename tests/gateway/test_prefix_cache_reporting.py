"""What the gateway says about the prefix cache, as vLLM says it: usage.prompt_tokens_details.cached_tokens
(only with --enable-prompt-tokens-details, only when non-zero), vllm:prefix_cache_queries / _hits from the
worker's Stats, cache_config_info's enable_prefix_caching, and the two flags."""
from __future__ import annotations

import json

import pytest
from fake_worker_client import FakeWorkerClient
from gateway_app import ADAPTER, ANSWER_IDS, BASE, serve
from test_metrics import samples, value

from gateway.__main__ import build_parser
from gateway.config import GatewayConfig
from worker.config import CacheConfig
from worker.ipc.messages import Stats

ENGINE = {"engine": "0", "model_name": BASE}


class CachingClient(FakeWorkerClient):
    """The fake worker, whose first output of a request says `cached(request)` prompt tokens were cached."""

    def __init__(self, cached):
        super().__init__(lambda request: list(ANSWER_IDS))
        self.cached = cached

    async def generate(self, request, on_output=None):
        first = True
        async for output in super().generate(request, on_output):
            if first:
                output.num_cached_tokens = self.cached(request)
            first = False
            yield output


def chat(**fields):
    return {"model": ADAPTER, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3, **fields}


def stream_usage(text: str) -> dict:
    events = [json.loads(line[len("data: "):]) for line in text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return [e for e in events if e.get("usage") and not e["choices"]][-1]["usage"]


@pytest.mark.parametrize("flag, cached, expected", [(True, 16, {"cached_tokens": 16}), (True, 0, None),
                                                    (False, 16, None)])
async def test_chat_usage_reports_cached_tokens_with_the_flag_when_nonzero(flag, cached, expected):
    async with serve(CachingClient(lambda request: cached), enable_prompt_tokens_details=flag) as (http, _, _):
        whole = (await http.post("/v1/chat/completions", json=chat())).json()
        streamed = await http.post("/v1/chat/completions",
                                   json=chat(stream=True, stream_options={"include_usage": True}))
    assert whole["usage"]["prompt_tokens_details"] == expected
    assert stream_usage(streamed.text).get("prompt_tokens_details") == expected


async def test_completions_report_the_last_prompts_cached_tokens():
    cached_by_prompt = {1: 0, 2: 32}      # prompt length -> cached tokens

    def cached(request):
        return cached_by_prompt[len(request.prompt_token_ids)]
    async with serve(CachingClient(cached), enable_prompt_tokens_details=True) as (http, _, _):
        body = {"model": BASE, "prompt": [[5], [5, 6]], "max_tokens": 2}
        whole = (await http.post("/v1/completions", json=body)).json()
    assert whole["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


async def test_prefix_cache_counters_have_vllms_type_labels_help_and_the_workers_values():
    async with serve() as (http, client, _):
        client.stats = Stats(num_running=0, num_waiting=0, prefix_cache_queries=100, prefix_cache_hits=64)
        first = (await http.get("/metrics")).text
        client.stats = Stats(num_running=0, num_waiting=0, prefix_cache_queries=250, prefix_cache_hits=160)
        second = (await http.get("/metrics")).text
    lines = first.splitlines()
    for name, help_text in (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")):
        assert f"# HELP {name}_total {help_text}" in lines and f"# TYPE {name}_total counter" in lines
        assert [labels for n, labels, _ in samples(first) if n == f"{name}_total"] == [ENGINE]
    assert (value(first, "vllm:prefix_cache_queries_total"), value(first, "vllm:prefix_cache_hits_total")) == (100, 64)
    assert (value(second, "vllm:prefix_cache_queries_total"), value(second, "vllm:prefix_cache_hits_total")) == \
        (250, 160)


@pytest.mark.parametrize("enabled", [True, False])
async def test_cache_config_info_says_whether_prefix_caching_is_on(enabled):
    async with serve(cache=CacheConfig(enable_prefix_caching=enabled)) as (http, _, _):
        text = (await http.get("/metrics")).text
    assert value(text, "vllm:cache_config_info", enable_prefix_caching=str(enabled)) == 1


@pytest.mark.parametrize("argv, caching, details", [([], True, False), (["--no-enable-prefix-caching"], False, False),
                                                    (["--enable-prefix-caching", "--enable-prompt-tokens-details"],
                                                     True, True)])
def test_flags_reach_the_worker_config(argv, caching, details):
    config = GatewayConfig.from_args(build_parser().parse_args(["serve", "--model", "/m", *argv]))
    assert (config.worker.cache.enable_prefix_caching, config.enable_prompt_tokens_details) == \
        (caching, details)
