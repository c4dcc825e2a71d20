"""Spawns the worker process, owns the two shared-memory rings, and demultiplexes its outputs.

Everything runs on the gateway's event loop: outputs are read only in the reader callback of the
worker -> gateway ring's wakeup fd, the process sentinel reports the worker's death, and sends that
find the gateway -> worker ring full wait in order in a backlog flushed by that ring's space wakeup.
This module must never import torch.

Two ends: `drain()` then `shutdown()` is the orderly one (unhealthy at once, requests in flight given
time, then the rest ended with a 503, the worker asked to exit); a worker that exits unasked ends every
request in flight with a 500 error and leaves `failed` set, which the server turns into a non-zero exit.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import multiprocessing
from multiprocessing.process import BaseProcess
from typing import AsyncIterator, Callable

import msgspec

from gateway.output_collector import OutputCollector
from worker.__main__ import run_worker
from worker.config import WorkerConfig
from worker.ipc.messages import (AbortRequest, AdapterCommand, AdapterCommandResult, AddRequest, OutputBatch,
                                 Ready, RequestOutput, Shutdown, StartupFailed, Stats, ToGateway)
from worker.ipc.shm_ring import ShmRing

logger = logging.getLogger(__name__)

DEAD_WORKER_STATUS = 503
SHUTTING_DOWN = "The server is shutting down."
SHUTTING_DOWN_STATUS = 503
# Data bytes of each ring. Each process's RSS counts a ring's pages as the counters first sweep over them, so
# it grows with the bytes passed until each ring has gone round once (2 x RING_BYTES at most), then stays.
RING_BYTES = 1 << 24


class WorkerStartupError(RuntimeError):
    """The worker could not start; the message is the worker's own."""


class WorkerClient:
    """The gateway's handle on its one worker process."""

    def __init__(self, config: WorkerConfig, *, engine_factory: str = "worker.engine:Engine",
                 ring_bytes: int = RING_BYTES):
        self._config = config
        self._engine_factory = engine_factory
        self._ring_bytes = ring_bytes
        self.ready: Ready | None = None
        self.stats = Stats(num_running=0, num_waiting=0)
        self._alive = False                  # process running and rings open
        self._draining = False               # drain() began: unhealthy (the listener is closed by then)
        self._accepting = True               # False once the drain's time is up: requests get 503
        self._stopping = False               # Shutdown sent: the worker's exit is expected
        self._death_message = "The worker process is not running."
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToGateway)
        self._queues: dict[str, OutputCollector] = {}
        self._commands: dict[int, asyncio.Future[AdapterCommandResult]] = {}
        self._command_ids = itertools.count()
        self._backlog: collections.deque[tuple[bytes, asyncio.Future[None]]] = collections.deque()
        self._process: BaseProcess | None = None
        self.pid: int | None = None

    @property
    def healthy(self) -> bool:
        """True from Ready until the worker exits or the drain begins."""
        return self._alive and not self._draining and self.ready is not None

    @property
    def failed(self) -> bool:
        """True once the worker has exited without being asked to (killed, crashed)."""
        return self._process is not None and not self._alive and not self._stopping

    async def start(self) -> Ready:
        """Spawn the worker and wait for Ready; raises WorkerStartupError with the worker's message."""
        self._loop = asyncio.get_running_loop()
        self._to_worker, to_handle = ShmRing.create(self._ring_bytes, "producer")
        self._from_worker, from_handle = ShmRing.create(self._ring_bytes, "consumer")
        try:
            process = multiprocessing.get_context("spawn").Process(
                target=run_worker, args=(self._config, to_handle, from_handle, self._engine_factory),
                name="loraplex-worker", daemon=True)
            process.start()
        except BaseException:
            self._to_worker.close()
            self._from_worker.close()
            raise
        finally:
            to_handle.close()                # the worker holds its own copies now
            from_handle.close()
        self._process = process
        self.pid = process.pid
        self._alive = True
        self._started: asyncio.Future[Ready] = self._loop.create_future()
        self._exited: asyncio.Future[None] = self._loop.create_future()
        self._loop.add_reader(self._from_worker.wakeup_fd, self._on_worker_readable)
        self._loop.add_reader(self._process.sentinel, self._on_worker_exit)
        try:
            self.ready = await self._started
        except BaseException:
            await self.shutdown()
            raise
        return self.ready

    async def generate(self, request: AddRequest, on_output: Callable[[RequestOutput], None] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Submit `request` and yield its outputs until the finished one (those that arrive while the caller is
        busy come merged into one: OutputCollector); stopping early aborts it. `on_output` sees every output
        from the worker as it arrives, unmerged."""
        request_id = request.request_id
        if request_id in self._queues:
            raise ValueError(f"Request id {request_id!r} is already in flight.")
        if not self._accepting:
            yield _shutting_down_output(request_id)
            return
        if not self._alive:
            yield self._error_output(request_id)
            return
        queue = OutputCollector(self._loop, on_output)
        self._queues[request_id] = queue
        finished = False
        try:
            await self._send_in_order(request)
            while not finished:
                output = await queue.take()
                finished = output.finished
                yield output
        finally:
            del self._queues[request_id]
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Ask the worker to stop `request_id`; its generate() then ends with finish_reason "abort"."""
        self._send(AbortRequest(request_id))

    async def adapter_command(self, op: str, name: str, path: str | None = None, load_inplace: bool = False,
                              pinned: bool = False, warm: bool = False) -> AdapterCommandResult:
        """Load or unload an adapter in the worker; a dead worker answers ok=False, status 503."""
        command_id = next(self._command_ids)
        if not self._accepting:
            return AdapterCommandResult(command_id, ok=False, message=SHUTTING_DOWN,
                                        status_code=SHUTTING_DOWN_STATUS)
        if not self._alive:
            return AdapterCommandResult(command_id, ok=False, message=self._death_message,
                                        status_code=DEAD_WORKER_STATUS)
        future: asyncio.Future[AdapterCommandResult] = self._loop.create_future()
        self._commands[command_id] = future
        try:
            await self._send_in_order(AdapterCommand(command_id, op, name, path, load_inplace, pinned, warm))
            return await future
        finally:
            self._commands.pop(command_id, None)

    async def drain(self, timeout: float) -> None:
        """Report unhealthy from now on; after `timeout` seconds, end the requests still in flight with a
        503 error (aborting them in the worker) and refuse later ones and adapter commands the same way.

        The server stops listening before it drains, so what arrives meanwhile was received before, and is
        served. The server cancels the drain once every request has finished.
        """
        self._draining = True
        await asyncio.sleep(timeout)
        self._accepting = False
        if self._queues:
            logger.warning("Ending %d request(s) still in flight: the shutdown timeout passed.", len(self._queues))
        for request_id, queue in self._queues.items():
            queue.put(_shutting_down_output(request_id))
            self.abort(request_id)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit, kill it after `timeout` seconds, and remove the shared memory."""
        if self._process is None:
            return
        self._stopping = self._stopping or self._alive     # a worker that died first still counts as failed
        self._send(Shutdown())
        try:
            await asyncio.wait_for(asyncio.shield(self._exited), timeout)
        except asyncio.TimeoutError:
            logger.warning("The worker did not exit within %.0f s of Shutdown; killing it.", timeout)
            self._process.kill()
            await self._exited

    def _send(self, message: msgspec.Struct) -> asyncio.Future[None] | None:
        """Queue `message` behind earlier ones; a future if it waits for ring space, else None."""
        if not self._alive:
            return None
        frame = self._encoder.encode(message)
        if not self._backlog and self._to_worker.try_put(frame):
            return None
        future = self._loop.create_future()
        self._backlog.append((frame, future))
        if len(self._backlog) == 1:
            self._loop.add_reader(self._to_worker.wakeup_fd, self._on_ring_space)
        return future

    async def _send_in_order(self, message: msgspec.Struct) -> None:
        future = self._send(message)
        if future is not None:
            await future

    def _on_ring_space(self) -> None:
        self._to_worker.clear_wakeup()
        sent = False
        while self._backlog and self._to_worker.try_put(self._backlog[0][0], notify=False):
            _, future = self._backlog.popleft()
            if not future.done():
                future.set_result(None)
            sent = True
        if sent:
            self._to_worker.notify()
        if not self._backlog or self._to_worker.peer_closed:
            self._loop.remove_reader(self._to_worker.wakeup_fd)

    def _on_worker_readable(self) -> None:
        self._from_worker.clear_wakeup()
        for frame in self._from_worker.get_many():
            self._dispatch(self._decoder.decode(frame))
        if self._from_worker.peer_closed:
            self._loop.remove_reader(self._from_worker.wakeup_fd)   # the sentinel reports the exit

    def _dispatch(self, message: ToGateway) -> None:
        match message:
            case OutputBatch():
                queues = self._queues
                for output in message.outputs:
                    queue = queues.get(output.request_id)
                    if queue is not None:
                        queue.put(output)
            case Stats():
                self.stats = message
            case AdapterCommandResult():
                future = self._commands.get(message.command_id)
                if future is not None and not future.done():
                    future.set_result(message)
            case Ready():
                self._started.set_result(message)
            case StartupFailed():
                self._started.set_exception(WorkerStartupError(message.message))

    def _on_worker_exit(self) -> None:
        """The process sentinel fired: deliver what it left in the ring, then fail everything in flight."""
        self._loop.remove_reader(self._process.sentinel)
        self._process.join(5.0)
        self._on_worker_readable()
        code = self._process.exitcode
        self._death_message = f"The worker process died (exit code {code})."
        if not self._stopping:
            logger.error(self._death_message)
        self._alive = False
        self._release_rings()
        for request_id, queue in self._queues.items():
            queue.put(self._error_output(request_id))
        for command_id, future in self._commands.items():
            if not future.done():
                future.set_result(AdapterCommandResult(command_id, ok=False, message=self._death_message,
                                                       status_code=DEAD_WORKER_STATUS))
        for _, future in self._backlog:
            if not future.done():
                future.set_result(None)
        self._backlog.clear()
        if not self._started.done():
            self._started.set_exception(WorkerStartupError(self._death_message))
        self._exited.set_result(None)

    def _release_rings(self) -> None:
        self._loop.remove_reader(self._from_worker.wakeup_fd)
        self._loop.remove_reader(self._to_worker.wakeup_fd)
        self._to_worker.close()
        self._from_worker.close()
        self._process.close()

    def _error_output(self, request_id: str) -> RequestOutput:
        return RequestOutput(request_id, [], finish_reason="error", error=self._death_message)


def _shutting_down_output(request_id: str) -> RequestOutput:
    return RequestOutput(request_id, [], finish_reason="error", error=SHUTTING_DOWN,
                         status_code=SHUTTING_DOWN_STATUS)
