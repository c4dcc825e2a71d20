"""A follower rank of a tensor-parallel group (ranks 1 .. N-1): its share of the model, driven by rank 0.

Started by ranks/group.py as `python -m worker.ranks.follower FD`, FD one end of a socket to rank 0.
The first message is a FollowerStart; then, until the socket closes (rank 0 stopped or died):

    ("read", ref, spec)               read this rank's shard of an adapter into host memory, on a thread
    ("load", ref, spec, slot, rank)   copy it into the slot (reading it first if no read was announced)
    ("step", StepMessage)             the step's forward pass, then the sampled ids rank 0 broadcasts

A failed adapter read ends the follower (rank 0 read the same file; a difference means it changed under us), which
rank 0's watchdog turns into a stopped server rather than a wrong answer.
"""
from __future__ import annotations

import concurrent.futures
import faulthandler
import logging
import os
import pickle
import signal
import sys
from collections import OrderedDict, deque
from collections.abc import Callable
from multiprocessing.connection import Connection

import torch

from worker.ranks.group import FollowerStart, join_group, leave_group
from worker.ranks.step_mirror import StepDecoder, StepMessage
from worker.lora.adapter import AdapterSpec
from worker.lora.gpu_pool import GPULoRAPool
from worker.lora.host_cache import HostAdapter
from worker.lora.slot_layout import PackedReader
from worker.lora.host_cache_plan import plan_host_cache
from worker.model_runner.runner import ModelRunner, StepHandle
from worker.arch import ArchConfig
from worker.request import AdapterRef

logger = logging.getLogger(__name__)


class FollowerAdapters:
    """This rank's shards of the adapters rank 0 reads: reads on a thread pool, kept least recently used first."""

    def __init__(self, read: Callable[[AdapterSpec], HostAdapter], pool: GPULoRAPool, capacity: int | None,
                 workers: int):
        self._read, self._pool, self._capacity = read, pool, capacity
        self._executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="lora-read")
        self._reads: OrderedDict[AdapterRef, concurrent.futures.Future] = OrderedDict()

    def read(self, ref: AdapterRef, spec: AdapterSpec) -> concurrent.futures.Future:
        future = self._reads.get(ref)
        if future is None:
            future = self._reads[ref] = self._executor.submit(self._read_inference, spec)
            self._evict()
        self._reads.move_to_end(ref)
        return future

    def load(self, ref: AdapterRef, spec: AdapterSpec, slot: int, rank: int) -> None:
        entry: HostAdapter = self.read(ref, spec).result()     # begun with rank 0's read: usually done
        self._pool.start_load(slot, entry.packed, rank, ref)

    def _read_inference(self, spec: AdapterSpec) -> HostAdapter:
        with torch.inference_mode():
            return self._read(spec)

    def _evict(self) -> None:
        """Drop the least recently used finished reads past the capacity (rank 0's host cache size)."""
        if self._capacity is None:
            return
        for ref in [r for r, f in self._reads.items() if f.done()][:max(0, len(self._reads) - self._capacity)]:
            del self._reads[ref]


class Follower:
    def __init__(self, conn: Connection, runner: ModelRunner, adapters: FollowerAdapters):
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
                    self._adapters.read(ref, spec)
                case ("load", ref, spec, slot, rank):
                    self._adapters.load(ref, spec, slot, rank)
                case _:
                    raise ValueError(f"unknown message from rank 0: {message[0]!r}")

    def _step(self, message: StepMessage) -> None:
        batch = self._steps.decode(message)
        pool = self._runner.lora_pool
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
    tp = join_group(start.rank, start.world_size, start.init_method, device, config.kernels.one_shot_all_reduce_bytes,
                    config.kernels.all_reduce_kernel)
    arch = ArchConfig.from_dir(config.model.path)
    runner = ModelRunner(config, arch, device, start.dtype, start.max_model_len, tp=tp)
    lora = config.lora
    reader = PackedReader(runner.lora_pool.layout, pin=device.type == "cuda", shard=runner.model)
    capacity = plan_host_cache(lora, runner.lora_pool.layout.num_bytes, start.world_size)   # as rank 0 sizes its
    adapters = FollowerAdapters(reader, runner.lora_pool, capacity, lora.lora_load_workers)     # host cache
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
