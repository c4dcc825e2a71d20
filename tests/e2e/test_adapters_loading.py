"""The --lora-modules adapters' reads into host memory on the real server, which go on after it is healthy: the
count still loading in /health's header and /v1/adapters (0 once they are read), the worker's log lines."""
from __future__ import annotations

import re
import time

import httpx

READS_SECONDS = 60          # the demo's adapters are read within a second or two of startup


def test_health_and_the_adapter_list_count_the_adapters_still_loading(server):
    deadline = time.monotonic() + READS_SECONDS
    while (health := httpx.get(f"{server.url}/health", timeout=10)).headers.get("x-loraplex-adapters-loading") != "0":
        assert time.monotonic() < deadline, f"still loading: {health.headers}"
        time.sleep(0.1)
    assert (health.status_code, health.content) == (200, b"")
    listed = httpx.get(f"{server.url}/v1/adapters", headers=server.headers, timeout=10).json()
    assert listed["adapters_loading"] == 0


def test_the_worker_logs_when_the_reads_start_and_when_they_are_all_done(server):
    """Every --lora-modules adapter counted once in a first line and once in a last line (one round, unless the
    registrations paused on the way)."""
    deadline = time.monotonic() + READS_SECONDS
    while sum((counts := logged_counts(log := server.log_path.read_text()))[1]) < len(server.demo.adapters):
        assert time.monotonic() < deadline, log
        time.sleep(0.1)
    assert sum(counts[0]) == sum(counts[1]) == len(server.demo.adapters), log


def logged_counts(log: str) -> tuple[list[int], list[int]]:
    """The adapters counted by each first line and by each last line of the worker's warm reads."""
    started = re.findall(r"worker INFO \S+: reading (\d+) adapters? into host memory$", log, re.M)
    done = re.findall(r"worker INFO \S+: all (\d+) adapters? read into host memory in \d+\.\d s$", log, re.M)
    return [int(n) for n in started], [int(n) for n in done]
