"""leave_group: every rank destroys its process group at about the same time, and none waits on it forever."""
from __future__ import annotations

import logging
import threading
import time

import torch

from worker.ranks import group


def test_leave_group_destroys_the_group(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: calls.append("destroyed"))
    assert group.leave_group(timeout=5)
    assert calls == ["destroyed"]


def test_leave_group_goes_on_when_the_shutdown_hangs(monkeypatch, caplog):
    """A communicator shutdown that waits for a rank already gone (what two GPUs did with CUDA graphs) costs the
    timeout, then the rank goes on and says so."""
    release = threading.Event()
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", release.wait)
    left: list[bool] = []
    leaving = threading.Thread(target=lambda: left.append(group.leave_group(timeout=0.3)), daemon=True)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=group.__name__):
        leaving.start()
        leaving.join(60)             # generous: the shutdown itself never ends until released below
    took = time.monotonic() - start
    release.set()
    assert not leaving.is_alive() and left == [False]
    assert took >= 0.3               # it waited its timeout first
    assert "going on without it" in caplog.text


def test_leave_group_without_a_group_does_nothing(monkeypatch):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: (_ for _ in ()).throw(AssertionError))
    assert group.leave_group(timeout=0.1)
