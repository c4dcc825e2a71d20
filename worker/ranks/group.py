"""A tensor-parallel group as rank 0 runs it: the other ranks' processes, and what every step tells them.

`--tensor-parallel-size N`: the worker process is rank 0 (scheduler, adapters, sampling, the gateway's rings);
it starts N - 1 follower processes (ranks/follower.py), rank r on GPU r, each with one socket to rank 0.
Rank 0 sends, in order: each adapter read it starts (the follower reads its own shard of the file beside it), each
adapter copy into a slot, and each step's batch (ranks/step_mirror.py) before launching that step. Every rank
then runs the same forward pass, its collectives meeting in the same order; rank 0 alone samples and broadcasts
the sampled ids, which the next step's pending tokens are read from on every rank. Nothing of this waits for the
device: the messages are host bytes, the broadcast is enqueued on the stream.

A follower that exits takes the server down (`on_rank_exit`: log which rank and how, then end this process), as
rank 0 would otherwise wait for its collectives forever; a follower whose socket closes (rank 0 gone) exits.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from worker.batch import ScheduledBatch
from worker.config import WorkerConfig
from worker.ranks.step_mirror import StepEncoder
from worker.distributed.tensor_parallel import TensorParallel, init_tensor_parallel
from worker.lora.adapter import AdapterSpec
from worker.request import AdapterRef

logger = logging.getLogger(__name__)

SOCKET_BUFFER_BYTES = 8 << 20     # a few steps' messages queue in the socket before rank 0 waits for a follower


@dataclass(frozen=True)
class FollowerStart:
    """What a follower needs to build its share of the model: its first message."""
    config: WorkerConfig
    rank: int
    world_size: int
    init_method: str          # tcp://127.0.0.1:port of the process group's store
    device_type: str          # "cuda" (rank r on GPU r, NCCL) or "cpu" (gloo)
    dtype: torch.dtype
    max_model_len: int


def join_group(rank: int, world_size: int, init_method: str, device: torch.device,
               one_shot_bytes: int) -> TensorParallel:
    """Join the process group and, on GPUs, attach the one-shot all-reduce for messages up to `one_shot_bytes`
    (distributed/all_reduce.py; 0: NCCL for all); every rank calls this with the same arguments but its rank."""
    tp = init_tensor_parallel(rank, world_size, "nccl" if device.type == "cuda" else "gloo", init_method)
    if device.type != "cuda" or world_size == 1 or one_shot_bytes == 0:
        return tp
    tp.min_over_ranks(0)            # NCCL's communicator is made by a first collective, outside any graph capture
    from worker.distributed.all_reduce import AllReduce
    all_reduce = AllReduce(tp.group, device, one_shot_bytes, one_shot_bytes)
    return dataclasses.replace(tp, fast_all_reduce=all_reduce)


def _exit_process(message: str) -> None:
    logger.error(message)
    logging.shutdown()
    os._exit(1)


class FollowerRanks:
    """Rank 0's handle on ranks 1 .. N-1. Build it before the model runner: its `tp` is rank 0's place."""

    def __init__(self, config: WorkerConfig, device: torch.device, dtype: torch.dtype, max_model_len: int,
                 on_rank_exit: Callable[[str], None] | None = None):
        world_size = config.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < world_size:
            raise ValueError(f"--tensor-parallel-size {world_size} needs {world_size} GPUs; "
                             f"{torch.cuda.device_count()} are visible")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._on_rank_exit = on_rank_exit        # None: _exit_process
        self.before_leave: Callable[[], None] | None = None   # run before leaving the group (the runner's graphs)
        self._closing = False
        self._lock = threading.Lock()        # adapter reads are announced from the reader's threads
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        for rank in range(1, world_size):
            start = FollowerStart(config, rank, world_size, init_method, device.type, dtype, max_model_len)
            self._spawn(rank, start)
        for rank, proc in enumerate(self._procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-rank{rank}-watch", daemon=True).start()
        self.tp = join_group(0, world_size, init_method, device, config.kernels.one_shot_all_reduce_bytes)
        self._steps = StepEncoder()
        atexit.register(self.close)

    def _spawn(self, rank: int, start: FollowerStart) -> None:
        ours, theirs = socket.socketpair()
        for s in (ours, theirs):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
        proc = subprocess.Popen([sys.executable, "-m", "worker.ranks.follower", str(theirs.fileno())],
                                pass_fds=[theirs.fileno()], env=env)
        theirs.close()
        conn = Connection(ours.detach())
        conn.send_bytes(pickle.dumps(start, protocol=pickle.HIGHEST_PROTOCOL))
        self._conns.append(conn)
        self._procs.append(proc)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._closing:
            (self._on_rank_exit or _exit_process)(
                f"Tensor-parallel rank {rank} exited (exit code {code}); stopping the server, as "
                "the other ranks cannot run a step without it.")

    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            for conn in self._conns:
                conn.send_bytes(data)

    # what rank 0 announces

    def step(self, batch: ScheduledBatch) -> None:
        """Before rank 0 launches `batch`: every follower launches the same forward pass."""
        self._send(("step", self._steps.encode(batch)))

    def read(self, ref: AdapterRef, spec: AdapterSpec) -> None:
        """Rank 0 starts reading `ref` into its host cache: the followers read their shards beside it."""
        self._send(("read", ref, spec))

    def load(self, ref: AdapterRef, spec: AdapterSpec, slot: int, rank: int) -> None:
        """Rank 0 copies `ref` into `slot`: the followers copy their shards into theirs."""
        self._send(("load", ref, spec, slot, rank))

    def close(self) -> None:
        """End the followers (their sockets close; they leave the group and exit) and leave the process group at
        the same time as they do (leave_group). Idempotent."""
        if self._closing:
            return
        self._closing = True
        for conn in self._conns:
            conn.close()
        if self.before_leave is not None:
            self.before_leave()
        leave_group()
        for proc in self._procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


LEAVE_GROUP_TIMEOUT_S = 30.0


def leave_group(timeout: float = LEAVE_GROUP_TIMEOUT_S) -> bool:
    """Destroy this process's process group, every rank at about the same time (rank 0 after closing the
    followers' sockets, a follower as its socket closes) and after the rank's CUDA graphs are freed
    (ModelRunner.release_graphs). On two GPUs the shutdown hung in each rank that still held graphs with
    captured collectives, and in rank 0 when it waited for the followers to exit first. Bounded all the same:
    after `timeout` seconds the rank goes on without it and says so. Returns whether the group was left."""
    if not torch.distributed.is_initialized():
        return True
    done = threading.Event()

    def destroy() -> None:
        torch.distributed.destroy_process_group()
        done.set()

    threading.Thread(target=destroy, name="leave-process-group", daemon=True).start()
    if not done.wait(timeout):
        logger.warning("Leaving the tensor-parallel process group took over %.0f s; going on without it", timeout)
        return False
    return True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

