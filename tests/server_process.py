"""Helpers for tests that start a real `python -m gateway serve` process."""
from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(process: subprocess.Popen, url: str, log_path: Path, timeout_s: float = 120) -> None:
    """Poll /health until it answers 200; fail the test with the server's log if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode} during startup:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    pytest.fail(f"the server was not healthy within {timeout_s} s:\n{log_path.read_text()}")
