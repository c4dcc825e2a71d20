"""The gateway's Starlette application: build_app, its lifespan, its routes and error envelopes."""
from __future__ import annotations

import gc
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response

from gateway.api_error import APIError
from gateway.auth import AuthMiddleware
from gateway.config import GatewayConfig
from gateway.responses import json_response
from gateway.routes import adapters, chat, completions, health, lora, models, render, tokenize
from gateway.serving import ServingContext
from gateway.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def build_app(config: GatewayConfig, client: Any, tokenizer: Tokenizer | None = None) -> Starlette:
    """The application; its lifespan starts `client` (the worker) and shuts it down."""
    server = ServingContext(config, client, tokenizer or Tokenizer.from_dir(config.tokenizer_path))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            await server.start()
        except Exception as e:
            logger.error("Startup failed: %s", e)
            await client.shutdown()
            raise
        freeze_startup_heap()
        try:
            yield
        finally:
            await client.shutdown()

    runtime_loading = lora.routes if config.allow_runtime_lora_updating else []
    if runtime_loading:
        logger.warning("Runtime LoRA loading is on%s.", "" if config.worker.lora.lora_dirs else
                       " and may read any path (no --lora-dir given)")
    app = Starlette(
        routes=[*completions.routes, *chat.routes, *render.routes, *models.routes, *runtime_loading,
                *adapters.routes, *tokenize.routes, *health.routes],
        middleware=[Middleware(AuthMiddleware, api_key=server.api_key)] if server.api_key else [],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan)
    app.state.server = server
    return app


def freeze_startup_heap() -> None:
    """Leave what startup built (modules, the tokenizer, the app) out of every later garbage collection, as vLLM's
    server does: the oldest generation's collections then walk only what serving allocates, instead of pausing
    every stream for tens of milliseconds."""
    gc.collect()
    gc.freeze()


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return json_response(exc.body(), exc.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (an unknown route, a method the route does not take) in vLLM's envelope, with
    their headers (a 405's Allow)."""
    assert isinstance(exc, HTTPException)
    response = json_response(APIError(exc.detail, exc.status_code).body(), exc.status_code)
    response.headers.update(exc.headers or {})
    return response


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("Unhandled error", exc_info=exc)
    return json_response(APIError(str(exc), 500).body(), 500)
