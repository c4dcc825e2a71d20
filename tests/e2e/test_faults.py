"""Faults on a real server under streaming load: SIGTERM to the gateway, `kill -9` of its worker.

Each test starts its own server (the session's is left alone), puts several streams and whole
requests in flight, waits until every stream has its first chunk, then brings the fault. What each
client must receive: its full answer, or an error in vLLM's envelope (an error event, then
`data: [DONE]`, on a stream); never a stream cut mid-chunk.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from tests.e2e.conftest import API_KEY, REPO_ROOT, STARTUP_SECONDS, server_command, shm_segments
from tests.server_process import free_port, wait_until_healthy
from worker.demo import SERVED_MODEL_NAME

SHUTDOWN_TIMEOUT = 4            # seconds: --shutdown-timeout of the SIGTERM test's server
SHORT = 3                       # tokens: a request that finishes well within the shutdown timeout
# tokens: one that cannot, as many as the demo's context (2,048) leaves after the prompt: it outlasts the drain on
# any machine that makes under 500 tokens a second a stream (the CPU demo: ~100 on two cores)
LONG = 2032
EXIT_TIMEOUT = 60               # seconds a test waits for the gateway's exit: generous, a hang still fails
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@dataclass
class Received:
    """What one client got: status, the stream's events in order (JSON, or "[DONE]"), or the body."""
    status: int
    events: list = field(default_factory=list)
    body: dict | None = None
    event_times: list[float] = field(default_factory=list)

    @property
    def error(self) -> dict | None:
        errors = [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]
        return errors[0] if errors else (self.body or {}).get("error")


@dataclass
class LiveServer:
    process: subprocess.Popen
    url: str
    log_path: Path

    @property
    def worker(self) -> psutil.Process:
        """The spawned worker (the gateway's other child is multiprocessing's resource tracker)."""
        children = [p for p in psutil.Process(self.process.pid).children() if "spawn_main" in " ".join(p.cmdline())]
        assert len(children) == 1, children
        return children[0]


def start_server(demo, tmp_path, *extra: str) -> LiveServer:
    port = free_port()
    log_path = tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(server_command(demo, port) + list(extra), cwd=REPO_ROOT,
                                   env={**env, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_until_healthy(process, url, log_path, STARTUP_SECONDS)
    return LiveServer(process, url, log_path)


@pytest.fixture
def live(demo, tmp_path, request):
    server = start_server(demo, tmp_path, *request.param)
    yield server
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait(10)


def body(max_tokens: int, prompt: str = "The weather") -> dict:
    return {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}


async def stream(http: httpx.AsyncClient, max_tokens: int, first_chunk: asyncio.Event) -> Received:
    async with http.stream("POST", "/v1/completions", json={**body(max_tokens), "stream": True}) as response:
        received = Received(response.status_code)
        async for line in response.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), f"not an SSE event: {line!r}"
            data = line.removeprefix("data: ")
            received.events.append(data if data == "[DONE]" else json.loads(data))
            received.event_times.append(time.monotonic())
            first_chunk.set()
    return received


async def whole(http: httpx.AsyncClient, max_tokens: int) -> Received:
    response = await http.post("/v1/completions", json=body(max_tokens))
    return Received(response.status_code, body=response.json())


async def load(server: LiveServer, fault) -> tuple[list[Received], list[Received], float]:
    """Three long and two short streams, one long and one short whole request; `await fault()` once every
    stream has its first chunk and the long whole request is running. Returns (streams, wholes, fault time)."""
    async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=60) as http:
        firsts = [asyncio.Event() for _ in range(5)]
        streams = [asyncio.create_task(stream(http, n, first))
                   for n, first in zip([LONG, LONG, LONG, SHORT, SHORT], firsts)]
        long_whole = asyncio.create_task(whole(http, LONG))
        for first in firsts:
            await asyncio.wait_for(first.wait(), 30)
        deadline = time.monotonic() + 60
        while metric(server, "vllm:num_requests_running") < 4:     # the long whole request among them
            assert time.monotonic() < deadline, "the long whole request never ran"
            await asyncio.sleep(0.05)
        short_whole = asyncio.create_task(whole(http, SHORT))
        await asyncio.sleep(0.05)
        fault_time = time.monotonic()
        await fault()
        results = await asyncio.gather(*streams, long_whole, short_whole)
    return list(results[:5]), list(results[5:]), fault_time


async def new_request_status(server: LiveServer) -> int | str:
    """The status a request on a new connection gets, or "refused" when nothing listens any more."""
    try:
        async with httpx.AsyncClient(base_url=server.url, headers=HEADERS, timeout=10) as http:
            return (await http.post("/v1/completions", json=body(SHORT))).status_code
    except httpx.ConnectError:
        return "refused"


def metric(server: LiveServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    return values[0] if values else 0.0


def assert_full_stream(received: Received) -> None:
    assert received.status == 200 and received.events[-1] == "[DONE]"
    assert received.error is None
    assert received.events[-2]["choices"][0]["finish_reason"] == "length"


def assert_stream_error(received: Received, code: int, message: str) -> None:
    """The stream ends with one error event in vLLM's envelope, then [DONE]; every event before it is whole."""
    assert received.status == 200
    assert received.events[-1] == "[DONE]"
    assert received.events[-2] == {"error": {"message": message, "type": received.events[-2]["error"]["type"],
                                             "param": None, "code": code}}
    assert all("choices" in e for e in received.events[:-2])


@pytest.mark.parametrize("live", [("--shutdown-timeout", str(SHUTDOWN_TIMEOUT))], indirect=True)
async def test_sigterm_drains_then_ends_the_rest_with_an_error_and_exits_0(live):
    worker = live.worker
    late = []

    async def sigterm() -> None:
        live.process.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.5)
        late.append(await new_request_status(live))

    streams, (long_whole, short_whole), sigterm_at = await load(live, sigterm)
    code = await asyncio.to_thread(live.process.wait, SHUTDOWN_TIMEOUT + EXIT_TIMEOUT)

    assert all(received.error is not None for received in streams[:3]), \
        "a long stream finished within the drain: this machine makes LONG tokens within SHUTDOWN_TIMEOUT"
    for received in streams[3:]:
        assert_full_stream(received)
    for received in streams[:3]:
        assert_stream_error(received, 503, "The server is shutting down.")
        assert received.event_times[-2] - sigterm_at >= SHUTDOWN_TIMEOUT - 0.5     # ended at the deadline
        flowing = [t for t in received.event_times[:-2] if sigterm_at + 1 < t < sigterm_at + SHUTDOWN_TIMEOUT - 1]
        assert flowing, "the stream went silent during the drain"
    assert short_whole.status == 200, short_whole.body         # received before the SIGTERM: served
    assert short_whole.body["choices"][0]["finish_reason"] == "length"
    assert (long_whole.status, long_whole.body["error"]["message"]) == (503, "The server is shutting down.")
    assert late == ["refused"]
    assert code == 0, live.log_path.read_text()
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    assert shm_segments(live.process.pid) == []


@pytest.mark.parametrize("live", [()], indirect=True)
async def test_killed_worker_ends_every_request_with_an_error_and_the_gateway_exits_1(live):
    worker = live.worker
    async def kill() -> None:
        worker.kill()

    streams, wholes, _ = await load(live, kill)
    async with httpx.AsyncClient(base_url=live.url, timeout=5) as http:
        health = (await http.get("/health")).status_code
    code = await asyncio.to_thread(live.process.wait, EXIT_TIMEOUT)

    died = f"The worker process died (exit code {-signal.SIGKILL})."
    for received in streams[:3]:
        assert_stream_error(received, 500, died)
    for received in streams[3:]:        # a short stream may have finished before the kill
        if received.error is None:
            assert_full_stream(received)
        else:
            assert_stream_error(received, 500, died)
    for received in wholes:
        assert received.status in (200, 500)
        if received.status == 500:
            assert received.body["error"] == {"message": died, "type": "InternalServerError", "param": None,
                                              "code": 500}
    assert wholes[0].status == 500
    assert health == 503
    assert code == 1, live.log_path.read_text()
    assert shm_segments(live.process.pid) == []
