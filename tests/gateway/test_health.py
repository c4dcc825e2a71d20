"""/health and /ping: 200 while the worker serves, 503 once it is gone; /ping answers GET and POST alike, as
vLLM's SageMaker route does (vllm/entrypoints/serve/sagemaker/api_router.py, vLLM 0.33.0)."""
from __future__ import annotations

import pytest

from gateway_app import serve


@pytest.mark.parametrize("method, path", [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")])
async def test_health_routes_follow_the_worker(method, path):
    async with serve() as (http, client, app):
        serving = await http.request(method, path)
        client.healthy = False
        gone = await http.request(method, path)
    assert (serving.status_code, serving.content) == (200, b"")
    assert (gone.status_code, gone.content) == (503, b"")


async def test_ping_needs_no_api_key():
    async with serve(api_key="secret") as (http, client, app):
        assert (await http.get("/ping")).status_code == 200
        assert (await http.get("/v1/models")).status_code == 401
