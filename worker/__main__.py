"""The worker process: owns the Engine and serves the gateway over two shared-memory rings.

`run_worker` is the multiprocessing spawn target used by gateway.worker_client.WorkerClient; the
worker has no command line of its own. Nothing here imports torch: the engine module is imported
by name, in the child, through `engine_factory`.
"""
from __future__ import annotations

import importlib
import logging
import math
import multiprocessing
import select
import signal
import sys
import time
from typing import Any, Callable

import msgspec

from worker.config import WorkerConfig
from worker.engine_interface import EngineInterface
from worker.gc_pauses import PAUSES, freeze
from worker.ipc.messages import (AbortRequest, AdapterCommand, AdapterCommandResult, AddRequest, OutputBatch,
                                 Ready, RequestOutput, Shutdown, StartupFailed, Stats, ToWorker)
from worker.ipc.shm_ring import ShmRing, ShmRingHandle

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.005     # with no request unfinished but adapter reads in flight, how often the loop files them
STATS_INTERVAL_S = 0.05  # while requests run, the counters go to the gateway at most this often (for /metrics)


class GatewayGone(Exception):
    """The gateway process exited: nobody is left to serve."""


def load_factory(dotted: str) -> Callable[[WorkerConfig], Any]:
    """The object named by a "package.module:Name" path."""
    module_name, _, attr = dotted.partition(":")
    return getattr(importlib.import_module(module_name), attr)


class Worker:
    """Serves one engine: messages in from the gateway's ring, outputs back on the other."""

    def __init__(self, inbound: ShmRing, outbound: ShmRing, parent_sentinel: int):
        self._inbound, self._outbound = inbound, outbound
        self._parent_sentinel = parent_sentinel
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToWorker)
        self._stats: Stats | None = None
        self._stats_at = -math.inf           # when the counters were last looked at
        self._counts = (0, 0)                # the running and waiting requests then
        self._unnotified = False
        self._max_batch_bytes = outbound.capacity // 4     # a larger step is split, so a frame always fits

    def send(self, message: msgspec.Struct) -> None:
        """Put one message on the outbound ring, waiting for space while it is full."""
        self._put(self._encoder.encode(message))

    def send_outputs(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs as one OutputBatch, or as several when one frame would take too much of the ring."""
        frame = self._encoder.encode(OutputBatch(outputs))
        if len(frame) > self._max_batch_bytes and len(outputs) > 1:
            half = len(outputs) // 2
            self.send_outputs(outputs[:half])
            self.send_outputs(outputs[half:])
        elif outputs:
            self._put(frame)

    def _put(self, frame: bytes) -> None:
        while not self._outbound.try_put(frame, notify=False):
            self._outbound.notify()
            self._block_on(self._outbound)
        self._unnotified = True

    def flush(self) -> None:
        """Wake the gateway once for everything sent since the last flush."""
        if self._unnotified:
            self._outbound.notify()
            self._unnotified = False

    def serve(self, engine: EngineInterface) -> None:
        """Run until Shutdown: drain requests, step the engine while it has work, sleep when idle. Between two
        steps, while the engine's launch_delay lasts, messages are applied as they arrive."""
        while True:
            if not self._drain(engine):
                return
            if engine.has_unfinished():
                self.send_outputs(engine.step())
            elif engine.has_background_work():
                self.send_outputs(engine.idle_poll())
            self._send_stats_if_changed(engine, busy=engine.has_unfinished())
            self.flush()
            if engine.has_unfinished():
                if not self._serve_until(time.monotonic() + engine.launch_delay(), engine):
                    return
            elif not engine.has_background_work():
                self._block_on(self._inbound)
            elif not self._serve_until(time.monotonic() + IDLE_POLL_S, engine):    # look again soon
                return

    def close(self) -> None:
        self._inbound.close()
        self._outbound.close()

    def _drain(self, engine: EngineInterface) -> bool:
        """Apply every message on the inbound ring; False on Shutdown."""
        self._inbound.clear_wakeup()
        if self._inbound.peer_closed:
            raise GatewayGone()
        for frame in self._inbound.get_many():
            if not self._handle(engine, self._decoder.decode(frame)):
                return False
        return True

    def _serve_until(self, deadline: float, engine: EngineInterface) -> bool:
        """Apply messages as they arrive until `deadline` (time.monotonic()); False on Shutdown. Raises
        GatewayGone if the gateway exits meanwhile."""
        while (timeout := deadline - time.monotonic()) > 0.0:
            readable, _, _ = select.select([self._inbound.wakeup_fd, self._parent_sentinel], [], [], timeout)
            if self._parent_sentinel in readable:
                raise GatewayGone()
            if readable:
                if not self._drain(engine):
                    return False
                self.flush()
        return True

    def _handle(self, engine: EngineInterface, message: ToWorker) -> bool:
        """Apply one gateway message; False on Shutdown."""
        match message:
            case AddRequest():
                self._add_request(engine, message)
            case AbortRequest():
                output = engine.abort_request(message.request_id)
                if output is not None:
                    self.send_outputs([output])
            case AdapterCommand():
                self.send(self._adapter_command(engine, message))
            case Shutdown():
                return False
        return True

    def _add_request(self, engine: EngineInterface, request: AddRequest) -> None:
        try:
            engine.add_request(request.request_id, request.prompt_token_ids, request.params, request.lora_name)
        except Exception as e:
            if not (isinstance(e, ValueError) or hasattr(e, "status_code")):
                raise
            self.send_outputs([RequestOutput(request.request_id, [], finish_reason="error", error=str(e),
                                             status_code=getattr(e, "status_code", 400),
                                             num_prompt_tokens=len(request.prompt_token_ids))])

    def _adapter_command(self, engine: EngineInterface, command: AdapterCommand) -> AdapterCommandResult:
        if command.op not in ("load", "unload", "list", "settle"):
            return AdapterCommandResult(command.command_id, ok=False, status_code=400,
                                        message=f"Unknown adapter command {command.op!r}; "
                                                "expected 'load', 'unload', 'list' or 'settle'.")
        try:
            if command.op == "list":
                return AdapterCommandResult(command.command_id, ok=True, adapters=engine.adapter_states())
            if command.op == "settle":      # the startup adapters are registered; the gateway serves next
                engine.settle_adapters()
                freeze()                    # their registrations' objects out of later collections' reach
                return AdapterCommandResult(command.command_id, ok=True)
            if command.op == "load":
                engine.add_adapter(command.name, command.path, load_inplace=command.load_inplace,
                                   pinned=command.pinned, warm=command.warm)
            else:
                engine.remove_adapter(command.name)
        except Exception as e:
            if not hasattr(e, "status_code"):
                logger.exception("Adapter %s of %r failed", command.op, command.name)
            return AdapterCommandResult(command.command_id, ok=False, message=str(e),
                                        status_code=getattr(e, "status_code", 400))
        return AdapterCommandResult(command.command_id, ok=True)

    def _send_stats_if_changed(self, engine: EngineInterface, busy: bool = False) -> None:
        """The engine's counters to the gateway (its /metrics) when they changed: while the engine has work, at
        most every STATS_INTERVAL_S (they walk the adapter tiers; with a thousand adapters being read, every step
        would pay for it) unless the numbers of running or waiting requests changed (a request shows as running
        however short it is), at once when it has none (the last figures of a burst are never held back)."""
        now = time.monotonic()
        counts = (engine.num_running, engine.num_waiting)
        if busy and now - self._stats_at < STATS_INTERVAL_S and counts == self._counts:
            return
        self._stats_at, self._counts = now, counts
        stats = Stats(engine.num_running, engine.num_waiting, list(engine.running_adapter_names()),
                      list(engine.waiting_adapter_names()), engine.lora_stats(), engine.kv_cache_usage,
                      engine.num_preemptions, engine.prefix_cache_queries, engine.prefix_cache_hits,
                      engine.num_adapters_loading)
        if stats != self._stats:
            self.send(stats)
            self._stats = stats

    def _block_on(self, ring: ShmRing) -> None:
        """Sleep until `ring` signals; raises GatewayGone if the gateway exits meanwhile."""
        readable, _, _ = select.select([ring.wakeup_fd, self._parent_sentinel], [], [])
        ring.clear_wakeup()
        if self._parent_sentinel in readable or ring.peer_closed:
            raise GatewayGone()


def run_worker(config: WorkerConfig, inbound: ShmRingHandle, outbound: ShmRingHandle,
               engine_factory: str = "worker.engine:Engine") -> None:
    """Spawn target: build the engine, answer Ready (or StartupFailed and exit 1), then serve."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(name)s: %(message)s")
    worker = Worker(ShmRing.attach(inbound), ShmRing.attach(outbound),
                    multiprocessing.parent_process().sentinel)
    try:
        _start_and_serve(worker, config, engine_factory)
    except GatewayGone:
        logger.warning("The gateway process exited; stopping the worker.")
    finally:
        worker.close()


def _start_and_serve(worker: Worker, config: WorkerConfig, engine_factory: str) -> None:
    try:
        engine: EngineInterface = load_factory(engine_factory)(config)
    except Exception as e:
        logger.exception("Engine startup failed")
        worker.send(StartupFailed(f"{type(e).__name__}: {e}"))
        worker.flush()
        sys.exit(1)
    freeze()            # the heap startup built, out of later collections' reach (worker/gc_pauses.py)
    PAUSES.install()
    worker.send(Ready(engine.max_model_len, engine.vocab_size, list(engine.eos_token_ids), engine.num_kv_blocks))
    worker.flush()
    # From here the gateway decides when the worker stops (Shutdown, or its own exit): a terminal's Ctrl+C,
    # or a SIGTERM sent to the whole process group, must not kill the worker under requests the gateway
    # still drains.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logger.info("Worker ready: max_model_len=%d, %d KV blocks", engine.max_model_len, engine.num_kv_blocks)
    worker.serve(engine)
    logger.info("Worker shut down.")
