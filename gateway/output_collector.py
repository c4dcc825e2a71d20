"""OutputCollector: one request's worker outputs, merged while its consumer is behind.

The worker client puts each RequestOutput as it arrives; the request's stream takes them. When the stream
is slower than the worker (a busy event loop, a slow client), the outputs waiting for it are taken as one:
their tokens and logprobs joined, the finish of the last. So a stream that falls behind catches up with one
chunk for several tokens instead of one chunk, one detokenization and one socket write per token, as vLLM's
output collector merges the deltas its consumer has not taken yet. A stream that keeps up sees every output
on its own. An output that carries an error is never merged into earlier ones: their tokens are delivered
first, the error after them. What must count every output (the request's metrics timer, as vLLM times each
engine step) sees each one as it arrives, through `on_arrival`.
"""
from __future__ import annotations

import asyncio
from typing import Callable

import msgspec

from worker.ipc.messages import RequestOutput


class OutputCollector:
    """The outputs of one request not yet taken by its stream."""

    __slots__ = ("_loop", "_on_arrival", "_pending", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, on_arrival: Callable[[RequestOutput], None] | None = None):
        self._loop = loop
        self._on_arrival = on_arrival            # sees every output as it comes, before any merge (metrics)
        self._pending: list[RequestOutput] = []
        self._waiter: asyncio.Future[None] | None = None    # set while the stream waits in take()

    def put(self, output: RequestOutput) -> None:
        if self._on_arrival is not None:
            self._on_arrival(output)
        self._pending.append(output)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self) -> RequestOutput:
        """The next output: every output waiting, merged, up to (not including) one that carries an error."""
        while not self._pending:
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        pending = self._pending
        if len(pending) == 1:
            self._pending = []
            return pending[0]
        count = next((i for i, output in enumerate(pending) if output.error is not None), len(pending)) or 1
        self._pending = pending[count:]
        return merge_outputs(pending[:count])


def merge_outputs(outputs: list[RequestOutput]) -> RequestOutput:
    """One output equal to `outputs` in order: tokens and logprobs joined, the last one's finish, and the first
    one's once-per-request fields (prompt logprobs, queue time) where the last one has none."""
    first, last = outputs[0], outputs[-1]
    token_ids: list[int] = []
    for output in outputs:
        token_ids += output.new_token_ids
    changes: dict[str, object] = {"new_token_ids": token_ids}
    if any(output.new_logprobs is not None for output in outputs):
        changes["new_logprobs"] = [entry for output in outputs for entry in output.new_logprobs or ()]
    for name in _ONCE_FIELDS:
        if name not in changes and getattr(last, name) is None and (value := getattr(first, name)) is not None:
            changes[name] = value
    return msgspec.structs.replace(last, **changes)


# Fields that default to None: a later output leaves them unset when the first one carried them.
_ONCE_FIELDS = tuple(name for name, default in zip(RequestOutput.__struct_fields__[::-1],
                                                  RequestOutput.__struct_defaults__[::-1]) if default is None)
