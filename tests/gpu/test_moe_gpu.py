"""MoE models with expert LoRA on the GPU: bf16 against HF transformers + PEFT, CUDA graphs against eager, an
adapter and expert mix replayed without recapture, and no host-device sync with adapter loads in flight."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tests.gpu.hf_compare import assert_bf16_tracks_hf, hf_teacher_forced
from tests.moe_fixtures import HandExpertAdapter, PeftExpertAdapter, save_hand_expert_adapter, save_peft_expert_adapter
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams
from worker.arch import ArchConfig
from worker.models.builder import lora_targets

pytestmark = pytest.mark.gpu
NUM_STEPS = 32
# (prompt length, adapter); base-only rows among rows of PEFT target_parameters adapters of mixed ranks (one
# with attention LoRA, and on Qwen2-MoE shared-expert and dense-layer MLP LoRA too)
ROWS = [(7, None), (23, "tp-attn"), (5, "tp-r8"), (40, None), (11, "tp-r8"), (17, "tp-attn"), (9, None)]
SHARED_OUTER = "shared-outer"      # a stacked shared-outer adapter (no PEFT form): graphs against eager only


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "qwen2_moe"])
def moe_model(request, hf_moe_models, tmp_path_factory):
    """(model directory, adapter name -> directory): a tiny random MoE checkpoint (tests/hf_fixtures.py) with
    expert adapters (tests/moe_fixtures.py)."""
    arch = request.param
    model_dir, root = hf_moe_models[arch], tmp_path_factory.mktemp(f"gpu-experts-{arch}")
    mlp = ("gate_proj", "up_proj", "down_proj") if arch == "qwen2_moe" else ()
    specs = (PeftExpertAdapter("tp-attn", 4, alpha=8, modules=("q_proj", "v_proj", *mlp),
                               rank_pattern={"down_proj": 2}),
             PeftExpertAdapter("tp-r8", 8, alpha=16, use_rslora=True, rank_pattern={"gate_up_proj": 6}))
    paths = {spec.name: root / spec.name for spec in specs}
    for i, spec in enumerate(specs):
        save_peft_expert_adapter(model_dir, spec, paths[spec.name], seed=200 + i)
    shape = lora_targets(ArchConfig.from_dir(model_dir)).experts
    paths[SHARED_OUTER] = root / SHARED_OUTER
    save_hand_expert_adapter(HandExpertAdapter(SHARED_OUTER, "stacked", (6, 6, 4), shared_outer=True),
                             [layer for layer in range(shape.num_layers) if layer not in shape.dense_layers], shape,
                             arch == "mixtral", paths[SHARED_OUTER], seed=300)
    return model_dir, paths


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(2, 320, (n,), generator=gen).tolist() for n, _ in ROWS]


def make_engine(moe_model, enforce_eager: bool, overlap_loading: bool = False, **sched) -> Engine:
    model_dir, paths = moe_model
    engine = Engine(WorkerConfig(
        ModelConfig(str(model_dir), dtype="bfloat16"), cache=CacheConfig(num_gpu_blocks_override=512),
        lora=LoRAConfig(max_loras=2, max_lora_rank=8, enable_lora_overlap_loading=overlap_loading),   # 3 adapters
        scheduler=SchedulerConfig(max_num_seqs=16, **sched), device="cuda", enforce_eager=enforce_eager))
    for name, path in paths.items():
        engine.add_adapter(name, str(path))
    return engine


def run(engine: Engine, rows=ROWS, capture_logits: bool = False):
    """Greedy tokens per request and, with capture_logits, each sampled row's logits."""
    logits = defaultdict(list)
    if capture_logits:
        execute = engine.runner.execute

        def capture(batch, prev=None):
            out = execute(batch, prev)
            for seq, row in zip((s for s in batch.seqs if s.samples), out.logits):
                logits[seq.request.request_id].append(row.float().cpu())
            return out
        engine.runner.execute = capture
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True)
    for i, (prompt, (_, adapter)) in enumerate(zip(prompts(), rows)):
        engine.add_request(f"r{i}", prompt, params, adapter)
    tokens = defaultdict(list)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens, logits


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("num_rows", [len(ROWS), 2], ids=["grouped-batch", "no-sort-batch"])
def test_moe_bf16_matches_hf_peft(moe_model, enforce_eager, num_rows):
    """Along our 32 greedy tokens per row (base-only rows beside two expert adapters; at 2 rows the decode
    steps take the no-sort path, kernels/fused_moe.py): our bf16 logits within hf_compare.BF16_ERROR_FACTOR of HF+PEFT bf16's
    own distance from HF+PEFT fp32 (medians over the steps), and our token equals HF+PEFT bf16's argmax at
    every step whose top-two margin exceeds twice the two errors together."""
    engine = make_engine(moe_model, enforce_eager)
    tokens, logits = run(engine, ROWS[:num_rows], capture_logits=True)
    if not enforce_eager:
        assert engine.runner.graph_runner.replays["decode"] > 1
    model_dir, paths = moe_model
    for i, (prompt, (_, adapter)) in enumerate(zip(prompts(), ROWS[:num_rows])):
        path = None if adapter is None else paths[adapter]
        refs = [hf_teacher_forced(model_dir, path, prompt, tokens[f"r{i}"], dtype) for dtype in (torch.float32,
                                                                                               torch.bfloat16)]
        print(assert_bf16_tracks_hf(torch.stack(logits[f"r{i}"]), tokens[f"r{i}"], *refs,
                                    f"eager={enforce_eager} row {i} ({adapter})"))


@pytest.mark.parametrize("num_rows,chunk", [(len(ROWS), None), (2, None), (len(ROWS), 24)],
                         ids=["grouped-batch", "no-sort-batch", "chunked-prefill"])
def test_moe_graphs_and_eager_give_identical_tokens(moe_model, num_rows, chunk):
    sched = {} if chunk is None else {"max_num_batched_tokens": chunk}
    eager, _ = run(make_engine(moe_model, enforce_eager=True, **sched), ROWS[:num_rows])
    engine = make_engine(moe_model, enforce_eager=False, **sched)
    graphs, _ = run(engine, ROWS[:num_rows])
    assert eager == graphs
    assert engine.runner.graph_runner.replays["mixed"] >= 1 and engine.runner.graph_runner.replays["decode"] > 1


def test_moe_adapter_and_expert_mix_changes_between_replays_without_recapture(moe_model):
    engine = make_engine(moe_model, enforce_eager=False)
    captured = len(engine.runner.graph_runner.graphs)
    swapped = [(n, SHARED_OUTER if a is None else None) for n, a in ROWS]
    run(engine)
    second, _ = run(engine, swapped)
    assert len(engine.runner.graph_runner.graphs) == captured
    alone, _ = run(make_engine(moe_model, enforce_eager=True), swapped)
    assert second == alone


def test_moe_steps_make_no_host_device_sync(moe_model):
    """Prefill chunks, mixed steps and decode steps of a MoE model with expert LoRA, while adapter loads are in
    flight (overlap loading, two slots for three adapters): no step waits on the device from the host."""
    rows = [(n, SHARED_OUTER if i % 3 == 2 else a) for i, (n, a) in enumerate(ROWS)]
    engine = make_engine(moe_model, enforce_eager=False, overlap_loading=True, max_num_batched_tokens=64)
    run(engine, rows)                                 # warm-up: Triton compilation and autotuning
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=8, ignore_eos=True)
    for i, (prompt, (_, adapter)) in enumerate(zip(prompts(), rows)):
        engine.add_request(f"s{i}", prompt, params, adapter)
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps = 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert steps >= 8
