"""The soak's pieces that need no server: its hostile requests, the probe's slow-down, the 5xx count, the checks."""
from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter

import httpx
import pytest

from bench.soak import (PLAIN, Client, Phases, checks, hostile_requests, probe, server_errors, side_by_side, slowdown,
                        twin_requests)

ROUTES = {"/v1/completions", "/v1/chat/completions", "/tokenize", "/v1/load_lora_adapter"}
IDLE = {"gauges": {"vllm:num_requests_running": 0, "vllm:num_requests_waiting": 0, "vllm:kv_cache_usage_perc": 0},
        "on_gpu": 1, "loading": 0}
RSS = {"gateway": 40.0, "worker": 500.0, "gateway_shared": 1.0, "worker_shared": 1.0}


def test_hostile_requests_cover_each_class_and_encode_as_json():
    hostile = hostile_requests("/tmp/adapter")
    for name, (route, body) in hostile.items():
        assert route in ROUTES, name
        json.dumps(body)
    names = " ".join(hostile)
    for part in ("deep_json", "allowed_token_ids", "fan_out", "unsatisfiable", "schema", "adapter_name", "best_of"):
        assert part in names
    assert len(hostile["large_fan_out"][1]["prompt"]) * hostile["large_fan_out"][1]["n"] == 102_400


def test_slowdown_is_each_latency_over_the_median_of_the_warmups_second_half():
    report = slowdown([9.0, 9.0, 0.1, 0.2, 0.3], [0.2, 0.4, 0.9])
    assert report == {"baseline_p50_ms": 200.0, "p50_ms": 400.0, "worst_ms": 900.0, "p50_ratio": 2.0,
                      "worst_ratio": 4.5}
    assert slowdown([], [0.1])["worst_ratio"] is None


def test_server_errors_count_each_5xx_once_in_the_total():
    counts = Counter({("stream", "200"): 5, ("whole", "500"): 2, ("hostile", "500"): 1,
                      ("hostile:large_fan_out", "500"): 1, ("probe", "503"): 1})
    assert server_errors(counts) == {"total": 4, "by_kind": {"hostile": 1, "hostile:large_fan_out": 1,
                                                             "probe": 1, "whole": 2}}


@pytest.mark.parametrize("counts, worst, failed", [
    ({("hostile", "400"): 3, ("hostile", "200"): 1, ("bad", "400"): 2, ("twin", "200"): 4}, 1.5, []),
    ({("twin", "400"): 1}, 1.5, ["twin_requests_got_2xx"]),
    ({("hostile", "500"): 1}, 1.5, ["no_5xx", "hostile_requests_got_2xx_or_4xx"]),
    ({("hostile", "transport:ReadTimeout"): 1}, 1.5, ["hostile_requests_got_2xx_or_4xx"]),
    ({("hostile", "400"): 1}, 2.5, ["plain_request_slowdown_within"]),
    ({("hostile", "400"): 1}, None, ["plain_request_slowdown_within"]),
])
def test_checks_fail_on_a_hostile_5xx_and_on_a_slowed_plain_request(counts, worst, failed):
    result = checks(Counter(counts), IDLE, RSS, RSS, 2, 0.1, {"worst_ratio": worst}, 2.0)
    assert sorted(k for k, ok in result.items() if not ok) == sorted(failed)


def test_probe_times_the_plain_request_and_hostile_requests_are_counted_by_name():
    async def answer(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.001)                      # a server's answer takes a while
        try:
            plain = json.loads(request.content) == PLAIN
        except (ValueError, RecursionError):            # the soak's malformed and deep bodies
            plain = False
        return httpx.Response(200 if plain else 400, json={})

    async def run() -> tuple[Counter, list[float]]:
        counts: Counter = Counter()
        latencies: list[float] = []
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://soak") as http:
            client = Client(http, random.Random(0), [], {"extra-0": "/tmp/a"}, counts, hostile_requests("/tmp/a"))
            until = time.monotonic() + 0.3
            await asyncio.gather(probe(http, until, 0.05, latencies, counts), client.run(until))
        return counts, latencies

    counts, latencies = asyncio.run(run())
    assert 3 <= len(latencies) == counts[("probe", "200")] <= 7
    named = sum(n for (kind, _), n in counts.items() if kind.startswith("hostile:"))
    assert named == sum(n for (kind, _), n in counts.items() if kind == "hostile") > 0
    assert all(status == "400" for (kind, status) in counts if kind.startswith("hostile"))


def test_each_client_sends_every_hostile_request_in_turn():
    counts: Counter = Counter()
    client = Client(None, random.Random(1), [], {}, counts, hostile_requests("/tmp/a"))
    sent = []

    class Recorder:
        async def post(self, route, json):
            sent.append((route, json))
            return httpx.Response(400)

    client.http = Recorder()
    hostile = hostile_requests("/tmp/a")
    for _ in range(2 * len(hostile)):
        asyncio.run(client.hostile())
    assert {kind: n for (kind, _), n in counts.items()} == {f"hostile:{name}": 2 for name in hostile}


def test_every_hostile_request_has_a_twin_that_does_the_same_work_without_the_hostile_part():
    hostile = hostile_requests("/tmp/adapter")
    twins = twin_requests(hostile)
    assert set(twins) == set(hostile)
    for name, (route, body) in twins.items():
        assert route in ROUTES - {"/v1/load_lora_adapter"}, name        # twins are served, never refused
        json.dumps(body)
        assert len(json.dumps(body)) <= max(1000, len(json.dumps(hostile[name][1]))), name
    assert twins["long_allowed_token_ids"][1] == {k: v for k, v in hostile["long_allowed_token_ids"][1].items()
                                                   if k != "allowed_token_ids"}       # the same n, the same tokens
    assert "best_of" not in twins["best_of"][1] and twins["best_of"][1]["n"] == hostile["best_of"][1]["n"]


def test_side_by_side_takes_each_figure_of_the_hostile_phases_over_the_twin_phases():
    twin = [0.1] * 19 + [0.2]
    hostile = [0.2] * 19 + [0.5]
    report = side_by_side(twin, hostile)
    assert (report["p50_ratio"], report["p95_ratio"], report["worst_ratio"]) == (2.0, 2.5, 2.5)
    assert report["probes"] == [20, 20] and report["twin_worst_ms"] == 200.0
    assert side_by_side([], hostile)["worst_ratio"] is None


def test_phases_alternate_twin_then_hostile():
    phases = Phases(start=time.monotonic() - 0.5, seconds=1.0)
    assert not phases.hostile_now()
    phases = Phases(start=time.monotonic() - 1.5, seconds=1.0)
    assert phases.hostile_now()
    phases = Phases(start=time.monotonic() - 2.5, seconds=1.0)
    assert not phases.hostile_now()


@pytest.mark.parametrize("hostile_now", [False, True])
def test_a_client_sends_twins_in_the_twin_phases_and_the_probe_files_its_latency_by_phase(hostile_now):
    sent: list[str] = []
    counts: Counter = Counter()

    class Fixed(Phases):
        def hostile_now(self) -> bool:
            return hostile_now

    async def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        sent.append("plain" if body == PLAIN else request.url.path)
        return httpx.Response(200, json={})

    async def run() -> tuple[list[float], list[float]]:
        latencies, twin_latencies = [], []
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://soak") as http:
            client = Client(http, random.Random(0), [], {}, counts, hostile_requests("/tmp/a"), 1.0, Fixed(0, 1))
            for _ in range(3):
                kind = "hostile" if hostile_now else "twin"
                await getattr(client, kind)()
            await probe(http, time.monotonic() + 0.01, 1.0, latencies, counts, Fixed(0, 1), twin_latencies)
        return latencies, twin_latencies

    latencies, twin_latencies = asyncio.run(run())
    kind = "hostile" if hostile_now else "twin"
    assert sum(n for (k, _), n in counts.items() if k.startswith(kind + ":")) == 3
    assert (len(latencies), len(twin_latencies)) == ((1, 0) if hostile_now else (0, 1))
