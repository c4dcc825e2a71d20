"""Automatic prefix caching in the real engine (tiny random Llama on the CPU): caching on gives the tokens
and logits of caching off, per adapter and version, and what HF + PEFT give for each request alone.

With caching on, a request's suffix runs in other rows and chunks than with it off (cached K/V are reused as is):
float sums in another order, so "the same" is within the fp32 summation-order bound of tests/fp32_bounds.py, and
greedy tokens equal up to a near-tie (assert_same)."""
from __future__ import annotations

import pytest
import torch

from tests.fp32_bounds import assert_same_until_a_tie, forward_rtol
from tests.hf_fixtures import ADAPTERS, adapter_dir
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams

BLOCK = 8
SYSTEM = 37                 # tokens of each shared system prompt: 4 full blocks of 8 are cached
ADAPTER_NAMES = [None] + [spec.name for spec in ADAPTERS]


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_engine(model_dir, caching: bool, num_blocks: int = 256, async_scheduling: bool = True,
                **sched) -> Engine:
    cache = CacheConfig(block_size=BLOCK, num_gpu_blocks_override=num_blocks, enable_prefix_caching=caching)
    engine = Engine(WorkerConfig(ModelConfig(str(model_dir)), cache=cache, lora=LoRAConfig(max_loras=2),
                                 scheduler=SchedulerConfig(**sched), device="cpu",
                                 async_scheduling=async_scheduling))
    for spec in ADAPTERS:
        engine.add_adapter(spec.name, str(adapter_dir(model_dir, spec.name)))
    engine.logits = capture_logits(engine)
    return engine


def capture_logits(engine: Engine) -> dict[str, list[torch.Tensor]]:
    """The logits row of every sampling sequence, per request id in step order (the runner's forward pass,
    which every step runs, whether the engine then samples at once or after filing the tokens in flight)."""
    logits: dict[str, list[torch.Tensor]] = {}
    forward = engine.runner.forward

    def capture(batch, prev=None):
        handle = forward(batch, prev)
        for seq, row in zip((s for s in batch.seqs if s.samples), handle.logits):
            logits.setdefault(seq.request.request_id, []).append(row.clone())
        return handle
    engine.runner.forward = capture
    return logits


def run_waves(engine: Engine, waves, max_tokens: int = 6, prompt_logprobs=None) -> dict[str, dict]:
    """Each wave's requests (id, prompt, adapter) added together, run to the end before the next wave;
    per request id: tokens, cached prompt tokens (first output), prompt logprobs, sampled logits, and the
    summation-order bound (relative) of the model over the request's sequence."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs)
    results: dict[str, dict] = {}
    for wave in waves:
        for request_id, prompt, adapter in wave:
            engine.add_request(request_id, prompt, params, adapter)
            results[request_id] = {"tokens": [], "cached": None, "prompt_logprobs": None,
                                   "rtol": forward_rtol(engine.runner.model.cfg, len(prompt) + max_tokens)}
        while engine.has_unfinished():
            for out in engine.step():
                row = results[out.request_id]
                row["tokens"] += out.new_token_ids
                row["cached"] = row["cached"] if out.num_cached_tokens is None else out.num_cached_tokens
                row["prompt_logprobs"] = row["prompt_logprobs"] or out.prompt_logprobs
    for request_id, row in results.items():
        row["logits"] = torch.stack(engine.logits[request_id])
    return results


def assert_same(on: dict, off: dict) -> None:
    """Per request: the same greedy tokens and logits within the summation-order bound, up to a near-tie."""
    for request_id, row in off.items():
        assert_same_until_a_tie(on[request_id]["tokens"], row["tokens"], row["logits"], on[request_id]["logits"],
                                row["rtol"], f"{request_id} with caching on")


def shared_prefix_waves(num_systems: int = 2):
    """Wave 1 computes each system prompt under every adapter and the base; wave 2 asks again with new user
    turns (hits), and wave 3 asks under other adapters than the ones that computed each prefix first."""
    systems = [tokens(SYSTEM, seed=100 + s) for s in range(num_systems)]
    first = [(f"w1-{s}-{a}", systems[s] + tokens(5, seed=10 * s + i), a)
             for s in range(num_systems) for i, a in enumerate(ADAPTER_NAMES)]
    second = [(f"w2-{s}-{a}-{k}", systems[s] + tokens(3 + k, seed=1000 + 10 * s + k), a)
              for s in range(num_systems) for a in ADAPTER_NAMES for k in range(2)]
    return systems, [first, second]


@pytest.fixture(scope="module")
def llama(hf_models):
    return hf_models["llama"]


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("chunk", [2048, 8])
def test_shared_prefix_traffic_over_base_and_adapters_equals_caching_off(llama, async_scheduling, chunk):
    _, waves = shared_prefix_waves()
    results = {}
    for caching in (True, False):
        engine = make_engine(llama, caching, async_scheduling=async_scheduling, max_num_batched_tokens=chunk)
        results[caching] = run_waves(engine, waves)
    assert_same(results[True], results[False])
    cached = {rid: row["cached"] for rid, row in results[True].items()}
    assert all(cached[rid] == 0 for rid, _, _ in waves[0])
    assert all(cached[rid] == 32 for rid, _, _ in waves[1])
    assert all(row["cached"] == 0 for row in results[False].values())


def test_prefix_of_adapter_a_then_asked_under_adapter_b_and_the_base(llama):
    """The prefix exists only under r8-all; r4-qv and the base must compute it themselves."""
    system = tokens(SYSTEM, seed=7)
    waves = [[("a", system + [5, 6, 7], "r8-all")],
             [("b", system + [8, 9], "r4-qv"), ("base", system + [10, 11], None), ("a2", system + [12], "r8-all")]]
    on, off = run_waves(make_engine(llama, True), waves), run_waves(make_engine(llama, False), waves)
    assert_same(on, off)
    assert (on["b"]["cached"], on["base"]["cached"], on["a2"]["cached"]) == (0, 0, 32)


def test_after_load_inplace_the_new_version_equals_a_fresh_engine(llama):
    system = tokens(SYSTEM, seed=8)
    engine = make_engine(llama, True)
    engine.add_adapter("live", str(adapter_dir(llama, "r4-qv")))
    run_waves(engine, [[("old", system + [3], "live")]])
    engine.add_adapter("live", str(adapter_dir(llama, "r8-all")), load_inplace=True)
    new = run_waves(engine, [[("new", system + [4], "live")], [("again", system + [5], "live")]])
    fresh = make_engine(llama, False)
    fresh.add_adapter("live", str(adapter_dir(llama, "r8-all")))
    expected = run_waves(fresh, [[("new", system + [4], "live")], [("again", system + [5], "live")]])
    assert_same(new, expected)
    assert (new["new"]["cached"], new["again"]["cached"]) == (0, 32)


def test_unload_and_reload_of_a_name_finds_nothing_of_the_old_adapter(llama):
    system = tokens(SYSTEM, seed=9)
    engine = make_engine(llama, True)
    engine.add_adapter("x", str(adapter_dir(llama, "r4-qv")))
    run_waves(engine, [[("old", system + [3], "x")]])
    engine.remove_adapter("x")
    engine.add_adapter("x", str(adapter_dir(llama, "r16-mlp-rs")))
    reloaded = run_waves(engine, [[("new", system + [4], "x")]])
    expected = run_waves(make_engine(llama, False), [[("new", system + [4], "r16-mlp-rs")]])
    assert_same(reloaded, expected)
    assert reloaded["new"]["cached"] == 0


def test_cache_hits_match_hf_peft(llama):
    from tests.worker.test_engine_vs_hf import NUM_DECODE, hf_reference
    _, waves = shared_prefix_waves(num_systems=1)
    second = waves[1][::2]
    on = run_waves(make_engine(llama, True), [waves[0], second], max_tokens=NUM_DECODE + 1)
    for request_id, prompt, adapter in second:
        assert on[request_id]["cached"] == 32
        hf_tokens, hf_logits = hf_reference(llama, prompt, adapter)
        assert on[request_id]["tokens"] == hf_tokens, f"{request_id}: greedy tokens differ from HF + PEFT"
        rel = (on[request_id]["logits"] - hf_logits).abs().max() / hf_logits.abs().max()
        assert rel < 1e-4, f"{request_id}: logits differ from HF + PEFT by {rel:.2e} relative"


def test_eviction_under_a_small_pool_equals_caching_off(llama):
    """12 blocks of 8 hold 96 tokens: each wave's prefixes evict the previous ones', then come back."""
    systems = [tokens(SYSTEM, seed=200 + s) for s in range(3)]
    waves = [[(f"{k}-{s}", systems[s] + tokens(4, seed=300 + 10 * k + s), ADAPTER_NAMES[(s + k) % 2])]
             for k in range(2) for s in range(3)]
    engine = make_engine(llama, True, num_blocks=12)
    evicted = []
    allocate = engine.scheduler.blocks.allocate

    def counting(n):
        before = engine.scheduler.blocks.num_cached
        block_ids = allocate(n)
        evicted.append(before - engine.scheduler.blocks.num_cached)
        return block_ids
    engine.scheduler.blocks.allocate = counting
    on = run_waves(engine, waves)
    assert_same(on, run_waves(make_engine(llama, False, num_blocks=12), waves))
    assert sum(evicted) > 0


def test_preemption_with_cached_blocks_equals_caching_off(llama):
    """Eight requests sharing two prefixes in a 20-block pool: they preempt one another while sharing; each
    recompute sums in its own order."""
    systems = [tokens(SYSTEM, seed=400 + s) for s in range(2)]
    waves = [[("seed-0", systems[0] + [3], None), ("seed-1", systems[1] + [4], "r8-all")],
             [(f"r{i}", systems[i % 2] + tokens(6, seed=500 + i), [None, "r8-all"][i % 2]) for i in range(8)]]
    engine = make_engine(llama, True, num_blocks=20)
    on = run_waves(engine, waves, max_tokens=12)
    assert engine.num_preemptions > 0
    assert_same(on, run_waves(make_engine(llama, False, num_blocks=20), waves, max_tokens=12))


def test_prompt_logprobs_take_no_hit_and_score_every_position(llama):
    system = tokens(SYSTEM, seed=11)
    waves = [[("warm", system + [3], None)], [("scored", system + [4, 5], None)]]
    on = run_waves(make_engine(llama, True), waves, prompt_logprobs=2)
    off = run_waves(make_engine(llama, False), waves, prompt_logprobs=2)
    assert_same(on, off)
    assert on["scored"]["cached"] == 0 and len(on["scored"]["prompt_logprobs"]) == SYSTEM + 2
    assert on["scored"]["prompt_logprobs"] == off["scored"]["prompt_logprobs"]


def test_queries_and_hits_count_prompt_tokens(llama):
    system = tokens(SYSTEM, seed=12)
    engine = make_engine(llama, True)
    run_waves(engine, [[("a", system + [3], "r4-qv")], [("b", system + [4, 5], "r4-qv")]])
    assert (engine.prefix_cache_queries, engine.prefix_cache_hits) == (SYSTEM + 1 + SYSTEM + 2, 32)
    off = make_engine(llama, False)
    run_waves(off, [[("a", system + [3], "r4-qv")]])
    assert (off.prefix_cache_queries, off.prefix_cache_hits) == (0, 0)


def test_reset_prefix_cache_forgets_every_block_once_none_is_in_use(llama):
    system = tokens(SYSTEM, seed=13)
    engine = make_engine(llama, True)
    run_waves(engine, [[("a", system + [3], None)]])
    engine.add_request("busy", system + [4], SamplingParams(max_tokens=2), None)
    engine.step()
    assert not engine.reset_prefix_cache()              # "busy" holds blocks: nothing changes, as in vLLM
    while engine.has_unfinished():
        engine.step()
    assert engine.reset_prefix_cache()
    after = run_waves(engine, [[("b", system + [5], None)]])
    assert after["b"]["cached"] == 0 and engine.scheduler.blocks.num_free == engine.num_kv_blocks
