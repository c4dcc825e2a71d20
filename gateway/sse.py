"""Streaming to the client: Server-Sent Events, merged choice streams, disconnects.

A stream is `data: {json}\\n\\n` events ending with `data: [DONE]\\n\\n`. An error after the stream
has started is sent as one `data: {"error": {...}}` event before [DONE]. `EventStreamResponse` writes each
event as it comes, straight to the ASGI `send`, beside a task that waits for the client's disconnect; on a
disconnect it cancels the stream, and the cancellation reaches every worker stream underneath, whose cleanup
(closing WorkerClient.generate(), which aborts the request in the worker) runs shielded.

On shutdown nothing cancels a stream from here: the server drains instead (WorkerClient.drain), and a
stream it has to end gets an error event, then [DONE], like any other.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import Any, AsyncIterator, Awaitable, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.api_error import APIError
from gateway.json_text import encode

logger = logging.getLogger(__name__)

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
_END = object()
# What sse-starlette sent, which clients and proxies have seen from this server: no caching, no buffering.
SSE_HEADERS = {"Cache-Control": "no-store", "Connection": "keep-alive", "X-Accel-Buffering": "no"}


def event(payload: dict[str, Any]) -> bytes:
    return b"data: " + encode(payload) + b"\n\n"


def sse_response(chunks: AsyncIterator[dict[str, Any]]) -> EventStreamResponse:
    """Stream `chunks` as SSE events, then [DONE]."""
    return EventStreamResponse(_events(chunks))


class EventStreamResponse(StreamingResponse):
    """`text/event-stream` of pre-encoded events; a client that disconnects cancels the stream."""

    def __init__(self, events: AsyncIterator[bytes]):
        super().__init__(events, headers=SSE_HEADERS, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async with anyio.create_task_group() as group:
            group.start_soon(_cancel_on_disconnect, receive, group.cancel_scope)
            events = self.body_iterator
            try:
                async for data in events:
                    await send({"type": "http.response.body", "body": data, "more_body": True})
            finally:
                with anyio.CancelScope(shield=True):
                    await events.aclose()
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            group.cancel_scope.cancel()


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async with aclosing(chunks):
        try:
            async for chunk in chunks:
                yield event(chunk)
        except APIError as e:
            yield event(e.body())
        except Exception as e:
            logger.exception("Streaming failed")
            yield event(APIError(str(e), 500).body())
    yield DONE


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(stream index, item) for the items of all `streams` as they arrive; closing it closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(i, stream, queue)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(index: int, stream: AsyncIterator[T], queue: asyncio.Queue[Any]) -> None:
    try:
        async with aclosing(stream):
            async for item in stream:
                queue.put_nowait((index, item))
    except Exception as e:
        queue.put_nowait(e)
    finally:
        queue.put_nowait(_END)


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work` (a non-streaming response); None if the client disconnected first, cancelling it."""
    work_task = asyncio.ensure_future(work)
    work_task.add_done_callback(lambda done: done.cancelled() or done.exception())   # read even if we are cancelled
    watch_task = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
        if not work_task.done():
            work_task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(work_task, return_exceptions=True)
    return None if work_task.cancelled() else work_task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
