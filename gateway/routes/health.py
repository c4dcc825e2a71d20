"""GET /health (200 empty, 503 once the worker is gone), GET and POST /ping (the same answer: SageMaker's
health route, as vLLM serves it), /version and /metrics."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.responses import json_response
from gateway.serving import ServingContext

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


async def health(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    return Response(status_code=200 if server.client.healthy else 503)


async def show_version(request: Request) -> Response:
    try:
        current = version("loraplex")
    except PackageNotFoundError:
        current = "unknown"
    return json_response({"version": current})


async def metrics(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    return Response(server.metrics.render(server.client.stats), media_type=PROMETHEUS_TEXT)


routes = [Route("/health", health, methods=["GET"]), Route("/ping", health, methods=["GET", "POST"]),
          Route("/version", show_version, methods=["GET"]),
          Route("/metrics", metrics, methods=["GET"])]
