"""The gateway's Starlette application: build_app, its lifespan, and the context routes share."""
from __future__ import annotations

import hashlib
import hmac
import logging
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any, AsyncIterator

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.adapters import AdapterRegistry
from gateway.config import GatewayConfig
from gateway.metrics import Metrics
from gateway.protocol import APIError, check_token_ids
from gateway.routes import adapters, chat, completions, health, lora, models, tokenize
from gateway.sse import json_response
from gateway.tokenizer import Delta, IncrementalDetokenizer, Tokenizer
from worker.ipc.messages import AddRequest, SamplingParams

logger = logging.getLogger(__name__)


class ServingContext:
    """What the routes share: the worker client, the tokenizer, the served names, the metrics."""

    def __init__(self, config: GatewayConfig, client: Any, tokenizer: Tokenizer):
        self.config = config
        self.client = client                     # gateway.worker_client.WorkerClient or a stand-in
        self.tokenizer = tokenizer
        self.models = AdapterRegistry(config.served_names, config.model, config.lora_dirs)
        self.metrics = Metrics(config.served_names[0], config.max_loras)

    @property
    def max_model_len(self) -> int:
        return self.client.ready.max_model_len

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may use: known to both the tokenizer and the model."""
        return min(self.tokenizer.vocab_size, self.client.ready.vocab_size)

    async def start(self) -> None:
        """Start the worker, then load the --lora-modules adapters; raises with the worker's message."""
        await self.client.start()
        for module in self.config.lora_modules:
            result = await self.client.adapter_command("load", module.name, module.path, pinned=module.pinned)
            if not result.ok:
                raise RuntimeError(f"Failed to load LoRA adapter '{module.name}' from {module.path}: "
                                   f"{result.message}")
            self.models.add(module.name, module.path, module.base_model_name, module.pinned)
        logger.info("Serving %s (max_model_len %d) with adapters %s", ", ".join(self.config.served_names),
                    self.max_model_len, [m.name for m in self.config.lora_modules])

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        """Prompt token ids, checked against the vocabulary; a 400 for an empty prompt."""
        ids = self.tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else prompt
        check_token_ids(ids, self.vocab_size)
        return ids

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       lora_name: str | None, detokenizer: IncrementalDetokenizer) -> AsyncIterator[Delta]:
        """One choice as text deltas, until the worker finishes it or a stop string ends it.

        Leaving early (a stop string, a closed stream, a disconnect) closes the worker's stream,
        which aborts the request in the worker.
        """
        timer = self.metrics.start_request(lora_name, len(prompt_ids))
        outputs = self.client.generate(AddRequest(request_id, prompt_ids, params, lora_name))
        reason = "abort"
        try:
            async for output in outputs:
                timer.on_tokens(len(output.new_token_ids))
                delta = detokenizer.update(output)
                reason = delta.finish_reason or reason
                yield delta
                if delta.finish_reason is not None:
                    return
        except Exception:
            reason = "error"
            raise
        finally:
            timer.finish(reason)
            with anyio.CancelScope(shield=True):
                await outputs.aclose()


class AuthMiddleware:
    """vLLM's --api-key check: /v1 paths need `Authorization: Bearer <key>`, else 401."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.key_digest = hashlib.sha256(api_key.encode()).digest()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1") \
                and not self._authorized(scope):
            await json_response({"error": "Unauthorized"}, 401)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            hashlib.sha256(token.encode()).digest(), self.key_digest)


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
        try:
            yield
        finally:
            await client.shutdown()

    if not config.lora_dirs:
        logger.warning("Runtime LoRA loading may read any path (no --lora-dir given).")
    app = Starlette(
        routes=[*completions.routes, *chat.routes, *models.routes, *lora.routes, *adapters.routes,
                *tokenize.routes, *health.routes],
        middleware=[Middleware(AuthMiddleware, api_key=config.api_key)] if config.api_key else [],
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _internal_error},
        lifespan=lifespan)
    app.state.server = server
    return app


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return json_response(exc.body(), exc.status)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = APIError(exc.detail, exc.status_code, HTTPStatus(exc.status_code).phrase)
    return json_response(error.body(), exc.status_code)


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("Unhandled error", exc_info=exc)
    return json_response(APIError(str(exc), 500).body(), 500)
