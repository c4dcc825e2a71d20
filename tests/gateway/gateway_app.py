"""The gateway app in process on FakeWorkerClient, with any GatewayConfig field (and the worker's LoRA and cache
configs) set, for the hardening tests."""
from __future__ import annotations

from contextlib import asynccontextmanager

import httpx

from fake_worker_client import FakeWorkerClient, build_tokenizer
from gateway.app import build_app
from gateway.config import GatewayConfig, LoRAModulePath
from worker.config import CacheConfig, LoRAConfig, ModelConfig, WorkerConfig

TOKENIZER = build_tokenizer()
BASE, ADAPTER = "base", "sql"
ANSWER_IDS = TOKENIZER.encode("hello world")


@asynccontextmanager
async def serve(client: FakeWorkerClient | None = None, *, lora: LoRAConfig = LoRAConfig(),
                cache: CacheConfig = CacheConfig(), **config_fields):
    """(http client, fake worker client, app) for one app whose config has `config_fields`, and whose worker
    config has `lora` and `cache`."""
    client = client or FakeWorkerClient(lambda request: list(ANSWER_IDS))
    worker = WorkerConfig(ModelConfig("/models/base"), lora=lora, cache=cache)
    config = GatewayConfig(**{"worker": worker, "served_model_names": (BASE,),
                              "lora_modules": (LoRAModulePath(ADAPTER, "/adapters/sql"),), **config_fields})
    app = build_app(config, client, TOKENIZER)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway",
                                     timeout=60) as http:
            yield http, client, app


def error_of(response: httpx.Response) -> tuple[int, str, str | None]:
    """(status, message, param) of a response in vLLM's error envelope, checking the envelope's shape."""
    body = response.json()
    assert list(body) == ["error"] and sorted(body["error"]) == ["code", "message", "param", "type"], body
    assert body["error"]["code"] == response.status_code
    return response.status_code, body["error"]["message"], body["error"]["param"]
