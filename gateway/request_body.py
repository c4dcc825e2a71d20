"""Reading a request's JSON body: its content type, a size limit enforced while reading, off-loop decoding.

A body with a Content-Type must say application/json (a charset may follow), so a web page cannot
drive the server with a form or text/plain post; a body with none is read as JSON, as FastAPI (so
vLLM) reads it. A body past the limit is refused with 413 as soon as its declared length or the bytes
read so far pass it, before the rest is buffered.
"""
from __future__ import annotations

from typing import TypeVar

from starlette.requests import Request

from gateway.api_error import APIError
from gateway.json_text import too_deep
from gateway.request_validation import decode_body

T = TypeVar("T")

BYTES_PER_TOKEN = 128        # JSON text of one prompt token, escapes included, with room to spare
MIN_BODY_BYTES = 1 << 20
UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"


def default_max_body_bytes(max_model_len: int) -> int:
    """The body limit when --max-request-body-bytes is not given: room for a full context of tokens."""
    return max(MIN_BODY_BYTES, max_model_len * BYTES_PER_TOKEN)


def check_content_type(request: Request) -> None:
    """415 unless the body is JSON or untyped."""
    content_type = request.headers.get("content-type")
    if content_type is None:
        return
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(UNSUPPORTED_MEDIA_TYPE, 415, param="Content-Type")


async def read_body(request: Request, limit: int) -> bytes:
    """The raw body, at most `limit` bytes; 413 as soon as it is known to be longer."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(limit)
    return bytes(body)


async def read_json(request: Request, type_: type[T], limit: int) -> T:
    """The body as `type_`: content type checked, size limited, nesting bounded, decoded and validated
    (request_validation.decode_body); nesting deeper than json_text.MAX_JSON_DEPTH is refused as decoding refuses
    a depth it cannot hold."""
    check_content_type(request)
    raw = await read_body(request, limit)
    if too_deep(raw):
        raise APIError("JSON decode error: the body is nested too deeply.")
    return decode_body(raw, type_)


def _too_large(limit: int) -> APIError:
    return APIError(f"The request body is larger than {limit} bytes, the limit of this server "
                    "(--max-request-body-bytes).", 413)
