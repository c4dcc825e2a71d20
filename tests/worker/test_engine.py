"""The offline engine API: events, stop conditions, seeded sampling, aborts, validation."""
from __future__ import annotations

import json
import shutil
import time

import pytest
import torch

from tests.hf_fixtures import ADAPTERS, adapter_dir
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams
from tests.worker.lora.slot_refs import refcount


def make_engine(model_dir, adapters_of=None, **kw) -> Engine:
    cache = CacheConfig(block_size=4, num_gpu_blocks_override=kw.pop("num_blocks", 256))
    engine = Engine(WorkerConfig(ModelConfig(str(model_dir), max_model_len=kw.pop("max_model_len", None)),
                                 cache=cache, lora=LoRAConfig(max_loras=2, max_lora_rank=16),
                                 scheduler=SchedulerConfig(**kw), device="cpu"))
    for spec in ADAPTERS:
        engine.add_adapter(spec.name, str(adapter_dir(adapters_of or model_dir, spec.name)))
    return engine


def run_all(engine: Engine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


@pytest.fixture(scope="module")
def llama(hf_models):
    return hf_models["llama"]


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SEEDED = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("adapter", [None, "r8-all"])
def test_seeded_request_gives_same_tokens_alone_and_in_different_batches(llama, adapter):
    alone = make_engine(llama)
    alone.add_request("x", prompt(9), SEEDED, adapter)
    reference = tokens_of(run_all(alone)["x"])
    for mates in (3, 7):
        engine = make_engine(llama, max_num_batched_tokens=24)
        for j in range(mates):   # unseeded and differently seeded mates, mixed adapters, before and after
            params = SamplingParams(temperature=1.0, max_tokens=5 + j, ignore_eos=True,
                                    seed=None if j % 2 else j)
            engine.add_request(f"m{j}", prompt(4 + 3 * j, seed=j + 1), params, ADAPTERS[j % 3].name)
            if j == 1:
                engine.add_request("x", prompt(9), SEEDED, adapter)
        assert tokens_of(run_all(engine)["x"]) == reference


def test_events_carry_one_token_per_step_and_finish_once(llama):
    engine = make_engine(llama)
    engine.add_request("a", prompt(5), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    outs = run_all(engine)["a"]
    assert [len(o.new_token_ids) for o in outs] == [1] * 6
    assert [o.finish_reason for o in outs] == [None] * 5 + ["length"]
    assert all(o.num_prompt_tokens == 5 for o in outs)


def test_stop_token_id_ends_with_stop_reason(llama):
    engine = make_engine(llama)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    engine.add_request("a", prompt(5), greedy)
    free_run = tokens_of(run_all(engine)["a"])
    stop_at = free_run[3]
    first = free_run.index(stop_at)
    engine.add_request("b", prompt(5), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                      stop_token_ids=[stop_at]))
    outs = run_all(engine)["b"]
    assert tokens_of(outs) == free_run[:first + 1]
    assert (outs[-1].finish_reason, outs[-1].stop_reason) == ("stop", stop_at)


def test_eos_stops_unless_ignored_and_min_tokens_suppresses_it(llama, tmp_path):
    engine = make_engine(llama)
    engine.add_request("a", prompt(5), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    free_run = tokens_of(run_all(engine)["a"])
    eos = free_run[2]
    model = tmp_path / "model"          # the same model with its third greedy token declared eos
    shutil.copytree(llama, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    engine = make_engine(model, adapters_of=llama)
    for name, params in {"b": SamplingParams(temperature=0.0, max_tokens=8),
                         "c": SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                         "d": SamplingParams(temperature=0.0, max_tokens=8, min_tokens=6)}.items():
        engine.add_request(name, prompt(5), params)
    outs = run_all(engine)
    first = free_run.index(eos)
    assert tokens_of(outs["b"]) == free_run[:first + 1] and outs["b"][-1].finish_reason == "stop"
    assert outs["b"][-1].stop_reason is None
    assert tokens_of(outs["c"]) == free_run and outs["c"][-1].finish_reason == "length"
    assert eos not in tokens_of(outs["d"])[:6] and tokens_of(outs["d"])[:2] == free_run[:2]


def test_min_tokens_masks_stop_token_ids(llama):
    engine = make_engine(llama)
    engine.add_request("a", prompt(5), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    free_run = tokens_of(run_all(engine)["a"])
    stop = free_run[1]
    engine.add_request("b", prompt(5), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                      stop_token_ids=[stop], min_tokens=4))
    out = tokens_of(run_all(engine)["b"])
    assert out[0] == free_run[0] and stop not in out[:4]


def test_a_request_lists_are_read_at_its_first_step_and_never_after(llama):
    """allowed_token_ids and bad words are walked when the request first samples; its later steps reuse what was
    built then."""
    allowed, words = CountedList(prompt(300, seed=1)), CountedList([[7, 8], [9]] * 100)
    engine = make_engine(llama)
    engine.add_request("a", prompt(6), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                   repetition_penalty=1.2, allowed_token_ids=allowed,
                                                   bad_words_token_ids=words))
    first = engine.step()
    reads = (allowed.reads, words.reads)
    outs = tokens_of(first + [o for o in run_all(engine).get("a", [])])
    assert len(outs) == 8 and set(outs) <= set(allowed) - {9}
    assert (allowed.reads, words.reads) == (reads[0] + 1, reads[1])   # +1: the check above


class CountedList(list):
    """A list that counts how often it is iterated."""

    def __init__(self, values):
        super().__init__(values)
        self.reads = 0

    def __iter__(self):
        self.reads += 1
        return super().__iter__()


def test_logprobs_match_log_softmax_of_captured_logits(llama):
    engine = make_engine(llama)
    captured = []
    execute = engine.runner.execute

    def capture(batch, prev=None):
        out = execute(batch, prev)
        captured.append(out.logits.clone())
        return out

    engine.runner.execute = capture
    engine.add_request("a", prompt(6), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=5))
    outs = run_all(engine)["a"]
    assert len(outs) == len(captured) == 3          # one output, one forward pass per token
    for out, logits in zip(outs, captured, strict=True):
        ref = torch.log_softmax(logits[0].double(), -1)
        (lp,) = out.new_logprobs
        assert lp.token_id == out.new_token_ids[0] and lp.rank == 1
        assert lp.logprob == pytest.approx(ref[lp.token_id].item(), abs=1e-5)
        assert [t for t, _ in lp.top] == ref.topk(5).indices.tolist()


def test_abort_frees_blocks_and_adapter_reference(llama):
    engine = make_engine(llama, num_blocks=64)
    free = engine.scheduler.blocks.num_free
    engine.add_request("a", prompt(30), SamplingParams(max_tokens=50, ignore_eos=True), "r4-qv")
    engine.add_request("b", prompt(10), SamplingParams(max_tokens=50, ignore_eos=True), "r8-all")
    engine.step()
    engine.step()
    assert engine.scheduler.blocks.num_free < free
    out = engine.abort_request("a")
    assert out.finish_reason == "abort"
    engine.abort_request("b")
    assert engine.scheduler.blocks.num_free == free
    assert not engine.has_unfinished() and engine.num_running == 0
    assert all(refcount(engine.scheduler.slots, r) == 0 for r in engine.adapters.registry.refs.values())
    assert engine.abort_request("a") is None


def test_request_larger_than_the_pool_ends_with_error_and_others_finish(llama):
    engine = make_engine(llama, num_blocks=8)   # 32 token positions
    engine.add_request("big", prompt(40), SamplingParams(max_tokens=4, ignore_eos=True))
    engine.add_request("ok", prompt(5), SamplingParams(max_tokens=4, ignore_eos=True))
    outs = run_all(engine)
    assert outs["big"][-1].finish_reason == "error" and "KV-cache" in outs["big"][-1].error
    assert len(tokens_of(outs["ok"])) == 4


@pytest.mark.parametrize("tokens, params, message", [
    ([], SamplingParams(), "prompt cannot be empty"),
    ([1, 320], SamplingParams(), "Token id 320 is out of vocabulary"),
    ([1] * 64, SamplingParams(), "maximum context length is 64 tokens"),
    ([1, 2], SamplingParams(max_tokens=0), "max_tokens must be at least 1"),
    ([1, 2], SamplingParams(logprobs=21), "logprobs must be in [0, 20]"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
])
def test_invalid_requests_are_refused_with_the_field_named(llama, tokens, params, message):
    engine = make_engine(llama, max_model_len=64)
    with pytest.raises(ValueError) as err:
        engine.add_request("a", tokens, params)
    assert message in str(err.value)
    assert not engine.has_unfinished()


def test_unknown_adapter_is_refused(llama):
    engine = make_engine(llama)
    with pytest.raises(ValueError, match="The model `nope` does not exist."):
        engine.add_request("a", [1, 2], SamplingParams(), "nope")


def test_load_inplace_keeps_in_flight_requests_on_the_old_weights(llama):
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = {}
    for name in ("r4-qv", "r8-all"):
        engine = make_engine(llama)
        engine.add_request("a", prompt(7), greedy, name)
        expected[name] = tokens_of(run_all(engine)["a"])
    engine = make_engine(llama)
    engine.add_adapter("live", str(adapter_dir(llama, "r4-qv")))
    engine.add_request("old", prompt(7), greedy, "live")
    engine.step()
    engine.step()
    engine.add_adapter("live", str(adapter_dir(llama, "r8-all")), load_inplace=True)
    engine.add_request("new", prompt(7), greedy, "live")
    outs = run_all(engine)
    assert tokens_of(outs["old"])[-6:] == expected["r4-qv"][-6:]
    assert tokens_of(outs["new"]) == expected["r8-all"]


@pytest.mark.parametrize("chunk", [2048, 8])
def test_prompt_logprobs_score_each_prompt_token_once(llama, chunk):
    """Prompt logprobs equal log_softmax of HF's logits at the previous position, also when chunked."""
    from transformers import AutoModelForCausalLM
    tokens = prompt(21, seed=5)
    engine = make_engine(llama, max_num_batched_tokens=chunk)
    engine.add_request("a", tokens, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True,
                                                   prompt_logprobs=3))
    outs = run_all(engine)["a"]
    scored = outs[0].prompt_logprobs
    assert scored[0] is None and len(scored) == len(tokens) and outs[1].prompt_logprobs is None
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), -1)   # [n, vocab]
    for p, lp in enumerate(scored[1:]):
        assert lp.token_id == tokens[p + 1]
        assert lp.logprob == pytest.approx(ref[p, tokens[p + 1]].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == ref[p].topk(3).indices.tolist()
        assert lp.rank == int((ref[p] > ref[p, tokens[p + 1]]).sum()) + 1


def test_first_output_carries_the_queue_time_from_arrival_to_first_schedule(llama):
    """One sequence at a time: the request queued behind a whole run of another waits longer than the one
    admitted at once, at least until the other's first token; only first outputs carry it."""
    engine = make_engine(llama, max_num_seqs=1)
    engine.add_request("a", prompt(5), SamplingParams(max_tokens=3, ignore_eos=True))
    engine.add_request("b", prompt(5, 1), SamplingParams(max_tokens=3, ignore_eos=True))
    start = time.monotonic()
    outs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
            if out.request_id == "a" and out.queue_time is not None:
                a_first = time.monotonic() - start    # a still runs for two more tokens: b is not admitted yet
    assert [o.queue_time is None for o in outs["a"]] == [False, True, True]
    assert [o.queue_time is None for o in outs["b"]] == [False, True, True]
    assert 0 <= outs["a"][0].queue_time < a_first <= outs["b"][0].queue_time


def test_steps_on_the_cpu_are_never_delayed(llama):
    """Late launch paces a host that runs ahead of a device; on the CPU the step is the host's own work."""
    engine = make_engine(llama)
    assert engine.launch_delay() == 0.0
    engine.add_request("a", prompt(9), SamplingParams(max_tokens=6, ignore_eos=True))
    delays = []
    while engine.has_unfinished():
        engine.step()
        delays.append(engine.launch_delay())
    assert delays == [0.0] * len(delays) and engine._pacer is None
