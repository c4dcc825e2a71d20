"""A stand-in worker client that keeps an adapter registry as the worker does, and jitters every step.

RegistryWorkerClient is a FakeWorkerClient whose adapter commands and requests go through one queue in the
order sent, as through the ring, to a stand-in worker that holds the registered names: a load registers a
name (refused if it is registered already, without load_inplace, or if its path is in `broken`), an unload
drops it (404 if absent), a request naming an unregistered adapter ends at once with the worker's 404, and
"list" reports the names. Every send, every message the worker takes and every answer is delayed by 0-3
turns of the event loop drawn from a seeded generator, so a seed is one reproducible interleaving of the
gateway's tasks with the worker; `events` records the order in which the worker took its messages.
"""
from __future__ import annotations

import asyncio
import random
from typing import AsyncIterator, Callable

from fake_worker_client import FakeWorkerClient
from worker.ipc.messages import AdapterCommandResult, AdapterState, AddRequest, RequestOutput

MAX_YIELDS = 3


class RegistryWorkerClient(FakeWorkerClient):
    def __init__(self, script: Callable[[AddRequest], list[int]], broken: tuple[str, ...] = ()):
        super().__init__(script)
        self.broken = broken                          # paths whose load the worker refuses (a broken folder)
        self.registry: dict[str, str] = {}            # the worker's registered names -> path
        self.events: list[tuple[str, str, bool]] = []  # (op, name, ok) in the order the worker took them
        self.rng = random.Random(0)
        self._inbox: asyncio.Queue[tuple[str, str, str | None, bool, asyncio.Future]] = asyncio.Queue()
        self._worker: asyncio.Task | None = None

    def reseed(self, seed: int) -> None:
        self.rng, self.events = random.Random(seed), []

    async def start(self):
        self._worker = asyncio.create_task(self._run())
        return await super().start()

    async def shutdown(self) -> None:
        self._worker.cancel()
        await super().shutdown()

    async def adapter_command(self, op: str, name: str, path: str | None = None, load_inplace: bool = False,
                              pinned: bool = False, warm: bool = False) -> AdapterCommandResult:
        if op == "settle":
            self.settled_after.append(len(self.adapter_commands))
            return AdapterCommandResult(0, ok=True)
        self.adapter_commands.append((op, name, path, load_inplace, pinned))
        return await self._send(op, name, path, load_inplace)

    async def generate(self, request: AddRequest, on_output: Callable[[RequestOutput], None] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        if request.lora_name is not None and not (await self._send("request", request.lora_name)).ok:
            self.requests.append(request)
            output = RequestOutput(request.request_id, [], finish_reason="error", status_code=404,
                                   error=f"The model `{request.lora_name}` does not exist.")
            (on_output or (lambda o: None))(output)
            yield output
            return
        async for output in super().generate(request, on_output):
            await self.jitter()
            yield output

    async def jitter(self, most: int = MAX_YIELDS) -> None:
        """0 to `most` turns of the event loop, drawn from the seeded generator."""
        for _ in range(self.rng.randint(0, most)):
            await asyncio.sleep(0)

    async def _send(self, op: str, name: str, path: str | None = None,
                    load_inplace: bool = False) -> AdapterCommandResult:
        await self.jitter()
        answer: asyncio.Future[AdapterCommandResult] = asyncio.get_running_loop().create_future()
        self._inbox.put_nowait((op, name, path, load_inplace, answer))
        result = await answer
        await self.jitter()
        return result

    async def _run(self) -> None:
        while True:
            op, name, path, load_inplace, answer = await self._inbox.get()
            await self.jitter()
            result = self._take(op, name, path, load_inplace)
            self.events.append((op, name, result.ok))
            if not answer.cancelled():                  # its request's client may have left
                answer.set_result(result)

    def _take(self, op: str, name: str, path: str | None, load_inplace: bool) -> AdapterCommandResult:
        """The worker's answer to one message, as worker/__main__.py and the registry give it."""
        if op == "list":
            return AdapterCommandResult(0, ok=True, adapters=[
                AdapterState(name=n, path=p, version=1, residency="disk", rank=8, target_modules=["q_proj"])
                for n, p in sorted(self.registry.items())])
        if op == "load":
            if name in self.registry and not load_inplace:
                return AdapterCommandResult(0, ok=False, status_code=400,
                                            message=f"The lora adapter '{name}' has already been "
                                            "loaded. If you want to load the adapter in place, set "
                                            "'load_inplace' to True.")
            if path in self.broken:
                return AdapterCommandResult(0, ok=False, status_code=400,
                                            message=f"adapter_config.json in {path} is unreadable")
            self.registry[name] = path
        elif op == "unload" and self.registry.pop(name, None) is None:
            return AdapterCommandResult(0, ok=False, status_code=404,
                                        message=f"The lora adapter '{name}' cannot be found.")
        elif op == "request" and name not in self.registry:
            return AdapterCommandResult(0, ok=False, status_code=404)
        return AdapterCommandResult(0, ok=True)
