"""GET /health (200 empty, 503 once the worker is gone), GET and POST /ping (the same answer: SageMaker's
health route, as vLLM serves it), /version and /metrics.

The health answer carries ADAPTERS_LOADING_HEADER: how many adapters the worker is still reading from disk into
host memory (the --lora-modules adapters after startup, then those requests need). The server serves meanwhile, so
the status stays 200.
"""
from __future__ import annotations

import gzip
from importlib.metadata import PackageNotFoundError, version

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.responses import json_response
from gateway.serving import ServingContext

ADAPTERS_LOADING_HEADER = "x-loraplex-adapters-loading"
PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"
GZIP_MIN_BYTES = 4096          # smaller pages go as they are


async def health(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    return Response(status_code=200 if server.client.healthy else 503,
                    headers={ADAPTERS_LOADING_HEADER: str(server.client.stats.num_adapters_loading)})


async def show_version(request: Request) -> Response:
    try:
        current = version("loraplex")
    except PackageNotFoundError:
        current = "unknown"
    return json_response({"version": current})


async def metrics(request: Request) -> Response:
    """Prometheus text; gzip (level 1) when the scraper accepts it and the page is large, as prometheus_client
    serves it: with 1,000 adapters the page is ~320 kB, ~16 kB compressed (BENCHMARKS.md), and the endpoint
    picker scrapes every 50 ms with Go's client, which asks for gzip."""
    server: ServingContext = request.app.state.server
    body = server.metrics.render(server.client.stats).encode()
    if len(body) >= GZIP_MIN_BYTES and "gzip" in request.headers.get("accept-encoding", ""):
        return Response(gzip.compress(body, compresslevel=1), media_type=PROMETHEUS_TEXT,
                        headers={"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})
    return Response(body, media_type=PROMETHEUS_TEXT, headers={"Vary": "Accept-Encoding"})


routes = [Route("/health", health, methods=["GET"]), Route("/ping", health, methods=["GET", "POST"]),
          Route("/version", show_version, methods=["GET"]),
          Route("/metrics", metrics, methods=["GET"])]
