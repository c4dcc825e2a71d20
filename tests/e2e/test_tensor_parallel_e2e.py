"""The server at --tensor-parallel-size 2 on the CPU (gloo): 32 concurrent streams mixing the base model and every
demo adapter (more adapters than GPU slots) give the tokens of the single-process reference engine, with LoRA
sharded by default and with --fully-sharded-loras, up to a near-tie of the reference (a sharded sum is another fp32
summation order: tests/fp32_bounds.py); SIGTERM
stops the gateway, the worker and the follower rank, leaving no shared memory; a follower that dies stops the
server with a message naming it."""
from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess

import psutil
import pytest
import torch

from tests.e2e.conftest import API_KEY, REPO_ROOT, STARTUP_SECONDS, Server, server_command, stop_and_check_cleanup
from tests.e2e.test_streams import stream_requests, stream_text
from tests.fp32_bounds import assert_same_until_a_tie, forward_rtol
from tests.hf_fixtures import capture_sampled_logits
from tests.server_process import free_port, wait_until_healthy
from worker.demo import SERVED_MODEL_NAME


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


def reference_runs(reference, requests: list[dict], monkeypatch) -> list[tuple[str, list[int], torch.Tensor]]:
    """(text, token ids, logits [steps, vocab]) of each request run alone on the in-process reference engine."""
    monkeypatch.setattr(reference.engine.runner, "execute", reference.engine.runner.execute)   # unwrapped after
    logits = capture_sampled_logits(reference.engine)
    runs = []
    for request in requests:
        adapter = None if request["model"] == SERVED_MODEL_NAME else request["model"]
        seen = set(logits)
        ids = reference.tokens(reference.encode(request["prompt"]), adapter, max_tokens=10, ignore_eos=True)
        (request_id,) = set(logits) - seen
        runs.append((reference.decode(ids), ids, torch.stack(logits[request_id])))
    return runs


def assert_same_streams(reference, requests: list[dict], together: list, alone: list) -> None:
    """Each stream's token ids equal the reference's up to a near-tie (where the comparison stops), and its text
    too when they never part."""
    for request, (text, ids), (ref_text, ref_ids, ref_logits) in zip(requests, together, alone, strict=True):
        rtol = forward_rtol(reference.engine.runner.model.cfg, len(reference.encode(request["prompt"])) + 10)
        what = f"{request['model']} on {request['prompt']!r}"
        if assert_same_until_a_tie(ids, ref_ids, ref_logits, None, rtol, what) == len(ref_ids):
            assert text == ref_text, what


@pytest.mark.parametrize("flags", [(), ("--fully-sharded-loras",)], ids=["default-lora", "fully-sharded-lora"])
async def test_tp2_server_streams_equal_the_single_process_engine(demo, reference, tmp_path, flags, monkeypatch):
    log_path = tmp_path / "server.log"
    with tp2_server(demo, log_path, flags) as (_, url):
        requests = stream_requests()
        alone = reference_runs(reference, requests, monkeypatch)
        async with Server(url, API_KEY, demo, log_path).async_openai() as client:
            together = await asyncio.gather(*(stream_text(client, r) for r in requests))
        assert_same_streams(reference, requests, together, alone)
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
