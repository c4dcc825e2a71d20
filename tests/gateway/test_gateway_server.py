"""GatewayServer, uvicorn's server as `loraplex serve` runs it: how it stops on a signal and on the worker's death."""
from __future__ import annotations

import signal
from types import SimpleNamespace

import uvicorn

import gateway.__main__ as cli


def server_for(client: SimpleNamespace) -> cli.GatewayServer:
    return cli.GatewayServer(uvicorn.Config(app=None), client, shutdown_timeout=30)


def test_a_handled_sigterm_starts_the_drain_and_is_not_raised_again():
    server = server_for(SimpleNamespace(failed=False))
    before = signal.getsignal(signal.SIGTERM)
    with server.capture_signals():
        signal.raise_signal(signal.SIGTERM)
    assert server.should_exit and not server.force_exit
    assert signal.getsignal(signal.SIGTERM) is before          # and this process is still alive


async def test_server_stops_a_grace_period_after_the_worker_died(monkeypatch):
    client = SimpleNamespace(failed=False)
    server = server_for(client)
    now = [100.0]
    monkeypatch.setattr(cli.time, "monotonic", lambda: now[0])
    assert not await server.on_tick(1)
    client.failed = True
    assert not await server.on_tick(1)                           # /health answers 503 meanwhile
    now[0] += cli.WORKER_DEATH_GRACE_S - 0.1
    assert not await server.on_tick(1)
    now[0] += 0.1
    assert await server.on_tick(1)
