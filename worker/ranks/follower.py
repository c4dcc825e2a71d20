"""A follower rank of a tensor-parallel group (ranks 1 .. N-1): its share of the model, driven by rank 0.

Started by ranks/group.py as `python -m worker.ranks.follower FD`, FD one end of a socket to rank 0.
The first message is a FollowerStart; then, until the socket closes (rank 0 stopped or died):

    ("read", ref, spec)               read this rank's shard of an adapter into its host cache, on a thread
    ("load", ref, spec, slot, rank)   copy it into the slot (reading it first if no read was announced)
    ("step", StepMessage)             the step's forward pass, then the sampled ids rank 0 broadcasts

A failed adapter read ends the follower (rank 0 read the same file; a difference means it changed under us), which
rank 0's watchdog turns into a stopped server rather than a wrong answer.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import pickle
import signal
import sys
from collections import deque
from multiprocessing.connection import Connection

import torch

from worker.ranks.group import FollowerStart, join_group, leave_group
from worker.ranks.step_mirror import StepDecoder, StepMessage
from worker.lora.manager import AdapterManager
from worker.model_runner.runner import ModelRunner, StepHandle
from worker.arch import ArchConfig

logger = logging.getLogger(__name__)


class Follower:
    def __init__(self, conn: Connection, runner: ModelRunner, adapters: AdapterManager):
        self._conn, self._runner, self._adapters = conn, runner, adapters
        self._steps = StepDecoder()
        self._prev: StepHandle | None = None
        self._launched: deque[torch.cuda.Event] = deque()    # the last two steps' ends (CUDA only)

    def serve(self) -> None:
        while True:
            try:
                message = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                return                      # rank 0 closed the socket or is gone
            match message:
                case ("step", StepMessage() as step):
                    self._step(step)
                case ("read", ref, spec):
                    self._adapters.follow_read(ref, spec)
                case ("load", ref, spec, slot, rank):
                    self._adapters.follow_load(ref, spec, slot, rank)
                case _:
                    raise ValueError(f"unknown message from rank 0: {message[0]!r}")

    def _step(self, message: StepMessage) -> None:
        batch = self._steps.decode(message)
        pool = self._adapters.pool
        pool.finished_loads()                 # nothing to file here: rank 0 decides when a slot may be read
        pool.wait_for(batch.lora_slots)
        if len(self._launched) == 2:          # the input builder's host buffers take turns: the set this step
            self._launched.popleft().synchronize()   # refills was last read by the step two back (rank 0 waits
        self._prev = self._runner.follow(batch, self._prev)   # as much); on the CPU every step has ended already
        if self._runner.device.type == "cuda":
            self._launched.append(torch.cuda.Event())
            self._launched[-1].record()


def main(fd: int) -> None:
    # rank 0 decides when this process ends (its socket closes): a terminal's Ctrl+C or a SIGTERM sent to the
    # whole process group must not end a rank under requests the gateway still drains
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)      # `kill -USR1 PID`: every thread's stack to stderr
    conn = Connection(fd)
    start: FollowerStart = pickle.loads(conn.recv_bytes())
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s worker rank {start.rank} %(levelname)s %(name)s: %(message)s")
    config = start.config
    if start.device_type == "cuda":
        torch.cuda.set_device(start.rank)
        device = torch.device("cuda", start.rank)
    else:
        device = torch.device("cpu")
    tp = join_group(start.rank, start.world_size, start.init_method, device, config.kernels.one_shot_all_reduce_bytes)
    arch = ArchConfig.from_dir(config.model.path)
    runner = ModelRunner(config, arch, device, start.dtype, start.max_model_len, tp=tp)
    adapters = AdapterManager(config.lora, runner.lora_pool, runner.model)   # its host cache sized as rank 0's
    logger.info("rank %d of %d ready on %s", start.rank, start.world_size, device)
    try:
        Follower(conn, runner, adapters).serve()
    finally:
        runner.release_graphs()
        if not leave_group():     # its thread still waits in the shutdown: end the process without joining it
            logging.shutdown()
            os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
