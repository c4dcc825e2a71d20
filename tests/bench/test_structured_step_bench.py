"""bench.structured_step on a CPU engine (the timing itself needs a GPU): its stand-in tokenizer compiles the
schema into masks that keep the constrained rows constrained, and its runs and ratios are well formed."""
from __future__ import annotations

import pytest

from bench import structured_step
from worker.demo import build_demo


def test_grammar_tokenizer_has_the_vocabulary_size_and_its_eos(tmp_path):
    from tokenizers import Tokenizer
    path = structured_step.make_grammar_tokenizer(500, tmp_path, eos_token_id=499)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 500 and tokenizer.token_to_id("</s>") == 499
    assert tokenizer.token_to_id("{") is not None and tokenizer.token_to_id('"') is not None


def test_time_steps_runs_a_quarter_constrained_batch_on_the_cpu(tmp_path, caplog):
    model = build_demo().model_dir
    tokenizer = structured_step.make_grammar_tokenizer(1536, tmp_path, eos_token_id=2)
    engine = structured_step.build_engine(str(model), str(tokenizer), 8, device="cpu", dtype="float32",
                                          kv_bytes=64 << 20)
    runs = {"free_b8": structured_step.time_steps(engine, 8, 0, steps=3),
            "quarter_b8": structured_step.time_steps(engine, 8, 2, steps=3)}
    assert runs["quarter_b8"]["constrained"] == 2 and not engine.has_unfinished()
    assert "does not follow its grammar" not in caplog.text          # the rows stayed constrained
    assert set(structured_step.ratios(runs)) == {"quarter_b8_over_free"}
    assert structured_step.ratios(runs)["quarter_b8_over_free"] == pytest.approx(
        runs["quarter_b8"]["step_ms_median"] / runs["free_b8"]["step_ms_median"])
