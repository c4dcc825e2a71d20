"""The engine at --tensor-parallel-size 2 on the CPU (rank 0 here, rank 1 a follower process, gloo): the same
outputs as at size 1 for greedy and seeded requests mixing the base model and adapters, with chunked prefill,
preemption, prompt logprobs and a load_inplace; a follower that dies is reported, not waited for.

"The same" within the fp32 summation-order bound of tests/fp32_bounds.py (both sizes run at torch's default thread
count, in this process and in the followers it starts): logits within δ, logprobs within 2δ, greedy tokens equal up
to a near-tie (the reference's token ahead by at most 2δ), after which that request is compared no further. Seeded
rows are held to exact tokens: a sampled token parts only where its exponential race is within 2δ of a tie, odds of
order δ a step, and the race's margin cannot be read from the outputs to excuse one."""
from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from tests.fp32_bounds import assert_logits_close, assert_same_until_a_tie, forward_rtol, logits_bound
from tests.hf_fixtures import ADAPTERS, adapter_dir, capture_sampled_logits
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)


def make_engine(model_dir, tp: int, num_blocks: int = 256, max_loras: int = 2, fully_sharded_loras: bool = False,
                **sched) -> Engine:
    engine = Engine(WorkerConfig(ModelConfig(str(model_dir)), cache=CacheConfig(block_size=4, num_gpu_blocks_override=num_blocks),
                                 lora=LoRAConfig(max_loras=max_loras, max_lora_rank=16,
                                                 fully_sharded_loras=fully_sharded_loras),
                                 scheduler=SchedulerConfig(**sched), device="cpu", tensor_parallel_size=tp))
    for spec in ADAPTERS:
        engine.add_adapter(spec.name, str(adapter_dir(model_dir, spec.name)))
    return engine


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Result:
    """One request's outputs and the logits [steps, vocab] it sampled from."""
    params: SamplingParams
    tokens: list[int]
    finish_reason: str | None
    logprobs: list[float]                  # of each sampled token
    prompt_logprobs: list | None
    logits: torch.Tensor


def run(engine: Engine, requests) -> tuple[dict[str, Result], float]:
    """Each request's Result, and the summation-order bound (relative) of the engine's model over them."""
    logits = capture_sampled_logits(engine)
    for rid, tokens, params, adapter in requests:
        engine.add_request(rid, tokens, params, adapter)
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    params = {rid: p for rid, _, p, _ in requests}
    results = {rid: Result(params[rid], [t for o in outs for t in o.new_token_ids], outs[-1].finish_reason,
                           [lp.logprob for o in outs for lp in (o.new_logprobs or [])], outs[0].prompt_logprobs,
                           torch.stack(logits[rid]))
               for rid, outs in outputs.items()}
    longest = max(len(tokens) + p.max_tokens for _, tokens, p, _ in requests)
    return results, forward_rtol(engine.runner.model.cfg, longest)


def assert_same_outputs(got: tuple[dict[str, Result], float], expected: tuple[dict[str, Result], float]) -> None:
    """Per request, as the module docstring says: tokens, logits and logprobs up to a greedy row's near-tie, and
    the finish reason of a request that did not part."""
    (got, _), (expected, rtol) = got, expected
    assert got.keys() == expected.keys()
    for rid, ref in expected.items():
        ours, steps = got[rid], len(ref.tokens)
        if ref.params.temperature == 0.0:
            steps = assert_same_until_a_tie(ours.tokens, ref.tokens, ref.logits, ours.logits, rtol, rid)
        else:
            assert ours.tokens == ref.tokens, f"{rid}: sampled tokens differ"
            assert_logits_close(ours.logits, ref.logits, rtol, f"{rid}: logits")
        if steps == len(ref.tokens):
            assert ours.finish_reason == ref.finish_reason, rid
        delta = logits_bound(ref.logits, rtol)
        assert ours.logprobs[:steps] == pytest.approx(ref.logprobs[:steps], rel=0, abs=2 * delta), rid
        assert (ours.prompt_logprobs is None) == (ref.prompt_logprobs is None), rid
        if ref.prompt_logprobs is not None:
            assert [lp is None for lp in ours.prompt_logprobs] == [lp is None for lp in ref.prompt_logprobs]
            assert [lp.logprob for lp in ours.prompt_logprobs[1:]] == pytest.approx(
                [lp.logprob for lp in ref.prompt_logprobs[1:]], rel=0, abs=2 * delta), f"{rid}: prompt logprobs"


def requests(seed: int = 0):
    names = [None] + [a.name for a in ADAPTERS]
    return [(f"r{i}", prompt(5 + 7 * i % 23, seed + i), GREEDY if i % 3 else SEEDED, names[i % len(names)])
            for i in range(8)]


@pytest.fixture
def both(hf_models):
    """(TP=1 engine factory, TP=2 engine factory) over the tiny Llama; every TP=2 engine is closed afterwards."""
    made = []

    def tp2(**kw):
        made.append(make_engine(hf_models["llama"], 2, **kw))
        return made[-1]
    yield (lambda **kw: make_engine(hf_models["llama"], 1, **kw)), tp2
    for engine in made:
        engine.followers.close()


@pytest.mark.parametrize("sched", [dict(), dict(max_num_batched_tokens=16, max_num_seqs=3),
                                   dict(num_blocks=24, max_num_seqs=8)],
                         ids=["one-step-prefill", "chunked", "preempting"])
def test_tp2_engine_outputs_equal_tp1(both, sched):
    tp1, tp2 = both
    engine = tp2(**sched)
    assert engine.runner.model.tp.world_size == 2 and engine.runner.model.num_kv_heads == 1   # 2 KV heads, split
    assert_same_outputs(run(engine, requests()), run(tp1(**sched), requests()))


def test_tp2_fully_sharded_loras_outputs_equal_tp1(both):
    """--fully-sharded-loras: every rank holds half of each adapter's lora_A of qkv/gate_up (by rank) and lora_B of
    o/down (by output), slots refilled as three adapters share two; tokens and logprobs as at TP=1."""
    tp1, tp2 = both
    engine = tp2(fully_sharded_loras=True)
    qkv, o = engine.runner.model.projection(0, "qkv_proj"), engine.runner.model.projection(0, "o_proj")
    assert qkv.lora.a.shape[1] == 3 * 8 and o.lora.b.shape[1] == o.weight.shape[0] // 2
    assert_same_outputs(run(engine, requests(5)), run(tp1(), requests(5)))


def test_tp2_prompt_logprobs_and_more_adapters_than_slots(both):
    """Three adapters over two slots: every slot is refilled while the other runs; prompt logprobs equal."""
    tp1, tp2 = both
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    reqs = [(f"p{i}", prompt(9 + i, 40 + i), params, ADAPTERS[i % len(ADAPTERS)].name) for i in range(6)]
    assert_same_outputs(run(tp2(max_loras=2), reqs), run(tp1(max_loras=2), reqs))


def test_tp2_load_inplace_reaches_the_follower(both, hf_models):
    tp1, tp2 = both
    llama = hf_models["llama"]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine = tp2()
    engine.add_adapter("live", str(adapter_dir(llama, "r4-qv")))
    first = run(engine, [("a", prompt(7, 1), greedy, "live")])
    engine.add_adapter("live", str(adapter_dir(llama, "r8-all")), load_inplace=True)
    second = run(engine, [("b", prompt(7, 1), greedy, "live")])
    reference = tp1()
    assert_same_outputs(first, run(reference, [("a", prompt(7, 1), greedy, "r4-qv")]))
    assert_same_outputs(second, run(reference, [("b", prompt(7, 1), greedy, "r8-all")]))


def test_a_dead_follower_is_reported(both, monkeypatch):
    reported = []
    monkeypatch.setattr("worker.ranks.group._exit_process", reported.append)
    _, tp2 = both
    engine = tp2()
    engine.followers._procs[0].kill()
    deadline = time.monotonic() + 20
    while not reported and time.monotonic() < deadline:
        time.sleep(0.05)
    assert reported and "Tensor-parallel rank 1 exited" in reported[0]


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_tp2_moe_engine_outputs_equal_tp1(hf_moe_models, arch):
    """Experts sharded along I (Qwen2-MoE with its shared expert), attention adapters mixed with base rows."""
    from tests.hf_fixtures import MOE_ADAPTERS

    def make(tp: int) -> Engine:
        engine = Engine(WorkerConfig(ModelConfig(str(hf_moe_models[arch])),
                                     cache=CacheConfig(block_size=4, num_gpu_blocks_override=256),
                                     lora=LoRAConfig(max_loras=2, max_lora_rank=16), device="cpu",
                                     tensor_parallel_size=tp))
        for spec in MOE_ADAPTERS:
            engine.add_adapter(spec.name, str(adapter_dir(hf_moe_models[arch], spec.name)))
        return engine
    names = [None] + [a.name for a in MOE_ADAPTERS]
    reqs = [(f"m{i}", prompt(6 + 5 * i, 70 + i), GREEDY, names[i % len(names)]) for i in range(6)]
    expected = run(make(1), reqs)
    engine = make(2)
    try:
        got = run(engine, reqs)
    finally:
        engine.followers.close()
    assert_same_outputs(got, expected)


def test_tp4_engine_outputs_equal_tp1(hf_models):
    """Four ranks (three followers) over 2 KV heads: each head replicated on two ranks; vocabulary in quarters."""
    expected = run(make_engine(hf_models["llama"], 1), requests(seed=5))
    engine = make_engine(hf_models["llama"], 4)
    try:
        assert engine.runner.model.tp.world_size == 4 and engine.runner.model.num_kv_heads == 1
        got = run(engine, requests(seed=5))
    finally:
        engine.followers.close()
    assert_same_outputs(got, expected)
