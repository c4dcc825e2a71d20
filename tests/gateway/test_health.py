"""/health and /ping: 200 while the worker serves, 503 once it is gone; /ping answers GET and POST alike, as
vLLM's SageMaker route does (vllm/entrypoints/serve/sagemaker/api_router.py, vLLM 0.33.0)."""
from __future__ import annotations

import pytest

from gateway_app import serve
from worker.ipc.messages import Stats


@pytest.mark.parametrize("method, path", [("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")])
async def test_health_routes_follow_the_worker(method, path):
    async with serve() as (http, client, app):
        serving = await http.request(method, path)
        client.healthy = False
        gone = await http.request(method, path)
    assert (serving.status_code, serving.content) == (200, b"")
    assert (gone.status_code, gone.content) == (503, b"")


@pytest.mark.parametrize("loading", [0, 7])
async def test_health_says_how_many_adapters_are_still_loading_and_stays_200(loading):
    async with serve() as (http, client, app):
        client.stats = Stats(num_running=0, num_waiting=0, num_adapters_loading=loading)
        response = await http.get("/health")
    assert (response.status_code, response.content) == (200, b"")
    assert response.headers["x-loraplex-adapters-loading"] == str(loading)


async def test_ping_needs_no_api_key():
    async with serve(api_key="secret") as (http, client, app):
        assert (await http.get("/ping")).status_code == 200
        assert (await http.get("/v1/models")).status_code == 401


async def test_metrics_are_gzipped_for_a_scraper_that_accepts_it():
    """A page of at least GZIP_MIN_BYTES goes gzip-compressed to a scraper sending Accept-Encoding: gzip (the
    endpoint picker's Go client does), as it is to one that does not; the text is the same either way."""
    from gateway.routes.health import GZIP_MIN_BYTES
    async with serve() as (http, client, app):
        zipped = await http.get("/metrics", headers={"Accept-Encoding": "gzip"})
        plain = await http.get("/metrics", headers={"Accept-Encoding": "identity"})
    assert len(plain.content) >= GZIP_MIN_BYTES and "content-encoding" not in plain.headers
    assert zipped.headers["content-encoding"] == "gzip" and zipped.headers["vary"] == "Accept-Encoding"
    def series(text: str) -> list[str]:     # every line but its value (a timestamp gauge moves between scrapes)
        return [line.rsplit(" ", 1)[0] for line in text.splitlines()]
    assert series(zipped.text) == series(plain.text) and "vllm:num_requests_running" in zipped.text   # inflated
    assert int(zipped.headers["content-length"]) < len(plain.content) / 3
