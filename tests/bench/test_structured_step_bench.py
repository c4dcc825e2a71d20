"""bench.structured_step on a CPU engine (the timing itself needs a GPU): its stand-in tokenizer compiles the
schema into masks that keep the constrained rows constrained, and its runs and ratios are well formed."""
from __future__ import annotations

import json

import pytest

from bench import structured_step
from worker.demo import FAST, build_demo


def test_grammar_tokenizer_has_the_vocabulary_size_and_its_eos(tmp_path):
    from tokenizers import Tokenizer
    path = structured_step.make_grammar_tokenizer(500, tmp_path, eos_token_id=499)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 500 and tokenizer.token_to_id("</s>") == 499
    assert tokenizer.token_to_id("{") is not None and tokenizer.token_to_id('"') is not None


def follows_schema(tokenizer_dir, token_ids: list[int]) -> bool:
    """Whether `token_ids` are a prefix of an output of structured_step.SCHEMA: xgrammar's own JSON-schema
    compiler over the tokenizer's vocabulary, apart from the engine's grammar compiler."""
    import xgrammar
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    vocab = [tokenizer.id_to_token(i) for i in range(tokenizer.get_vocab_size())]
    info = xgrammar.TokenizerInfo(vocab, stop_token_ids=[tokenizer.token_to_id("</s>")])
    matcher = xgrammar.GrammarMatcher(xgrammar.GrammarCompiler(info).compile_json_schema(
        json.dumps(structured_step.SCHEMA)))
    return all(token < len(vocab) and matcher.accept_token(token) for token in token_ids)


def test_time_steps_runs_a_quarter_constrained_batch_on_the_cpu(tmp_path, caplog):
    model = build_demo(size=FAST).model_dir
    tokenizer = structured_step.make_grammar_tokenizer(1536, tmp_path, eos_token_id=2)
    engine = structured_step.build_engine(str(model), str(tokenizer), 8, device="cpu", dtype="float32",
                                          kv_bytes=64 << 20)
    generated: dict[str, list[int]] = {}       # request id -> its tokens, in the run under way
    step = engine.step

    def recording_step():
        outputs = step()
        for out in outputs:
            generated.setdefault(out.request_id, []).extend(out.new_token_ids)
        return outputs

    engine.step = recording_step
    runs, tokens = {}, {}
    for name, num_constrained in [("free_b8", 0), ("quarter_b8", 2)]:
        generated.clear()
        runs[name] = structured_step.time_steps(engine, 8, num_constrained, steps=3)
        tokens[name] = dict(generated)
    assert not engine.has_unfinished()
    assert "does not follow its grammar" not in caplog.text
    for name, constrained in [("free_b8", [False] * 8), ("quarter_b8", [True] * 2 + [False] * 6)]:
        assert sorted(tokens[name]) == [f"r{i}" for i in range(8)]
        assert all(len(ids) >= 1 + 5 + 3 for ids in tokens[name].values())     # started, 5 steps, 3 timed
        assert [follows_schema(tokenizer, tokens[name][f"r{i}"]) for i in range(8)] == constrained, name
    assert set(structured_step.ratios(runs)) == {"quarter_b8_over_free"}
    assert structured_step.ratios(runs)["quarter_b8_over_free"] == pytest.approx(
        runs["quarter_b8"]["step_ms_median"] / runs["free_b8"]["step_ms_median"])
