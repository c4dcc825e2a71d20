"""bench.mixed_step's request handling on a CPU engine (the timing itself needs a GPU): every timed step is one
mixed step (all new prompts prefilled beside every decode row), and nothing is left behind."""
from __future__ import annotations

import pytest

from bench import mixed_step
from worker.config import CacheConfig, ModelConfig, WorkerConfig


@pytest.mark.parametrize("adapters", [[None], ["a"], [None, "a"]])
def test_each_timed_step_prefills_every_new_prompt_beside_the_decode_rows(hf_models, adapters, monkeypatch):
    from tests.hf_fixtures import ADAPTERS, adapter_dir
    from worker.engine import Engine
    engine = Engine(WorkerConfig(ModelConfig(str(hf_models["llama"])), cache=CacheConfig(block_size=4),
                                 device="cpu", async_scheduling=False))
    engine.add_adapter("a", str(adapter_dir(hf_models["llama"], ADAPTERS[0].name)))
    scheduled = []
    execute = engine.runner.execute

    def recording_execute(batch, *args, **kwargs):
        scheduled.append((sum(s.num_new_tokens == 1 for s in batch.seqs), batch.num_tokens))
        return execute(batch, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", recording_execute)
    wall = mixed_step.mixed_steps(engine, 3, adapters, steps=2, prefills=2, prompt_len=6, vocab=100)
    assert len(wall) == 2 and all(w > 0 for w in wall)
    assert scheduled[-2:] == [(3, 3 + 2 * 6)] * 2          # the two timed steps: 3 decode rows + 2 whole prompts
    assert not engine.has_unfinished()


def test_no_prompt_repeats_across_calls_so_no_run_finds_another_runs_prefix_cached():
    """The runs share one engine; a prompt repeated under the same adapter in a later run would be served from the
    prefix cache and shorten that run's steps."""
    added = []

    class Recorder:
        def add_request(self, request_id, prompt, params, adapter):
            added.append((request_id, tuple(prompt), adapter))

    for adapters in (["a0"], [f"a{i}" for i in range(64)], ["a0"]):
        mixed_step.add_prompts(Recorder(), 8, 16, adapters, vocab=1000)
    assert len({request_id for request_id, _, _ in added}) == len({prompt for _, prompt, _ in added}) == 24
