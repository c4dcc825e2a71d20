"""The server keeps idle connections open longer than httpx / the OpenAI SDK pools them."""
from __future__ import annotations

import httpx

import gateway.__main__ as cli


def test_keep_alive_outlasts_the_client_pool_expiry(monkeypatch):
    seen = {}

    def run(server: cli.GatewayServer) -> None:
        seen.update(vars(server.config))
        server.started = True

    monkeypatch.setattr(cli.GatewayServer, "run", run)
    monkeypatch.setattr("gateway.app.build_app", lambda config, client: object())
    monkeypatch.setattr("gateway.worker_client.WorkerClient", FakeClient)
    args = cli.build_parser().parse_args(["serve", "--model", "/nonexistent", "--port", "8123"])
    cli.serve(cli.GatewayConfig.from_args(args))
    client_expiry = httpx.Limits().keepalive_expiry
    assert seen["port"] == 8123 and seen["timeout_keep_alive"] > client_expiry


class FakeClient:
    failed = False

    def __init__(self, config):
        pass
