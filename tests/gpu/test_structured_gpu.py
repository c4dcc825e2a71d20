"""Constrained decoding on the GPU with CUDA graphs: outputs follow their specs beside unconstrained rows, decode
steps still replay graphs, async scheduling gives the tokens of synchronous steps, and no step syncs the host."""
from __future__ import annotations

import json

import pytest
import torch

from tests.structured_cases import SPECS, check
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.demo import ADAPTERS
from worker.engine import Engine
from worker.ipc.messages import SamplingParams, StructuredOutput

pytestmark = pytest.mark.gpu
ADAPTER_NAMES = [None] + [a.name for a in ADAPTERS]


def make_engine(demo, async_scheduling: bool = True) -> Engine:
    engine = Engine(WorkerConfig(
        ModelConfig(str(demo.model_dir), dtype="bfloat16"), cache=CacheConfig(num_gpu_blocks_override=1024),
        lora=LoRAConfig(max_loras=4, max_lora_rank=16), scheduler=SchedulerConfig(max_num_seqs=32),
        device="cuda", enforce_eager=False, async_scheduling=async_scheduling))
    for name, path in demo.adapters.items():
        engine.add_adapter(name, str(path))
    return engine


def run(engine: Engine, requests: dict) -> dict[str, list]:
    for request_id, (prompt, params, adapter) in requests.items():
        engine.add_request(request_id, prompt, params, adapter)
    outputs: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def mixed_requests(tokenizer, num_free: int = 24) -> dict:
    """A batch with a quarter of its rows constrained (every kind of spec), the rest free, over adapters."""
    requests = {}
    for i, (kind, spec) in enumerate(SPECS):
        params = SamplingParams(max_tokens=300, temperature=1.0, seed=i, structured=StructuredOutput(kind, spec, False),
                                logit_bias={4: 4.0, 95: 4.0, 693: 4.0} if kind == "json_object" else None)
        requests[f"c{i}-{kind}"] = (tokenizer.encode(f"case {i}").ids, params, ADAPTER_NAMES[i % len(ADAPTER_NAMES)])
    for j in range(num_free):
        params = SamplingParams(max_tokens=64, temperature=0.8, seed=j, ignore_eos=True)
        requests[f"free-{j}"] = (tokenizer.encode(f"free {j}").ids, params, ADAPTER_NAMES[j % len(ADAPTER_NAMES)])
    return requests


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_constrained_rows_follow_their_specs_and_decode_replays_graphs(demo, tokenizer, async_scheduling):
    engine = make_engine(demo, async_scheduling)
    requests = mixed_requests(tokenizer)
    outputs = run(engine, requests)
    eos = engine.eos_token_ids[0]
    for request_id, (_, params, _) in requests.items():
        outs = outputs[request_id]
        assert outs[-1].error is None, outs[-1].error
        if params.structured is not None:
            assert outs[-1].finish_reason == "stop", request_id
            ids = [t for o in outs for t in o.new_token_ids if t != eos]
            check(params.structured.kind, params.structured.spec, tokenizer.decode(ids, skip_special_tokens=False))
    assert engine.runner.graph_runner.replays["decode"] > 0


def test_async_and_sync_scheduling_give_identical_constrained_tokens(demo, tokenizer):
    """Async scheduling files the token in flight before a constrained row samples: its tokens are those of
    synchronous steps. One request at a time, so both engines run batches of one row (the same kernels)."""
    tokens = []
    for async_scheduling in (True, False):
        engine = make_engine(demo, async_scheduling)
        out = {}
        for i, (kind, spec) in enumerate(SPECS):
            params = SamplingParams(max_tokens=100, temperature=1.0, seed=i,
                                    structured=StructuredOutput(kind, spec, True))
            outs = run(engine, {"x": (tokenizer.encode(f"case {i}").ids, params, ADAPTER_NAMES[i % 3])})["x"]
            out[kind, spec] = [t for o in outs for t in o.new_token_ids]
        tokens.append(out)
    assert tokens[0] == tokens[1]


def test_constrained_steps_make_no_host_device_sync(demo, tokenizer):
    engine = make_engine(demo)
    run(engine, mixed_requests(tokenizer, num_free=4))        # warm-up: kernels compiled, grammars cached
    requests = mixed_requests(tokenizer, num_free=12)
    for request_id, (prompt, params, adapter) in requests.items():
        engine.add_request(request_id, prompt, params, adapter)
    while engine.structured.num_compiling:                     # cached: ready at the first step
        engine.step()
    torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_bad_schema_is_refused_and_the_batch_goes_on(demo, tokenizer):
    engine = make_engine(demo)
    bad = SamplingParams(structured=StructuredOutput("json", json.dumps({"type": "nope"})))
    outputs = run(engine, {"bad": (tokenizer.encode("x").ids, bad, None),
                           "good": (tokenizer.encode("y").ids, SamplingParams(max_tokens=8, ignore_eos=True), None)})
    assert outputs["bad"][-1].status_code == 400 and "Unsupported type" in outputs["bad"][-1].error
    assert outputs["good"][-1].finish_reason == "length"
