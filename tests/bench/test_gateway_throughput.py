"""A short run of the gateway throughput bench: its JSON report, and tokens counted equal tokens sent, unpaced and
paced like a GPU's steps. How many tokens a chunk carries depends on how fast this machine's gateway keeps up, so it
is the bench's figure (BENCHMARKS.md), not a bound here; that a stream which keeps up gets each output as its own
chunk is tests/gateway/test_output_collector.py's."""
from __future__ import annotations

import json

import pytest

from bench.gateway_throughput import main

STREAMS, MAX_TOKENS = 3, 40


def test_short_run_counts_every_token_the_worker_sent(tmp_path):
    out = tmp_path / "throughput.json"
    main(["--streams", str(STREAMS), "--clients", "2", "--max-tokens", str(MAX_TOKENS), "--duration", "1.5",
          "--client-startup", "1", "--out", str(out)])
    report = json.loads(out.read_text())
    assert (report["streams"], report["clients"], report["max_tokens"]) == (STREAMS, 2, MAX_TOKENS)
    assert report["requests"] >= STREAMS
    assert report["tokens"] == report["tokens_sent_by_worker"] == report["requests"] * MAX_TOKENS
    assert 0 < report["chunks"] <= report["tokens"]          # a stream that falls behind gets tokens merged
    assert report["tokens_per_chunk"] == pytest.approx(report["tokens"] / report["chunks"], abs=0.01)
    assert report["elapsed_s"] >= 1.5
    assert report["tokens_per_s"] == pytest.approx(report["tokens"] / report["elapsed_s"], rel=1e-3)
    assert report["gateway_cpu_s"] > 0
    assert report["command"].startswith("python -m bench.gateway_throughput --streams 3")


def test_paced_run_offers_streams_per_step_and_counts_every_token(tmp_path):
    out = tmp_path / "paced.json"
    main(["--streams", str(STREAMS), "--clients", "1", "--max-tokens", "20", "--duration", "1",
          "--client-startup", "1", "--step-ms", "25", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["offered_tokens_per_s"] == pytest.approx(STREAMS * 1000 / 25)
    assert report["tokens"] == report["tokens_sent_by_worker"] == report["requests"] * 20
    assert 0 < report["chunks"] <= report["tokens"]
    assert report["tokens_per_s"] <= report["offered_tokens_per_s"] * 1.05     # never faster than the worker's pace
