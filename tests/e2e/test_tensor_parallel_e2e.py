"""The server at --tensor-parallel-size 2 on the CPU (gloo): 32 concurrent streams mixing the base model and every
demo adapter (more adapters than GPU slots) give the tokens of the single-process reference engine; SIGTERM
stops the gateway, the worker and the follower rank, leaving no shared memory; a follower that dies stops the
server with a message naming it."""
from __future__ import annotations

import asyncio
import os
import subprocess

import psutil

from tests.e2e.conftest import API_KEY, REPO_ROOT, STARTUP_SECONDS, Server, server_command, stop_and_check_cleanup
from tests.e2e.test_streams import stream_requests, stream_text
from tests.server_process import free_port, wait_until_healthy
from worker.demo import SERVED_MODEL_NAME


async def test_tp2_server_streams_equal_the_single_process_engine(demo, reference, tmp_path):
    port = free_port()
    log_path = tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([*server_command(demo, port), "--tensor-parallel-size", "2"], cwd=REPO_ROOT,
                                   env={**env, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(process, url, log_path, STARTUP_SECONDS)
        requests = stream_requests()
        alone = []
        for request in requests:
            adapter = None if request["model"] == SERVED_MODEL_NAME else request["model"]
            ids = reference.tokens(reference.encode(request["prompt"]), adapter, max_tokens=10, ignore_eos=True)
            alone.append((reference.decode(ids), ids))
        async with Server(url, API_KEY, demo).async_openai() as client:
            together = await asyncio.gather(*(stream_text(client, r) for r in requests))
        assert together == alone
        assert "rank 1 of 2 ready" in log_path.read_text()
    finally:
        if process.poll() is None:
            stop_and_check_cleanup(process, log_path)


def test_a_follower_rank_that_dies_stops_the_server(demo, tmp_path):
    """Rank 1 killed while the server runs: the worker reports which rank and exits, the gateway follows with the
    worker-death message and a non-zero exit, instead of waiting forever in a collective."""
    port = free_port()
    log_path = tmp_path / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([*server_command(demo, port), "--tensor-parallel-size", "2"], cwd=REPO_ROOT,
                                   env={**env, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_healthy(process, f"http://127.0.0.1:{port}", log_path, STARTUP_SECONDS)
        followers = [p for p in psutil.Process(process.pid).children(recursive=True)
                     if "worker.distributed.follower" in " ".join(p.cmdline())]
        assert len(followers) == 1
        followers[0].kill()
        code = process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
    text = log_path.read_text()
    assert code != 0
    assert "Tensor-parallel rank 1 exited" in text and "The worker process died" in text
