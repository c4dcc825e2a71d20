"""Async scheduling: step N+1 is scheduled and launched before step N's tokens are read back.

Each case runs the same traffic through an engine with async scheduling on and one with it off
(every step's tokens filed before the next schedule) and compares request by request: tokens,
logprobs, prompt logprobs and finish reasons. Greedy and seeded rows do not depend on their batch
mates, so any difference is the pending-token bookkeeping's fault.
"""
from __future__ import annotations

import random

import pytest
import torch

from tests.hf_fixtures import ADAPTERS, adapter_dir
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams


@pytest.fixture(scope="module")
def llama(hf_models):
    return hf_models["llama"]


def make_engine(model_dir, async_scheduling: bool, num_blocks: int = 256, max_model_len: int | None = None,
                **sched) -> Engine:
    engine = Engine(WorkerConfig(ModelConfig(str(model_dir), max_model_len=max_model_len), cache=CacheConfig(block_size=4, num_gpu_blocks_override=num_blocks),
                                 lora=LoRAConfig(max_loras=2, max_lora_rank=16), scheduler=SchedulerConfig(**sched),
                                 device="cpu", async_scheduling=async_scheduling))
    for spec in ADAPTERS:
        engine.add_adapter(spec.name, str(adapter_dir(model_dir, spec.name)))
    return engine


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def drive(engine: Engine, arrivals: dict[int, list[tuple]], aborts: dict[int, list[str]] = {}) -> dict[str, dict]:
    """Add each request at its step, abort at given steps, step until done; per request: tokens,
    finish reason, logprob entries, prompt logprobs."""
    results: dict[str, dict] = {}
    step = 0
    while engine.has_unfinished() or step <= max(arrivals):
        for request_id, tokens, params, adapter in arrivals.get(step, []):
            engine.add_request(request_id, tokens, params, adapter)
            results[request_id] = {"tokens": [], "finish": None, "logprobs": [], "prompt_logprobs": None}
        for request_id in aborts.get(step, []):
            engine.abort_request(request_id)
        for out in engine.step():
            r = results[out.request_id]
            r["tokens"] += out.new_token_ids
            r["logprobs"] += [(lp.token_id, round(lp.logprob, 4), lp.rank, [t for t, _ in lp.top])
                              for lp in out.new_logprobs or []]
            if out.prompt_logprobs is not None:
                r["prompt_logprobs"] = [None if lp is None else (lp.token_id, round(lp.logprob, 4))
                                        for lp in out.prompt_logprobs]
            if out.finish_reason:
                assert r["finish"] is None, "a request finishes once"
                r["finish"] = out.finish_reason
        step += 1
        assert step < 1000, "the engine stopped making progress"
    return results


def mixed_traffic(seed: int, stop_tokens: dict[str, int]) -> dict[int, list[tuple]]:
    """Greedy, seeded sampling, stop ids that do fire, min_tokens, logprobs, penalties, prompt
    logprobs; base and three adapters; arrivals spread over the first steps."""
    rng = random.Random(seed)
    kinds = [
        dict(temperature=0.0, ignore_eos=True),
        dict(temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
        dict(temperature=0.0, ignore_eos=True, logprobs=3),
        dict(temperature=0.0, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5),
        dict(temperature=0.0, ignore_eos=True, prompt_logprobs=2),
        dict(temperature=0.0, ignore_eos=True, min_tokens=6),
    ]
    arrivals: dict[int, list[tuple]] = {}
    for i in range(14):
        request_id = f"r{i}"
        extra = dict(kinds[i % len(kinds)])
        if request_id in stop_tokens:
            extra["stop_token_ids"] = [stop_tokens[request_id]]
        max_tokens = rng.randint(1, 9)
        if "min_tokens" in extra:
            extra["min_tokens"] = min(extra["min_tokens"], max_tokens)
        params = SamplingParams(max_tokens=max_tokens, **extra)
        adapter = rng.choice([None, *(a.name for a in ADAPTERS)])
        arrivals.setdefault(rng.randint(0, 6), []).append((request_id, prompt(rng.randint(2, 14), 50 + i), params, adapter))
    return arrivals


def stops_that_fire(llama, seed: int) -> dict[str, int]:
    """For every third request, its 3rd free-run token as a stop id, so stop conditions end requests
    while their next step is already in flight."""
    free = drive(make_engine(llama, async_scheduling=False), mixed_traffic(seed, {}))
    return {rid: r["tokens"][2] for i, (rid, r) in enumerate(sorted(free.items())) if i % 3 == 0 and len(r["tokens"]) > 3}


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("sched", [dict(), dict(max_num_batched_tokens=16, num_blocks=12, max_num_seqs=6)],
                         ids=["roomy", "chunked-preempting"])
def test_async_scheduling_gives_the_same_outputs_as_sync(llama, seed, sched):
    stops = stops_that_fire(llama, seed)
    arrivals = mixed_traffic(seed, stops)
    sync = drive(make_engine(llama, False, **sched), arrivals)
    engine = make_engine(llama, True, **sched)
    assert drive(engine, arrivals) == sync
    assert any(sync[rid]["finish"] == "stop" for rid in stops)
    assert engine.scheduler.blocks.num_free == engine.num_kv_blocks   # nothing leaked


@pytest.mark.parametrize("adapters", [(None, None, None), ("r4-qv", None, "r16-mlp-rs")])
def test_preempted_while_its_token_is_in_flight(llama, adapters):
    """Three requests outgrow a 6-block pool while decoding: the newest is preempted by a schedule()
    that runs before its last token is back; the token must still reach it, and its recompute
    must include it."""
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    arrivals = {0: [(f"r{i}", prompt(7, 20 + i), params, a) for i, a in enumerate(adapters)]}
    sync = drive(make_engine(llama, False, num_blocks=6), arrivals)
    engine = make_engine(llama, True, num_blocks=6)
    preempted_pending = []
    preempt = engine.scheduler._preempt
    engine.scheduler._preempt = lambda request, batch: (preempted_pending.append(request.num_pending),
                                                        preempt(request, batch))[1]
    assert drive(engine, arrivals) == sync
    assert 1 in preempted_pending
    assert all(len(r["tokens"]) == 7 for r in sync.values())


def test_step_returns_the_previous_launch_tokens(llama):
    engine = make_engine(llama, True)
    engine.add_request("x", prompt(5, 1), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    per_step = [[t for o in engine.step() for t in o.new_token_ids] for _ in range(4)]
    assert [len(t) for t in per_step] == [0, 1, 1, 1] and not engine.has_unfinished()
    sync = make_engine(llama, False)
    sync.add_request("x", prompt(5, 1), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert [t for _ in range(3) for o in sync.step() for t in o.new_token_ids] == sum(per_step, [])


def test_a_request_at_its_length_limit_is_not_scheduled_again(llama):
    """max_tokens is known before the last token arrives: no wasted step is launched for it."""
    engine = make_engine(llama, True)
    launched = []
    execute = engine.runner.execute
    engine.runner.execute = lambda batch, prev=None: (launched.append(len(batch.seqs)), execute(batch, prev))[1]
    engine.add_request("x", prompt(5, 2), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert launched == [1, 1, 1, 1]


def test_max_model_len_ends_a_request_at_the_same_token_as_sync(llama):
    """The next step's pending token must not count toward max_model_len when this step's token arrives."""
    arrivals = {0: [("x", prompt(10, 5), SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True), None)]}
    sync, overlapped = (drive(make_engine(llama, a, max_model_len=16), arrivals) for a in (False, True))
    assert overlapped == sync
    assert (len(sync["x"]["tokens"]), sync["x"]["finish"]) == (6, "length")


@pytest.mark.parametrize("when", [1, 2, 4])
def test_abort_while_the_request_is_in_flight(llama, when):
    """An aborted request's token in flight is dropped; its blocks and adapter slot come back, and
    the other requests are not disturbed."""
    arrivals = {0: [("keep", prompt(6, 3), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), "r8-all"),
                    ("gone", prompt(9, 4), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), "r4-qv")]}
    alone = drive(make_engine(llama, False), {0: arrivals[0][:1]})
    engine = make_engine(llama, True)
    results = drive(engine, arrivals, aborts={when: ["gone"]})
    assert results["keep"] == alone["keep"]
    assert len(results["gone"]["tokens"]) < 8 and results["gone"]["finish"] is None
    assert engine.scheduler.blocks.num_free == engine.num_kv_blocks
    assert all(engine.scheduler.slots._refcounts[slot] == 0 for slot in range(2))
