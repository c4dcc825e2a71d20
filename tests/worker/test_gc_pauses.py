"""The worker's garbage-collector bookkeeping (worker/gc_pauses.py): every pass timed, the heap frozen."""
from __future__ import annotations

import gc
import logging
import weakref

import pytest

from worker.gc_pauses import GCPauses, freeze


class _Cycle:
    def __init__(self):
        self.me = self


def test_times_every_pass_and_counts_the_full_ones():
    ticks = iter(range(100))
    pauses = GCPauses(clock=lambda: float(next(ticks)))     # each clock reading one second after the last
    pauses.install()
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        pauses.uninstall()
    assert pauses.take() == (2, 1, 2.0, 1.0)
    assert pauses.take() == (0, 0, 0.0, 0.0), "take starts counting again"
    gc.collect(0)
    assert pauses.take() == (0, 0, 0.0, 0.0), "an uninstalled counter sees no pass"


def test_a_long_pass_is_logged_at_most_once_a_minute(caplog):
    times = [0.0, 0.001, 1.0, 1.5, 2.0, 2.5, 70.0, 70.5]    # passes of 1, 500, 500 and 500 ms
    pauses = GCPauses(clock=iter(times).__next__)
    with caplog.at_level(logging.WARNING, logger="worker.gc_pauses"):
        for generation in (0, 2, 2, 1):
            pauses._callback("start", {"generation": generation})
            pauses._callback("stop", {"generation": generation, "collected": 7})
    assert [r.getMessage() for r in caplog.records] == [
        "a garbage collection of generation 2 paused the worker for 500 ms (7 objects collected)",
        "a garbage collection of generation 1 paused the worker for 500 ms (7 objects collected)"]


def test_describe_reads_the_passes_in_milliseconds():
    pauses = GCPauses(clock=iter([0.0, 0.002, 1.0, 1.030]).__next__)
    pauses._callback("start", {"generation": 0}), pauses._callback("stop", {"generation": 0})
    pauses._callback("start", {"generation": 2}), pauses._callback("stop", {"generation": 2})
    assert pauses.describe() == "gc: 2 passes (1 full) took 32.0 ms, the longest 30.0 ms"
    assert pauses.describe() == "gc: no passes"


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()


def test_freeze_collects_the_garbage_then_keeps_what_lives_out_of_later_passes(unfrozen):
    garbage = weakref.ref(_Cycle())           # only a collection frees a cycle
    kept = [_Cycle() for _ in range(1000)]
    before = gc.get_freeze_count()
    freeze()
    assert garbage() is None, "the garbage was collected, not frozen"
    assert gc.get_freeze_count() >= before + len(kept), "what lives is frozen"
    tracked = {id(o) for o in gc.get_objects()}
    assert not any(id(k) in tracked for k in kept), "later passes no longer see the frozen objects"
