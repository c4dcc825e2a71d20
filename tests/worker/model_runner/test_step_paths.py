"""The periodic log line of which path ran each step (model_runner/runner.py StepPaths)."""
from __future__ import annotations

import logging

from worker.gc_pauses import GCPauses
from worker.model_runner.runner import STEP_LOG_INTERVAL_S, StepPaths


def test_counts_each_path_and_logs_them_once_an_interval_has_passed(caplog):
    now = [100.0]
    pauses = GCPauses()
    pauses._callback("start", {"generation": 2}), pauses._callback("stop", {"generation": 2})   # one pass, timed ~0
    paths = StepPaths(clock=lambda: now[0], pauses=pauses)
    with caplog.at_level(logging.INFO, logger="worker.model_runner.runner"):
        for path, tokens in [("decode", 32), ("grouped", 256), ("grouped", 256), ("mixed", 900), ("eager", 3000),
                             ("eager", 1500)]:
            paths.count(path, tokens)
        assert not caplog.records, "nothing is logged before the interval has passed"
        now[0] += STEP_LOG_INTERVAL_S
        paths.count("decode", 8)
    assert [r.getMessage() for r in caplog.records] == [
        "steps in 60 s: 4 decode graphs (138 rows on average, 2 with LoRA grouped by adapter), 1 mixed-batch graphs "
        "(900 tokens on average), 2 eager (largest 3000 tokens); gc: 1 passes (1 full) took 0.0 ms, the longest 0.0 ms"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="worker.model_runner.runner"):
        now[0] += STEP_LOG_INTERVAL_S
        paths.count("mixed", 64)
    assert caplog.records[0].getMessage() == ("steps in 60 s: 0 decode graphs (0 rows on average, 0 with LoRA grouped "
                                              "by adapter), 1 mixed-batch graphs (64 tokens on average), 0 eager "
                                              "(largest 0 tokens); gc: no passes")
