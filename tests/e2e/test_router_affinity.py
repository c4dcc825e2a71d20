"""Adapter-affinity routing across two real loraplex servers, decided as the endpoint picker decides it.

Two servers on loopback register the same demo adapters with two GPU slots each; traffic makes different
adapters resident on each. The test scrapes their live /metrics and applies the picker's rules,
reimplemented here from llm-d/llm-d-router at ebab687927f5331c1b39defcb579a07951bce56c:
- parsing: the Prometheus text format (pkg/epp/framework/plugins/datalayer/source/metrics/datasource.go);
- extraction (pkg/epp/framework/plugins/datalayer/extractor/metrics/extractor.go, spec.go, loraspec.go): the
  queue, running and KV gauges from the series with the newest sample timestamp (the first when none has
  one); `vllm:lora_requests_info` from the series with the largest value; its adapter lists split on commas,
  each name trimmed, empty ones dropped; `max_lora` as an integer;
- scorers: pkg/epp/framework/plugins/scheduling/scorer/loraaffinity/lora_affinity.go,
  queuedepth/queue.go, kvcacheutilization/kvcache_utilization.go;
- the profile (pkg/epp/scheduling/scheduler_profile.go, picker/maxscore/picker.go): each score clamped to
  [0, 1], times its weight, summed per endpoint; the highest sum wins.
The weights are those deploy/kubernetes/epp.yaml configures. The prefix-cache scorer scores prompts the
picker has routed before; every prompt here is new to it, so it adds 0 everywhere and is left out.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from tests.e2e.conftest import REPO_ROOT, STARTUP_SECONDS, stop_and_check_cleanup
from tests.server_process import free_port, wait_until_healthy
from worker.demo import SERVED_MODEL_NAME

MAX_LORAS = 2
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)(?: (-?\d+))?$")
LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"\s*,?')
UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass
class Series:
    labels: dict[str, str]
    value: float
    timestamp_ms: int | None


def parse_families(text: str) -> dict[str, list[Series]]:
    """Family name -> its series, from the text format; every sample must belong to a declared family."""
    types: dict[str, str] = {}
    families: dict[str, list[Series]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert name not in types, f"family {name} declared twice"
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        match = SAMPLE.match(line)
        assert match, f"not a sample line: {line!r}"
        name, label_text, value, timestamp = match.groups()
        family = name if name in types else re.sub(r"_(bucket|sum|count)$", "", name)
        assert family in types, f"sample {name} outside any declared family"
        labels = {key: re.sub(r"\\[\\\"n]", lambda m: UNESCAPE[m.group(0)], raw)
                  for key, raw in LABEL.findall(label_text or "")}
        families.setdefault(family, []).append(
            Series(labels, float(value), None if timestamp is None else int(timestamp)))
    return families


@dataclass
class EndpointMetrics:
    """What the picker's metrics extractor keeps of one scrape (the fields its scorers read)."""
    waiting_queue_size: int
    running_requests_size: int
    kv_cache_usage_percent: float
    active_models: set[str]
    waiting_models: set[str]
    max_active_models: int
    lora_info_value: float


def newest_by_timestamp(series: list[Series]) -> Series:
    best, newest = None, -1
    for s in series:
        timestamp = s.timestamp_ms or 0
        if timestamp > newest:
            best, newest = s, timestamp
    return best


def adapter_set(csv: str) -> set[str]:
    return {name.strip() for name in csv.split(",") if name.strip()}


def extract(families: dict[str, list[Series]]) -> EndpointMetrics:
    lora = max(families["vllm:lora_requests_info"], key=lambda s: s.value)
    return EndpointMetrics(
        waiting_queue_size=int(newest_by_timestamp(families["vllm:num_requests_waiting"]).value),
        running_requests_size=int(newest_by_timestamp(families["vllm:num_requests_running"]).value),
        kv_cache_usage_percent=newest_by_timestamp(families["vllm:kv_cache_usage_perc"]).value,
        active_models=adapter_set(lora.labels.get("running_lora_adapters", "")),
        waiting_models=adapter_set(lora.labels.get("waiting_lora_adapters", "")),
        max_active_models=int(lora.labels["max_lora"]) if lora.labels.get("max_lora") else 0,
        lora_info_value=lora.value)


def lora_affinity_score(target: str, m: EndpointMetrics) -> float:
    if target in m.active_models:
        return 1.0
    if len(m.active_models) + len(m.waiting_models) < m.max_active_models:
        return 0.8
    if target in m.waiting_models:
        return 0.6
    return 0.0


def queue_scores(endpoints: list[EndpointMetrics]) -> list[float]:
    sizes = [m.waiting_queue_size for m in endpoints]
    low, high = min(sizes), max(sizes)
    return [1.0 if high == low else (high - size) / (high - low) for size in sizes]


def profile_weights() -> dict[str, float]:
    """The default profile's weight per scorer type, from the picker's ConfigMap in deploy/kubernetes/epp.yaml."""
    docs = yaml.safe_load_all((REPO_ROOT / "deploy" / "kubernetes" / "epp.yaml").read_text())
    config_map = next(d for d in docs if d["kind"] == "ConfigMap")
    config = yaml.safe_load(next(iter(config_map["data"].values())))
    types = {p.get("name", p["type"]): p["type"] for p in config["plugins"]}
    profile = next(p for p in config["schedulingProfiles"] if p["name"] == "default")
    return {types[p["pluginRef"]]: p.get("weight", 1.0) for p in profile["plugins"]}


def total_scores(target: str, endpoints: list[EndpointMetrics]) -> list[float]:
    weights = profile_weights()
    per_scorer = {
        "queue-scorer": queue_scores(endpoints),
        "kv-cache-utilization-scorer": [1 - m.kv_cache_usage_percent for m in endpoints],
        "lora-affinity-scorer": [lora_affinity_score(target, m) for m in endpoints],
        "prefix-cache-scorer": [0.0] * len(endpoints),     # no prompt here was routed before
    }
    assert set(weights) == set(per_scorer), "a scorer in deploy/kubernetes/epp.yaml the test does not model"
    return [sum(weights[name] * min(max(scores[i], 0.0), 1.0) for name, scores in per_scorer.items())
            for i in range(len(endpoints))]


def pick(target: str, urls: list[str]) -> tuple[str, list[EndpointMetrics]]:
    """The server the picker sends a request for `target` to, from a scrape of each server's /metrics."""
    endpoints = [extract(parse_families(httpx.get(f"{url}/metrics", timeout=10).text)) for url in urls]
    scores = total_scores(target, endpoints)
    best = max(scores)
    assert scores.count(best) == 1, f"a tie for {target}: {scores}"
    return urls[scores.index(best)], endpoints


def complete(url: str, adapter: str) -> None:
    response = httpx.post(f"{url}/v1/completions", timeout=60,
                          json={"model": adapter, "prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text


def wait_for_residents(url: str, expected: set[str], timeout_s: float = 20) -> EndpointMetrics:
    """The server's scraped metrics once its running_lora_adapters is `expected` (stats arrive as they change)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = extract(parse_families(httpx.get(f"{url}/metrics", timeout=10).text))
        if metrics.active_models == expected or time.monotonic() > deadline:
            assert metrics.active_models == expected
            return metrics
        time.sleep(0.05)


@pytest.fixture(scope="module")
def two_servers(demo, tmp_path_factory):
    """Two servers with the demo adapters registered and two GPU slots each, nothing resident yet."""
    modules = [f"{name}={path}" for name, path in demo.adapters.items()]
    env = {key: value for key, value in os.environ.items() if key != "VLLM_API_KEY"}
    started = []
    try:
        for _ in range(2):
            port, log_path = free_port(), tmp_path_factory.mktemp("router-server") / "server.log"
            command = [sys.executable, "-m", "gateway", "serve", "--model", str(demo.model_dir),
                       "--served-model-name", SERVED_MODEL_NAME, "--lora-modules", *modules,
                       "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                       "--max-loras", str(MAX_LORAS), "--uvicorn-log-level", "warning"]
            with open(log_path, "wb") as log:
                process = subprocess.Popen(command, cwd=REPO_ROOT, env={**env, "PYTHONUNBUFFERED": "1"},
                                           stdout=log, stderr=subprocess.STDOUT)
            started.append((process, f"http://127.0.0.1:{port}", Path(log_path)))
        for process, url, log_path in started:
            wait_until_healthy(process, url, log_path, STARTUP_SECONDS)
        yield [url for _, url, _ in started]
    finally:
        for process, _, log_path in started:
            if process.poll() is None:
                stop_and_check_cleanup(process, log_path)


def test_picker_sends_each_adapter_to_the_server_that_holds_it(two_servers):
    a, b = two_servers
    for url in (a, b):
        idle = wait_for_residents(url, set())
        assert idle.max_active_models == MAX_LORAS and idle.waiting_models == set()
        assert abs(idle.lora_info_value - time.time()) < 60        # the value is a Unix time, as vLLM's

    complete(a, "doctests")
    complete(b, "asyncio")
    wait_for_residents(a, {"doctests"})
    wait_for_residents(b, {"asyncio"})

    assert pick("doctests", [a, b])[0] == a
    assert pick("asyncio", [a, b])[0] == b
    endpoints = [extract(parse_families(httpx.get(f"{url}/metrics", timeout=10).text)) for url in (a, b)]
    assert [lora_affinity_score("chat", m) for m in endpoints] == [0.8, 0.8]   # room on both


def test_a_server_with_every_slot_taken_loses_an_adapter_it_does_not_hold(two_servers):
    a, b = two_servers
    complete(a, "doctests")
    complete(b, "asyncio")
    complete(a, "chat")
    wait_for_residents(a, {"doctests", "chat"})           # both of a's slots, requests finished

    chosen, (on_a, on_b) = pick("docstrings", [a, b])
    assert (lora_affinity_score("docstrings", on_a), lora_affinity_score("docstrings", on_b)) == (0.0, 0.8)
    assert chosen == b
    assert pick("chat", [a, b])[0] == a
    complete(chosen, "docstrings")
    wait_for_residents(b, {"asyncio", "docstrings"})
