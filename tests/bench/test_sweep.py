"""bench.sweep: each point of the concurrency sweep sends its requests with the setting's adapters and at most
its concurrency in flight, and reports what bench.report summarises."""
from __future__ import annotations

import asyncio
import time

import pytest

import bench.serve as serve
from bench.report import RequestRecord
from bench.serve import Endpoint
from bench.sweep import plot, sweep, workload


@pytest.fixture
def sent(monkeypatch):
    """Replace the HTTP send with a timed stand-in; returns what it saw: adapters per point, peak in flight."""
    state = {"adapters": [], "in_flight": 0, "peak": []}

    async def send(client, endpoint, spec, start):
        state["in_flight"] += 1
        state["peak"][-1] = max(state["peak"][-1], state["in_flight"])
        state["adapters"][-1].append(spec.adapter)
        sent_at = time.perf_counter() - start
        await asyncio.sleep(0.01)
        state["in_flight"] -= 1
        return RequestRecord(spec.adapter, spec.output_len, send_time=sent_at, ttft=0.005, e2el=0.01,
                             output_tokens=spec.output_len)

    real_benchmark = serve.benchmark

    async def benchmark(*args, **kwargs):
        state["adapters"].append([])
        state["peak"].append(0)
        return await real_benchmark(*args, **kwargs)

    monkeypatch.setattr(serve, "send", send)
    monkeypatch.setattr("bench.sweep.benchmark", benchmark)
    return state


def test_each_point_holds_its_concurrency_with_the_settings_adapters(sent):
    points = sweep(Endpoint("http://x", "m"), ["base", "one", "many"], [1, 4, 12], input_len=3, output_len=5,
                   num_loras=3, vocab_size=50)
    assert [(p["setting"], p["concurrency"]) for p in points] == [(s, c) for s in ("base", "one", "many")
                                                                  for c in (1, 4, 12)]
    assert [p["completed"] for p in points] == [16, 16, 24] * 3 and all(p["errors"] == 0 for p in points)
    assert sent["peak"] == [1, 4, 12] * 3
    base, one, many = sent["adapters"][0], sent["adapters"][3], sent["adapters"][6]
    assert set(base) == {None} and set(one) == {"lora-0"}
    assert many[:6] == ["lora-0", "lora-1", "lora-2"] * 2          # distinct: each in turn


def test_workload_sends_twice_the_concurrency_at_once():
    load = workload("many", 64, 130, 256, 8, 1000)
    assert (load.num_prompts, load.max_concurrency, len(load.adapters)) == (128, 64, 8)
    assert load.input_len == (130, 130) and load.output_len == (256, 256) and load.request_rate == float("inf")


def test_plot_draws_one_line_per_setting(tmp_path):
    pytest.importorskip("matplotlib")
    points = [{"setting": s, "concurrency": c, "output_throughput": 10.0 * c, "p50_tpot_ms": 5.0 + c}
              for s in ("base", "one") for c in (1, 2, 4)]
    path = plot(points, tmp_path / "sweep.png")
    assert path is not None and path.stat().st_size > 0


def test_warm_up_requests_go_before_each_point_and_are_not_counted(sent):
    """--warmup N: N untimed requests of the point's own setting before it; the point still counts only its own."""
    points = sweep(Endpoint("http://x", "m"), ["one"], [2, 4], input_len=3, output_len=5, num_loras=3,
                   vocab_size=50, warmup=3)
    assert [p["completed"] for p in points] == [16, 16]          # 2c requests a point, at least 16
    assert [len(a) for a in sent["adapters"]] == [3 + 16, 3 + 16] and set(sent["adapters"][0]) == {"lora-0"}
