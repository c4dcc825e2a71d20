"""Command line: `loraplex serve --model DIR ...` (vLLM's flag names) and `loraplex demo`.

Also `python -m gateway serve ...`. `demo` builds the embedded demo once (in a subprocess running
`python -m worker.demo`, which prints its paths as JSON) and serves it with its adapters. Other
subcommands come from the `loraplex.commands` entry points of installed packages (pyproject.toml
registers `bench`): each is a `main(argv)` that gets every argument after its name.

`serve` runs `GatewayServer`, uvicorn's server with the gateway's two ways to stop. SIGTERM or SIGINT
drains: the listener closes, requests in flight get --shutdown-timeout seconds to finish (streams keep
flowing), the rest end with a 503 (an error event, then [DONE], on a stream), the worker is stopped and the
process exits 0; a second SIGINT stops at once. A worker that dies ends every request in flight with a
500 error at once, /health answers 503 for WORKER_DEATH_GRACE_S, then the server stops and exits 1, so
that an orchestrator restarts it (as vLLM exits when its engine dies).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import subprocess
import sys
import time
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Iterator

import uvicorn

from gateway.config import GatewayConfig, LoRAModulePath
from worker.config_flags import add_flags

logger = logging.getLogger("gateway")
# Idle connections stay open longer than httpx (and so the OpenAI SDK) keeps them pooled (5 s): with equal
# timeouts a client can send on a connection the server is closing and get a connection reset.
KEEP_ALIVE_S = 15
COMMANDS_GROUP = "loraplex.commands"
WORKER_DEATH_GRACE_S = 1.0      # /health answers 503 this long after the worker died, before the port closes
FORCE_EXIT_MARGIN_S = 5         # past --shutdown-timeout, uvicorn cancels whatever request is left
STARTUP_FAILURE = 3             # uvicorn's exit status when the lifespan fails to start


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loraplex", description="One base LLM, many LoRA adapters, "
                                     "an OpenAI-compatible API that speaks as vLLM does.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="serve a model directory")
    serve.add_argument("model_tag", nargs="?", help="the model directory (same as --model)")
    _add_serving_args(serve)
    for name, command in plugin_commands().items():
        commands.add_parser(name, help=f"{command.module}'s command line; `loraplex {name} --help`", add_help=False)
    demo = commands.add_parser("demo", help="build (once) and serve the embedded demo model and adapters")
    demo.add_argument("--cache-dir", help="where the demo is built; default: worker.demo's own default")
    _add_serving_args(demo, leave_out=("--model",))      # the demo builds its own
    return parser


def plugin_commands() -> dict[str, EntryPoint]:
    """Subcommands other installed packages add, by name: `loraplex.commands` entry points."""
    return {command.name: command for command in entry_points(group=COMMANDS_GROUP)}


def _add_serving_args(parser: argparse.ArgumentParser, leave_out: tuple[str, ...] = ()) -> None:
    """The flags GatewayConfig's fields and the worker's config fields declare, and vLLM's --enable-lora."""
    add_flags(parser, GatewayConfig, leave_out)
    parser.add_argument("--enable-lora", action="store_true",
                        help="accepted for vLLM compatibility; LoRA is always enabled")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    plugin = plugin_commands().get(argv[0]) if argv else None
    if plugin is not None:             # its own parser: every flag after its name belongs to it
        plugin.load()(argv[1:])
        return
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "demo":
        _use_demo_assets(args)
    else:
        args.model = args.model or args.model_tag
        if not args.model:
            parser.error("serve needs a model: `loraplex serve --model DIR`")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        parser.error("--enable-auto-tool-choice requires --tool-call-parser")
    args.dtype = {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    serve(GatewayConfig.from_args(args))


def serve(config: GatewayConfig) -> None:
    """Run the HTTP server until SIGTERM or SIGINT (exit 0) or the worker's death (exit 1); exits 3 if
    the worker fails to start."""
    from gateway.app import build_app
    from gateway.worker_client import WorkerClient

    client = WorkerClient(config.worker)
    try:
        app = build_app(config, client)
    except FileNotFoundError as e:
        sys.exit(f"error: {e}")
    server = GatewayServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.uvicorn_log_level,
        timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=config.shutdown_timeout + FORCE_EXIT_MARGIN_S),
        client, config.shutdown_timeout)
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
    if client.failed:
        sys.exit("The worker process died; the server stopped so that it can be restarted.")


class GatewayServer(uvicorn.Server):
    """uvicorn's server that drains on SIGTERM and SIGINT, and stops when the worker dies."""

    def __init__(self, config: uvicorn.Config, client: Any, shutdown_timeout: float):
        super().__init__(config)
        self.client = client                    # gateway.worker_client.WorkerClient
        self.shutdown_timeout = shutdown_timeout
        self._worker_failed_at: float | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's handlers, without raising the signal again once the drain is done: a drained server
        exits 0, not killed by its own SIGTERM."""
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def on_tick(self, counter: int) -> bool:
        """uvicorn's check, ten times a second; also True WORKER_DEATH_GRACE_S after the worker died."""
        if self.client.failed:
            now = time.monotonic()
            self._worker_failed_at = self._worker_failed_at or now
            if now - self._worker_failed_at >= WORKER_DEATH_GRACE_S:
                return True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list | None = None) -> None:
        """uvicorn's shutdown (stop listening, wait for the connections, then the lifespan's end, which
        stops the worker), with the worker client draining the requests in flight meanwhile."""
        if not self.client.failed:
            logger.info("Shutting down: requests in flight have %s s to finish.", self.shutdown_timeout)
        drain = asyncio.ensure_future(self.client.drain(self.shutdown_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()


def _use_demo_assets(args: argparse.Namespace) -> None:
    """Build the demo in a subprocess and point `args` at it: model, name, adapters."""
    command = [sys.executable, "-m", "worker.demo"] + (["--cache-dir", args.cache_dir] if args.cache_dir else [])
    logger.info("Preparing the demo model (trained once, a few minutes on a CPU, then reused)")
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        sys.exit(f"Building the demo failed: `{' '.join(command)}` exited with {done.returncode}")
    assets = json.loads(done.stdout.strip().splitlines()[-1])
    args.model = assets["model_dir"]
    args.served_model_name = args.served_model_name or [assets["served_model_name"]]
    demo_modules = [LoRAModulePath(name, path) for name, path in assets["adapters"].items()]
    args.lora_modules = demo_modules + (args.lora_modules or [])


if __name__ == "__main__":
    main()
