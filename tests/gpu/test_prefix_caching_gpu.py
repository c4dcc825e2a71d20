"""Prefix caching on the GPU, in CUDA-graph mode: hits over the base model and adapters give caching off's
tokens, track HF + PEFT, and never serve one adapter's prefix to another or to the base.

bf16 on the tiny random models rounds chaotically (tests/gpu/hf_compare.py), and with caching on a request's
suffix runs in other rows than with it off, so tokens are compared step by step up to the first step whose
top-two margin is inside the bf16 noise (2% of the step's largest logit); past it either token is right.
"""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tests.gpu.hf_compare import assert_bf16_tracks_hf, hf_teacher_forced
from tests.hf_fixtures import ADAPTERS, adapter_dir
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams

pytestmark = pytest.mark.gpu
NUM_STEPS = 16
BLOCK = 16
SYSTEM = 70                    # 4 full blocks of 16 are cached
NOISE = 0.02                   # a top-two margin below this share of the largest logit is a tie in bf16
ADAPTER_NAMES = [None] + [spec.name for spec in ADAPTERS]


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_engine(model_dir, caching: bool, enforce_eager: bool = False, **sched) -> Engine:
    """Adapters load in the admitting step (no overlap loading), so both engines run the same first wave."""
    engine = Engine(WorkerConfig(
        ModelConfig(str(model_dir), dtype="bfloat16"),
        cache=CacheConfig(block_size=BLOCK, num_gpu_blocks_override=512, enable_prefix_caching=caching),
        lora=LoRAConfig(max_loras=4, max_lora_rank=16, enable_lora_overlap_loading=False),
        scheduler=SchedulerConfig(max_num_seqs=16, **sched), device="cuda", enforce_eager=enforce_eager))
    for spec in ADAPTERS:
        engine.add_adapter(spec.name, str(adapter_dir(model_dir, spec.name)))
    return engine


def run_waves(engine: Engine, waves) -> dict[str, dict]:
    """Each wave (request id, prompt, adapter) run to the end before the next: tokens, cached prompt tokens
    and the sampled logits rows (float32, on the host) per request id."""
    logits = defaultdict(list)
    forward = engine.runner.forward

    def capture(batch, prev=None):
        handle = forward(batch, prev)
        for seq, row in zip((s for s in batch.seqs if s.samples), handle.logits):
            logits[seq.request.request_id].append(row.float().cpu())
        return handle
    engine.runner.forward = capture
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True)
    results = {}
    for wave in waves:
        for request_id, prompt, adapter in wave:
            engine.add_request(request_id, prompt, params, adapter)
            results[request_id] = {"tokens": [], "cached": None, "prompt": prompt, "adapter": adapter}
        while engine.has_unfinished():
            for out in engine.step():
                row = results[out.request_id]
                row["tokens"] += out.new_token_ids
                row["cached"] = row["cached"] if out.num_cached_tokens is None else out.num_cached_tokens
    for request_id, row in results.items():
        row["logits"] = torch.stack(logits[request_id])
    return results


def assert_same_tokens_until_a_tie(on: dict, off: dict) -> None:
    for request_id, row in off.items():
        top2 = row["logits"].topk(2, dim=-1).values
        ties = ((top2[:, 0] - top2[:, 1]) < NOISE * row["logits"].abs().amax(dim=-1)).nonzero()
        until = int(ties[0]) + 1 if len(ties) else NUM_STEPS
        assert on[request_id]["tokens"][:until] == row["tokens"][:until], \
            f"{request_id}: tokens differ with caching on before any tie (first tie at step {until - 1})"


def waves():
    """Wave 1 computes two system prompts: the first under r8-all only, the second under every adapter and the
    base. Wave 2 asks for both under every adapter and the base: hits on the second, and on the first only for
    r8-all (the others must compute it, never take r8-all's)."""
    systems = [tokens(SYSTEM, seed=100 + s) for s in range(2)]
    first = [("w1-0-r8-all", systems[0] + tokens(5, seed=1), "r8-all")]
    first += [(f"w1-1-{a}", systems[1] + tokens(5, seed=10 + i), a) for i, a in enumerate(ADAPTER_NAMES)]
    second = [(f"w2-{s}-{a}", systems[s] + tokens(7, seed=100 + 10 * s + i), a)
              for s in range(2) for i, a in enumerate(ADAPTER_NAMES)]
    return [first, second]


@pytest.mark.parametrize("chunk", [None, 32], ids=["whole-prompts", "chunked-prefill"])
def test_caching_on_gives_caching_offs_tokens_in_graph_mode(hf_models, chunk):
    sched = {} if chunk is None else {"max_num_batched_tokens": chunk}
    engine = make_engine(hf_models["llama"], caching=True, **sched)
    on = run_waves(engine, waves())
    off = run_waves(make_engine(hf_models["llama"], caching=False, **sched), waves())
    graphs = engine.runner.graph_runner.replays
    assert graphs["mixed"] >= 1 and graphs["decode"] > 1
    assert_same_tokens_until_a_tie(on, off)
    expected = {f"w2-1-{a}": 64 for a in ADAPTER_NAMES} | {f"w2-0-{a}": 64 if a == "r8-all" else 0
                                                           for a in ADAPTER_NAMES}
    assert {rid: on[rid]["cached"] for rid in expected} == expected
    assert engine.prefix_cache_hits == sum(expected.values())


def test_cache_hits_in_graph_mode_track_hf_peft(hf_models):
    model_dir = hf_models["llama"]
    on = run_waves(make_engine(model_dir, caching=True), waves())
    for request_id, row in on.items():
        if not request_id.startswith("w2-1-"):
            continue
        assert row["cached"] == 64
        path = None if row["adapter"] is None else adapter_dir(model_dir, row["adapter"])
        refs = [hf_teacher_forced(model_dir, path, row["prompt"], row["tokens"], dtype)
                for dtype in (torch.float32, torch.bfloat16)]
        print(assert_bf16_tracks_hf(row["logits"], row["tokens"], *refs, f"{request_id} (cache hit, graphs)"))
