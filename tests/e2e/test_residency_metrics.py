"""The residency metrics of vLLM's open #54830 (as llm-d-router's open #2792 reads them) on a real server, across
adapter loads, requests, evictions, a pin and unloads: one `vllm:lora_adapter_loaded` series per loaded adapter,
gone once the adapter is unloaded, and the counts beside it."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import REPO_ROOT, STARTUP_SECONDS, stop_and_check_cleanup
from tests.e2e.test_router_affinity import parse_families
from tests.server_process import free_port, wait_until_healthy
from worker.demo import ADAPTERS, SERVED_MODEL_NAME

MAX_LORAS = 2
RANK = {spec.name: spec.rank for spec in ADAPTERS}
A, B, C, D = (spec.name for spec in ADAPTERS)


@pytest.fixture(scope="module")
def url(demo, tmp_path_factory):
    """A server with runtime loading on, two GPU slots and no adapter yet."""
    port, log_path = free_port(), tmp_path_factory.mktemp("residency-server") / "server.log"
    env = {key: value for key, value in os.environ.items() if key != "VLLM_API_KEY"}
    command = [sys.executable, "-m", "gateway", "serve", "--model", str(demo.model_dir),
               "--served-model-name", SERVED_MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
               "--device", "cpu", "--max-loras", str(MAX_LORAS), "--uvicorn-log-level", "warning"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                   env={**env, "PYTHONUNBUFFERED": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url, Path(log_path), STARTUP_SECONDS)
        yield url
    finally:
        if process.poll() is None:
            stop_and_check_cleanup(process, Path(log_path))


def residency(url: str) -> tuple[dict[str, tuple[str, str, int]], tuple[float, float, float]]:
    """{adapter: (level, pinned, rank)} of the loaded series, and (GPU count, CPU count, GPU slots)."""
    families = parse_families(httpx.get(f"{url}/metrics", timeout=10).text)
    loaded = {}
    for series in families.get("vllm:lora_adapter_loaded", []):
        labels = series.labels
        assert series.value == 1.0 and labels["model_name"] == SERVED_MODEL_NAME and labels["engine"] == "0"
        assert labels["adapter_name"] not in loaded, "two series for one adapter"
        loaded[labels["adapter_name"]] = (labels["level"], labels["pinned"], int(labels["rank"]))
    counts = tuple(families[name][0].value for name in ("vllm:num_gpu_loaded_lora_adapters",
                                                        "vllm:num_cpu_loaded_lora_adapters",
                                                        "vllm:max_gpu_lora_adapters"))
    return loaded, counts


def wait_for(url: str, expected: dict[str, tuple[str, str, int]], timeout_s: float = 20):
    """The residency once the loaded series are `expected` (stats reach the gateway as they change)."""
    deadline = time.monotonic() + timeout_s
    while True:
        loaded, counts = residency(url)
        if loaded == expected or time.monotonic() > deadline:
            assert loaded == expected
            return counts


def load(url: str, name: str, demo, pinned: bool = False) -> None:
    body = {"lora_name": name, "lora_path": str(demo.adapters[name]), "pinned": pinned}
    response = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
    assert response.status_code == 200, response.text


def complete(url: str, model: str) -> None:
    response = httpx.post(f"{url}/v1/completions", timeout=60,
                          json={"model": model, "prompt": "hello", "max_tokens": 2, "temperature": 0})
    assert response.status_code == 200, response.text


def test_series_follow_loads_evictions_pins_and_unloads(url, demo):
    assert wait_for(url, {}) == (0, 0, MAX_LORAS)       # present from startup, before any adapter
    for name in (A, B, C):
        load(url, name, demo)
    assert wait_for(url, {}) == (0, 0, MAX_LORAS)       # registered, nothing read yet
    complete(url, A)
    complete(url, B)
    assert wait_for(url, {A: ("gpu", "false", RANK[A]), B: ("gpu", "false", RANK[B])}) == (2, 2, MAX_LORAS)
    complete(url, C)                                    # A, released longest ago, leaves its slot for C
    assert wait_for(url, {A: ("cpu", "false", RANK[A]), B: ("gpu", "false", RANK[B]),
                          C: ("gpu", "false", RANK[C])}) == (2, 3, MAX_LORAS)
    load(url, D, demo, pinned=True)
    complete(url, D)                                    # B goes; D stays in its slot whatever comes next
    complete(url, A)
    complete(url, B)
    assert wait_for(url, {A: ("cpu", "false", RANK[A]), B: ("gpu", "false", RANK[B]), C: ("cpu", "false", RANK[C]),
                          D: ("gpu", "true", RANK[D])}) == (2, 4, MAX_LORAS)
    for name in (B, D):
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60).status_code == 200
    assert wait_for(url, {A: ("cpu", "false", RANK[A]), C: ("cpu", "false", RANK[C])}) == (0, 2, MAX_LORAS)
    text = httpx.get(f"{url}/metrics", timeout=10).text
    assert f'adapter_name="{B}"' not in text and f'adapter_name="{D}"' not in text
