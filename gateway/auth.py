"""vLLM's --api-key: /v1 paths need `Authorization: Bearer <key>`, and other routes may ask whether a
request carries it.

/tokenize and /detokenize stay open as in vLLM, and so do the render routes (vLLM guards them under /v1): they
tokenize as /tokenize does and run nothing, and a router's tokenizer (llm-d's token-producer) calls them without a
key. A request without the key never makes any of them register an adapter from a --lora-dir
(ServingContext.may_load_adapters).
"""
from __future__ import annotations

import hashlib
import hmac

from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

UNAUTHORIZED = b'{"error":"Unauthorized"}'
OPEN_PATHS = frozenset(("/v1/completions/render", "/v1/chat/completions/render"))   # /v1 paths without the key


class APIKey:
    """The server's key, kept as a digest and compared in constant time."""

    def __init__(self, key: str):
        self._digest = hashlib.sha256(key.encode()).digest()

    def accepts(self, scope: Scope) -> bool:
        """True when the request's Authorization header is `Bearer <key>`."""
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            hashlib.sha256(token.encode()).digest(), self._digest)


class AuthMiddleware:
    """401 for a /v1 request without the key, as vLLM answers it."""

    def __init__(self, app: ASGIApp, api_key: APIKey):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1") \
                and scope["path"] not in OPEN_PATHS and not self.api_key.accepts(scope):
            await Response(UNAUTHORIZED, 401, media_type="application/json")(scope, receive, send)
            return
        await self.app(scope, receive, send)
