"""One real server for the whole e2e session: gateway + worker processes on the embedded demo model.

The model is tests/conftest.py's `demo`, the demo's fast size. The server is started with vLLM's flags,
all four demo adapters and only two LoRA slots (so adapters must take turns), and an API key that every
client passes. `reference` runs the same model and adapters in this process with the offline
Engine, the independent answer the server's greedy tokens must match.
"""
from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import psutil
import pytest
import tokenizers

from tests.server_process import free_port, wait_until_healthy
from worker.demo import ADAPTERS, SERVED_MODEL_NAME, DemoAssets

REPO_ROOT = Path(__file__).resolve().parents[2]
API_KEY = "e2e-secret"
PINNED_ADAPTER = "docstrings"        # given in vLLM's JSON form of --lora-modules, pinned
MAX_LORAS = 2
STARTUP_SECONDS = 120
# Pooled connections expire on the client well before uvicorn's 5 s keep-alive timeout closes them
# on the server, so no request is ever sent on a connection the server is closing.
CLIENT_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=1.0)
CHAT_TEMPLATE = "<|im_start|>{role}\n{content}<|im_end|>\n"
GENERATION_PROMPT = "<|im_start|>assistant\n"


@dataclass
class Server:
    url: str
    api_key: str
    demo: DemoAssets
    log_path: Path         # the gateway's and the worker's output

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=60, limits=CLIENT_LIMITS)

    @functools.cached_property
    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0, timeout=60,
                             http_client=openai.DefaultHttpxClient(limits=CLIENT_LIMITS))

    def async_openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0, timeout=60,
                                  http_client=openai.DefaultAsyncHttpxClient(limits=CLIENT_LIMITS))

    def health_status(self) -> int:
        return httpx.get(f"{self.url}/health", timeout=10).status_code

    def metric(self, name: str, labels: str = "") -> float:
        """The value of one sample on /metrics; `labels` is a substring its label set must contain."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        pattern = re.compile(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", re.MULTILINE)
        values = [float(value) for found_labels, value in pattern.findall(text) if labels in found_labels]
        return values[0] if values else 0.0


@dataclass
class Reference:
    """The offline engine and tokenizer on the served model: what the server must answer."""
    engine: object                 # worker.engine.Engine
    tokenizer: tokenizers.Tokenizer
    _count: int = 0

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The demo chat template rendered by hand, then encoded."""
        text = "".join(CHAT_TEMPLATE.format(**m) for m in messages) + GENERATION_PROMPT
        return self.encode(text)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def generate(self, prompt_ids: list[int], adapter: str | None, **params) -> list:
        """The outputs of one request run alone; params are SamplingParams fields (greedy by default)."""
        from worker.ipc.messages import SamplingParams

        self._count += 1
        request_id = f"ref-{self._count}"
        self.engine.add_request(request_id, prompt_ids, SamplingParams(**{"temperature": 0.0, **params}), adapter)
        outputs = []
        while self.engine.has_unfinished():
            outputs += [o for o in self.engine.step() if o.request_id == request_id]
        return outputs

    def tokens(self, prompt_ids: list[int], adapter: str | None, **params) -> list[int]:
        return [t for o in self.generate(prompt_ids, adapter, **params) for t in o.new_token_ids]


def server_command(demo: DemoAssets, port: int) -> list[str]:
    modules = [f"{name}={path}" for name, path in demo.adapters.items() if name != PINNED_ADAPTER]
    modules.append(json.dumps({"name": PINNED_ADAPTER, "path": str(demo.adapters[PINNED_ADAPTER]), "pinned": True}))
    return [sys.executable, "-m", "gateway", "serve", "--model", str(demo.model_dir),
            "--served-model-name", SERVED_MODEL_NAME, "--lora-modules", *modules,
            "--host", "127.0.0.1", "--port", str(port), "--device", "cpu", "--max-loras", str(MAX_LORAS),
            "--api-key", API_KEY, "--uvicorn-log-level", "warning"]


def shm_segments(pid: int) -> list[str]:
    """The shared-memory rings a gateway process created (named lpx_<pid>_...)."""
    return sorted(p.name for p in Path("/dev/shm").glob(f"lpx_{pid}_*"))


def stop_and_check_cleanup(process: subprocess.Popen, log_path: Path) -> None:
    """SIGTERM the gateway; it must exit 0, take its worker with it and remove its rings."""
    children = psutil.Process(process.pid).children(recursive=True)
    assert children, "the gateway has no worker process"
    process.terminate()
    code = process.wait(30)
    _, alive = psutil.wait_procs(children, timeout=15)
    for leftover in alive:
        leftover.kill()
    assert not alive, f"processes left after the server stopped: {[p.pid for p in alive]}"
    assert shm_segments(process.pid) == [], "shared memory left after the server stopped"
    assert code == 0, f"the server exited with {code}:\n{log_path.read_text()}"


@pytest.fixture(scope="session")
def server(demo, tmp_path_factory) -> Server:
    port = free_port()
    log_path = tmp_path_factory.mktemp("e2e-server") / "server.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}   # test_models_api
    env.pop("VLLM_API_KEY", None)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(server_command(demo, port), cwd=REPO_ROOT, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url, log_path, STARTUP_SECONDS)
        yield Server(url, API_KEY, demo, log_path)
    finally:
        if process.poll() is None:
            stop_and_check_cleanup(process, log_path)


@pytest.fixture(scope="session")
def reference(demo) -> Reference:
    from worker.config import CacheConfig, LoRAConfig, ModelConfig, WorkerConfig
    from worker.engine import Engine

    config = WorkerConfig(ModelConfig(str(demo.model_dir)), cache=CacheConfig(num_gpu_blocks_override=512),
                          lora=LoRAConfig(max_loras=len(ADAPTERS)), device="cpu")
    engine = Engine(config)
    for name, path in demo.adapters.items():
        engine.add_adapter(name, str(path))
    return Reference(engine, tokenizers.Tokenizer.from_file(str(demo.model_dir / "tokenizer.json")))
