"""The log lines of the --lora-modules adapters' reads into host memory (worker/warm_read_log.py), on a clock the
test moves: a round's lines wait until no read has started for PAUSE_S, progress comes at most every PROGRESS_S,
the last line once, timed to when the last read was found filed."""
from __future__ import annotations

import logging

import pytest

from worker.request import AdapterRef
from worker.warm_read_log import PAUSE_S, PROGRESS_S, WarmReadLog

A, B, C = (AdapterRef(name, uid) for uid, name in enumerate("abc", start=1))


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def lines(caplog):
    """The log's lines so far, each as (level, message)."""
    caplog.set_level(logging.INFO, logger="worker.warm_read_log")
    return lambda: [(r.levelname, r.getMessage()) for r in caplog.records]


def test_the_first_line_counts_every_adapter_registered_before_the_pause(lines):
    clock = Clock()
    log = WarmReadLog(clock)
    reading = {A, B, C}
    log.started(A)
    clock.now += 0.4 * PAUSE_S
    log.update(reading.__contains__)
    log.started(B)
    clock.now += 0.8 * PAUSE_S                # 1.2 pauses since A, 0.8 since B: still no line
    log.update(reading.__contains__)
    log.started(C)
    clock.now += 0.99 * PAUSE_S
    log.update(reading.__contains__)
    assert lines() == []
    clock.now += 0.02 * PAUSE_S
    log.update(reading.__contains__)
    assert lines() == [("INFO", "reading 3 adapters into host memory")]


def test_progress_comes_at_most_every_interval_and_the_last_line_once(lines):
    clock = Clock()
    log = WarmReadLog(clock)
    reading = {A, B, C}
    for ref in (A, B, C):
        log.started(ref)
    clock.now = 101.0
    log.update(reading.__contains__)          # the first line
    reading.discard(A)
    for clock.now in (105.0, 110.0, 111.0, 115.0, 121.0, 122.0):
        log.update(reading.__contains__)
    reading.clear()
    clock.now = 123.5
    log.update(reading.__contains__)
    log.update(reading.__contains__)
    assert lines() == [("INFO", "reading 3 adapters into host memory"),
                       ("INFO", "read 1 of 3 adapters into host memory so far (11 s)"),
                       ("INFO", "read 1 of 3 adapters into host memory so far (21 s)"),
                       ("INFO", "all 3 adapters read into host memory in 23.5 s")]
    assert not log.open and PROGRESS_S == 10.0


def test_reads_filed_before_the_pause_are_timed_to_when_they_were_filed(lines):
    """The round stays open until the pause (the idle worker keeps updating), then writes its first line and its
    last, which gives the time the reads took, not the time the pause took."""
    clock = Clock()
    log = WarmReadLog(clock)
    log.started(A)
    clock.now += 0.125
    log.update(lambda ref: False)
    clock.now += PAUSE_S
    assert log.open and lines() == []
    log.update(lambda ref: False)
    assert not log.open
    assert lines() == [("INFO", "reading 1 adapter into host memory"),
                       ("INFO", "all 1 adapter read into host memory in 0.1 s")]


def test_a_registration_before_the_pause_joins_the_round_and_moves_its_end(lines):
    clock = Clock()
    log = WarmReadLog(clock)
    log.started(A)
    clock.now += 0.1
    log.update(lambda ref: False)             # A filed; the round's end for now
    clock.now += 0.2
    log.started(B)
    clock.now += 0.3
    log.update(lambda ref: False)
    clock.now += PAUSE_S
    log.update(lambda ref: False)
    assert lines() == [("INFO", "reading 2 adapters into host memory"),
                       ("INFO", "all 2 adapters read into host memory in 0.6 s")]


def test_a_failed_read_is_told_in_the_last_line(lines):
    clock = Clock()
    log = WarmReadLog(clock)
    log.started(A)
    log.started(B)
    clock.now += 2.0
    log.failed(B)
    log.update(lambda ref: False)
    assert lines() == [("INFO", "reading 2 adapters into host memory"),
                       ("WARNING", "1 of 2 adapters read into host memory in 2.0 s; 1 failed (see above)")]


def test_a_later_registration_starts_a_new_round(lines):
    clock = Clock()
    log = WarmReadLog(clock)
    log.started(A)
    clock.now += PAUSE_S
    log.update(lambda ref: False)
    clock.now += 60.0
    log.started(B)
    clock.now += 1.5
    log.update(lambda ref: ref == B)
    log.update(lambda ref: False)
    assert lines()[2:] == [("INFO", "reading 1 adapter into host memory"),
                           ("INFO", "all 1 adapter read into host memory in 1.5 s")]


def test_no_read_no_line(lines):
    log = WarmReadLog(Clock())
    log.update(lambda ref: True)
    log.failed(A)
    assert lines() == [] and not log.open
