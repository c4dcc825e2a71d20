"""bench/gateway_ttft.py: the gateway's own time to first token, with the stand-in worker."""
from __future__ import annotations

import json

from bench.gateway_ttft import main, prompt


def test_prompts_have_the_asked_length_and_differ_by_seed():
    assert len(prompt(1000, 0).split()) == 1000
    assert prompt(50, 1) != prompt(50, 2)


def test_short_run_reports_a_first_token_time_for_each_length(tmp_path):
    out = tmp_path / "ttft.json"
    results = main(["--words", "5", "400", "--requests", "7", "--out", str(out)])
    assert set(results) == {5, 400}
    for entry in results.values():
        assert entry["requests"] == 2
        assert 0 < entry["ttft_min_ms"] <= entry["ttft_p50_ms"] < 5_000
    assert json.loads(out.read_text()).keys() == {"5", "400"}
