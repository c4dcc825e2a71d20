"""The server at --tensor-parallel-size 2 on the CPU (gloo): 32 concurrent streams mixing the base model and every
demo adapter (more adapters than GPU slots) give the tokens of the single-process reference engine, with LoRA
sharded by default and with --fully-sharded-loras; SIGTERM
stops the gateway, the worker and the follower rank, leaving no shared memory; a follower that dies stops the
server with a message naming it."""
from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess

import psutil
import pytest

from tests.e2e.conftest import API_KEY, REPO_ROOT, STARTUP_SECONDS, Server, server_command, stop_and_check_cleanup
from tests.e2e.test_streams import reference_streams, stream_requests, stream_text
from tests.server_process import free_port, wait_until_healthy


@contextlib.contextmanager
def tp2_server(demo, log_path, flags: tuple[str, ...] = ()):
    """The demo server at -tp 2 (and `flags`), healthy: (its process, its URL); SIGTERMed and checked afterwards if
    still up."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([*server_command(demo, port), "--tensor-parallel-size", "2", *flags], cwd=REPO_ROOT,
                                   env={**env, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(process, url, log_path, STARTUP_SECONDS)
        yield process, url
    finally:
        if process.poll() is None:
            stop_and_check_cleanup(process, log_path)


@pytest.mark.parametrize("flags", [(), ("--fully-sharded-loras",)], ids=["default-lora", "fully-sharded-lora"])
async def test_tp2_server_streams_equal_the_single_process_engine(demo, reference, tmp_path, flags):
    log_path = tmp_path / "server.log"
    with tp2_server(demo, log_path, flags) as (_, url):
        requests = stream_requests()
        alone = reference_streams(reference, requests)
        async with Server(url, API_KEY, demo).async_openai() as client:
            together = await asyncio.gather(*(stream_text(client, r) for r in requests))
        assert together == alone
        log = log_path.read_text()
        assert "rank 1 of 2 ready" in log
        scheme = "fully sharded" if flags else "sharded"
        assert f"LoRA {scheme} over 2 ranks" in log, log


def test_a_follower_rank_that_dies_stops_the_server(demo, tmp_path):
    """Rank 1 killed while the server runs: the worker reports which rank and exits, the gateway follows with the
    worker-death message and a non-zero exit, instead of waiting forever in a collective."""
    log_path = tmp_path / "server.log"
    with tp2_server(demo, log_path) as (process, _):
        followers = [p for p in psutil.Process(process.pid).children(recursive=True)
                     if "worker.ranks.follower" in " ".join(p.cmdline())]
        assert len(followers) == 1
        followers[0].kill()
        try:
            code = process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
    text = log_path.read_text()
    assert code != 0
    assert "Tensor-parallel rank 1 exited" in text and "The worker process died" in text
