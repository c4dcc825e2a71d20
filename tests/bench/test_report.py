"""Report math: metric samples, statistics, summary counts and throughputs, timeline bins, plots."""
from __future__ import annotations

import logging
import math
import sys

import pytest

from bench.report import (PERCENTILES, RequestRecord, format_summary, samples, stats_ms, summarize,
                          throughput_timeline, write_plots)


def record(send=0.0, ttft=0.1, itls=(), e2el=1.0, out=1, prompt=4, error=None, adapter="a") -> RequestRecord:
    return RequestRecord(adapter, max_tokens=out, prompt_tokens=prompt, send_time=send, ttft=ttft, itls=list(itls),
                         e2el=e2el, output_tokens=out, error=error)


FAILED = RequestRecord("x", max_tokens=5, prompt_tokens=3, send_time=0.3, error="HTTP 404: no such model")


def test_stats_are_numpy_style_percentiles_in_ms():
    stats = stats_ms([1.0, 2.0, 3.0, 4.0], "ttft")
    assert stats == pytest.approx({
        "mean_ttft_ms": 2500.0, "std_ttft_ms": 1000.0 * math.sqrt(1.25), "median_ttft_ms": 2500.0,
        "p50_ttft_ms": 2500.0, "p90_ttft_ms": 3700.0, "p95_ttft_ms": 3850.0, "p99_ttft_ms": 3970.0})


def test_stats_of_no_samples_are_none():
    assert set(stats_ms([], "itl").values()) == {None}
    assert len(stats_ms([], "itl")) == 3 + len(PERCENTILES)


def test_tpot_excludes_the_first_token_and_needs_two_tokens():
    assert record(ttft=0.2, e2el=1.0, out=5).tpot == pytest.approx(0.2)
    assert record(out=1).tpot is None
    assert FAILED.tpot is None


def test_samples_pool_itls_and_skip_failed_requests():
    records = [record(itls=[0.1, 0.2], out=3), record(itls=[0.3], out=2), FAILED]
    assert samples(records, "itl") == [0.1, 0.2, 0.3]
    assert samples(records, "ttft") == [0.1, 0.1]
    assert samples(records, "tpot") == pytest.approx([0.45, 0.9])


def test_summary_counts_tokens_and_throughputs():
    records = [record(e2el=1.0, out=4, prompt=10), record(e2el=3.0, out=2, prompt=6), FAILED]
    summary = summarize(records, duration_s=4.0)
    assert {k: summary[k] for k in ("num_requests", "completed", "errors", "total_input_tokens",
                                    "total_output_tokens")} == {
        "num_requests": 3, "completed": 2, "errors": 1, "total_input_tokens": 16, "total_output_tokens": 6}
    assert summary["request_throughput"] == pytest.approx(0.5)
    assert summary["output_throughput"] == pytest.approx(1.5)
    assert summary["total_token_throughput"] == pytest.approx(5.5)
    assert summary["concurrency"] == pytest.approx(1.0)
    assert summary["mean_e2el_ms"] == pytest.approx(2000.0)
    assert summary["median_tpot_ms"] == pytest.approx(((0.9 / 3) + 2.9) / 2 * 1000)


@pytest.mark.parametrize("bin_s, tokens, completions", [
    (1.0, [2.0, 3.0, 2.0], [0.0, 1.0, 1.0]),
    (2.0, [2.5, 1.0], [0.5, 0.5]),
])
def test_timeline_spreads_tokens_over_chunks(bin_s, tokens, completions):
    # A: chunks at 0.5, 1.5, 2.5 carrying 6 tokens, done at 2.6; B: one chunk at 1.3, done at 1.4
    records = [record(send=0.0, ttft=0.5, itls=[1.0, 1.0], e2el=2.6, out=6),
               record(send=1.2, ttft=0.1, e2el=0.2, out=1), FAILED]
    starts, got_tokens, got_completions = throughput_timeline(records, bin_s)
    assert list(starts) == [i * bin_s for i in range(len(tokens))]
    assert list(got_tokens) == pytest.approx(tokens)
    assert list(got_completions) == pytest.approx(completions)


def test_format_summary_lists_every_key():
    text = format_summary({"completed": 3, "mean_ttft_ms": 12.345, "p99_itl_ms": None}, "run")
    assert "run" in text.splitlines()[0]
    assert [line.split() for line in text.splitlines()[1:]] == [
        ["completed", "3"], ["mean_ttft_ms", "12.35"], ["p99_itl_ms", "n/a"]]


def test_plots_are_skipped_with_a_warning_without_matplotlib(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)      # makes `import matplotlib` fail
    with caplog.at_level(logging.WARNING, logger="bench.report"):
        assert write_plots([record(out=3, itls=[0.1, 0.1])], tmp_path / "run") == []
    assert "matplotlib is not installed" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_plots_are_png_files_beside_the_stem(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_plots([record(out=3, itls=[0.1, 0.1]), record(send=1.5, out=2, itls=[0.2]), FAILED],
                        tmp_path / "run")
    assert [p.name for p in paths] == ["run.latency_cdf.png", "run.throughput.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)
