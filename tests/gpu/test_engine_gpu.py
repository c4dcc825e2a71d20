"""The GPU path end to end: bf16 against HF transformers + PEFT, CUDA graphs against eager, no syncs."""
from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from tests.gpu.hf_compare import assert_bf16_tracks_hf, hf_teacher_forced
from tests.hf_fixtures import ADAPTERS, adapter_dir
from worker.config import CacheConfig, KernelConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams

pytestmark = pytest.mark.gpu
NUM_STEPS = 32
ROWS = [(7, None), (23, "r4-qv"), (5, "r8-all"), (40, None), (11, "r16-mlp-rs"), (17, "r8-all"), (9, "r4-qv")]


def prompts(rows=ROWS) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(2, 320, (n,), generator=gen).tolist() for n, _ in rows]


def make_engine(model_dir, enforce_eager: bool, async_scheduling: bool = True,
                kernels: KernelConfig = KernelConfig(), overlap_loading: bool = False, **sched) -> Engine:
    """The tests' engine. Adapters load in the step that admits them (overlap_loading=False), so two engines
    given the same requests run the same batches: with overlap loading, the step a request joins depends on
    when its adapter's load ends, and a row's projections run different kernels at different batch sizes
    (the GEMV below 3 rows, the skinny GEMM up to 32, cuBLAS above), which may change the last bits of its
    logits (measured: engines given the same requests ran different batches in 4 of 4 pairs, and once a
    logit row differed). Overlap loading itself is tested in test_lora_loading_gpu.py."""
    engine = Engine(WorkerConfig(
        ModelConfig(str(model_dir), dtype="bfloat16"), cache=CacheConfig(num_gpu_blocks_override=512),
        lora=LoRAConfig(max_loras=4, max_lora_rank=16, enable_lora_overlap_loading=overlap_loading),
        scheduler=SchedulerConfig(max_num_seqs=16, **sched), kernels=kernels,
        device="cuda", enforce_eager=enforce_eager, async_scheduling=async_scheduling))
    for spec in ADAPTERS:
        engine.add_adapter(spec.name, str(adapter_dir(model_dir, spec.name)))
    return engine


def run(engine: Engine, rows=ROWS, capture_logits=False, steps: list | None = None):
    """Greedy tokens per request (and with capture_logits, each sampled row's logits); `steps`, when given,
    gets each step's batch as (request id, first position, new tokens) per sequence."""
    logits = defaultdict(list)
    if capture_logits or steps is not None:
        execute = engine.runner.execute

        def capture(batch, prev=None):
            out = execute(batch, prev)
            if steps is not None:
                steps.append([(s.request.request_id, s.start, s.num_new_tokens) for s in batch.seqs])
            if capture_logits:
                for seq, row in zip((s for s in batch.seqs if s.samples), out.logits):
                    logits[seq.request.request_id].append(row.float().cpu())
            return out
        engine.runner.execute = capture
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STEPS, ignore_eos=True)
    for i, (prompt, (_, adapter)) in enumerate(zip(prompts(rows), rows)):
        engine.add_request(f"r{i}", prompt, params, adapter)
    tokens = defaultdict(list)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens, logits


def assert_rows_track_hf(model_dir, rows, tokens, logits, label: str) -> None:
    """Every row's logits along its greedy tokens track HF+PEFT's (hf_compare.assert_bf16_tracks_hf)."""
    for i, (prompt, (_, adapter)) in enumerate(zip(prompts(rows), rows)):
        path = None if adapter is None else adapter_dir(model_dir, adapter)
        refs = [hf_teacher_forced(model_dir, path, prompt, tokens[f"r{i}"], dtype) for dtype in (torch.float32,
                                                                                               torch.bfloat16)]
        print(assert_bf16_tracks_hf(torch.stack(logits[f"r{i}"]), tokens[f"r{i}"], *refs,
                                    f"{label} row {i} ({adapter})"))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
@pytest.mark.parametrize("num_rows", [len(ROWS), 2], ids=["cublas-batch", "gemv-batch"])
def test_bf16_matches_hf_peft(hf_models, arch, enforce_eager, num_rows):
    """Along our 32 greedy tokens per row (mixed batch of base-only rows and adapters; at 2 rows the decode
    projections run the small-batch kernel, kernels/gemv.py, at 7 cuBLAS): our bf16 logits are within
    hf_compare.BF16_ERROR_FACTOR of HF+PEFT bf16's own distance from HF+PEFT fp32 (medians over the steps), and our
    token equals HF+PEFT bf16's argmax at every step whose top-two margin exceeds twice the two errors
    together."""
    model_dir, rows = hf_models[arch], ROWS[:num_rows]
    engine = make_engine(model_dir, enforce_eager)
    tokens, logits = run(engine, rows, capture_logits=True)
    if not enforce_eager:      # the prompts ran in a mixed-batch graph, the decode steps in decode graphs
        assert engine.runner.graph_runner.replays["mixed"] >= 1 and engine.runner.graph_runner.replays["decode"] > 1
    assert_rows_track_hf(model_dir, rows, tokens, logits, f"{arch} eager={enforce_eager}")


# rows sharing two adapters (and the base): decode batches average >= 2 rows per adapter run
SHARED_ROWS = [(7, "r8-all"), (23, "r4-qv"), (5, "r8-all"), (40, None), (11, "r8-all"), (17, "r4-qv"),
               (9, "r4-qv"), (13, "r8-all"), (6, None), (15, "r4-qv")]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_grouped_lora_decode_graphs_match_hf_peft(hf_models, arch):
    """Decode graphs whose rows are grouped by adapter (KernelConfig.grouped_lora_min_rows; tile map, split-K
    shrink) replay for batches sharing adapters, and every row tracks HF+PEFT as the per-row graphs do."""
    model_dir = hf_models[arch]
    engine = make_engine(model_dir, enforce_eager=False, kernels=KernelConfig(grouped_lora_min_rows=4))
    tokens, logits = run(engine, SHARED_ROWS, capture_logits=True)
    assert engine.runner.graph_runner.replays["grouped"] >= NUM_STEPS - 2
    assert_rows_track_hf(model_dir, SHARED_ROWS, tokens, logits, f"{arch} grouped")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_the_fused_gemm_backend_matches_hf_peft_and_fuses_prefills_and_grouped_decodes(hf_models, arch,
                                                                                        enforce_eager, monkeypatch):
    """KernelConfig(lora_backend="fused_gemm"): the prompts' steps and (with graphs) the decode steps of rows grouped
    by adapter run kernels/lora_gemm.py, and every row tracks HF+PEFT as with the Triton backend."""
    from worker.kernels import lora_gemm
    calls, fused = [], lora_gemm.lora_gemm

    def counted(*args, **kwargs):
        calls.append(kwargs.get("tile_map") is not None)
        return fused(*args, **kwargs)
    monkeypatch.setattr(lora_gemm, "lora_gemm", counted)
    model_dir = hf_models[arch]
    engine = make_engine(model_dir, enforce_eager,
                         kernels=KernelConfig(lora_backend="fused_gemm", grouped_lora_min_rows=4))
    tokens, logits = run(engine, SHARED_ROWS, capture_logits=True)
    assert calls, "the fused GEMM ran"
    if not enforce_eager:
        assert any(calls), "the grouped decode graphs captured the fused GEMM over the host's tile map"
        assert engine.runner.graph_runner.replays["grouped"] >= NUM_STEPS - 2
    assert_rows_track_hf(model_dir, SHARED_ROWS, tokens, logits, f"{arch} fused_gemm eager={enforce_eager}")


# eight prompts of ~200 tokens: one mixed step of ~1,600 tokens (the tiny models hold 256 positions)
LONG_ROWS = [(200, None), (190, "r4-qv"), (210, "r8-all"), (180, "r16-mlp-rs"), (205, "r8-all"), (195, None),
             (215, "r4-qv"), (185, "r8-all")]


def test_mixed_graphs_above_1024_tokens_run_lora_from_the_tile_map_and_match_hf_peft(hf_models):
    """A prefill step of ~1,600 tokens with adapters replays a mixed graph whose LoRA runs over the host's tile
    map (KernelConfig.lora_tile_map_max_tokens covers every mixed graph since searched tiles cost 4x more at
    256 sequences); its tokens equal the eager engine's and every row tracks HF+PEFT."""
    model_dir = hf_models["llama"]
    engine = make_engine(model_dir, enforce_eager=False, max_num_batched_tokens=2048)
    steps: list = []
    tokens, logits = run(engine, LONG_ROWS, capture_logits=True, steps=steps)
    assert sum(n for _, _, n in steps[0]) == sum(n for n, _ in LONG_ROWS) > 1024
    assert engine.runner.graph_runner.replays["mixed"] >= 1
    assert engine.runner.graph_runner.tile_map_max_tokens >= sum(n for n, _ in LONG_ROWS)
    eager, _ = run(make_engine(model_dir, enforce_eager=True, max_num_batched_tokens=2048), LONG_ROWS)
    assert eager == tokens
    assert_rows_track_hf(model_dir, LONG_ROWS, tokens, logits, "llama long prompts")


@pytest.mark.parametrize("num_rows,chunk", [(len(ROWS), None), (2, None), (len(ROWS), 24)],
                         ids=["cublas-batch", "gemv-batch", "chunked-prefill"])
def test_graphs_and_eager_give_identical_tokens(hf_models, num_rows, chunk):
    """Decode graphs and mixed-batch graphs (prompts, and with a 24-token budget, prompt chunks beside
    decode tokens, padded to a token bucket) against the eager steps."""
    sched = {} if chunk is None else {"max_num_batched_tokens": chunk}
    eager, _ = run(make_engine(hf_models["llama"], enforce_eager=True, **sched), ROWS[:num_rows])
    engine = make_engine(hf_models["llama"], enforce_eager=False, **sched)
    graphs, _ = run(engine, ROWS[:num_rows])
    assert eager == graphs
    assert engine.runner.graph_runner.replays["mixed"] >= (1 if chunk is None else 4)


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_async_and_sync_scheduling_give_identical_tokens(hf_models, enforce_eager):
    """Pending tokens are gathered on the device from the previous step's sampler output, into the
    graphs' static inputs and the eager path's alike."""
    sync, _ = run(make_engine(hf_models["llama"], enforce_eager, async_scheduling=False))
    overlapped, _ = run(make_engine(hf_models["llama"], enforce_eager, async_scheduling=True))
    assert overlapped == sync


@pytest.mark.parametrize("skinny_row_limit", [0, KernelConfig().skinny_row_limit], ids=["cublas", "skinny-gemm"])
def test_lora_shrink_on_the_side_stream_gives_the_same_logits_as_in_line(hf_models, skinny_row_limit):
    """The shrink overlapping the base GEMM on a second stream computes exactly what it does in line: the
    same kernels on the same inputs, so every logit is bitwise equal (a missing fork or join would race).
    The side stream serves CUDA-graph steps. Both engines run the same batches (make_engine), checked first."""
    in_line_steps, side_steps = [], []
    in_line_tokens, in_line = run(make_engine(hf_models["llama"], False, kernels=KernelConfig(
        skinny_row_limit=skinny_row_limit, lora_side_stream=False)), capture_logits=True, steps=in_line_steps)
    engine = make_engine(hf_models["llama"], False, kernels=KernelConfig(skinny_row_limit=skinny_row_limit))
    side_tokens, side = run(engine, capture_logits=True, steps=side_steps)
    assert side_steps == in_line_steps
    assert side_tokens == in_line_tokens
    for request_id, rows in in_line.items():
        assert all(torch.equal(a, b) for a, b in zip(side[request_id], rows, strict=True)), request_id


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("num_rows", [len(ROWS), 2], ids=["cublas-batch", "gemv-batch"])
def test_programmatic_launch_changes_no_logit(hf_models, enforce_eager, num_rows):
    """Kernels that start while the one before them ends (kernels/pdl.py) wait for it before reading its
    output: every logit is bitwise what the engine computes with each kernel launched after the last ended.
    Both engines run the same batches (make_engine). At 2 rows the projections are GEMVs beside the LoRA
    kernels: launched late, letting the next kernel launch early."""
    steps_on, steps_off = [], []
    engine_on = make_engine(hf_models["llama"], enforce_eager, kernels=KernelConfig(programmatic_launch=True))
    tokens_on, on = run(engine_on, ROWS[:num_rows], capture_logits=True, steps=steps_on)
    engine_off = make_engine(hf_models["llama"], enforce_eager, kernels=KernelConfig(programmatic_launch=False))
    tokens_off, off = run(engine_off, ROWS[:num_rows], capture_logits=True, steps=steps_off)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    assert engine_on.runner.model.lm_head.kernels.programmatic_launch == hopper
    assert not engine_off.runner.model.lm_head.kernels.programmatic_launch
    assert steps_on == steps_off and tokens_on == tokens_off
    for request_id, rows in off.items():
        assert all(torch.equal(a, b) for a, b in zip(on[request_id], rows, strict=True)), request_id


def test_every_layer_holds_the_kernel_choices_resolved_for_the_gpu(hf_models):
    """build_model hands one KernelChoices to every layer that launches a kernel: the configured row limits, PDL
    where the device has it, the skinny GEMM's counters, zeros on the device, and the LoRA backend; limits the
    kernels cannot take are refused."""
    from worker.kernels.choices import KernelChoices
    from worker.models.builder import build_model
    device = torch.device("cuda")
    model = build_model(hf_models["llama"], torch.bfloat16, device, "auto", 64,
                        KernelConfig(gemv_row_limit=1, skinny_row_limit=16))
    holders = [m for m in model.modules() if hasattr(m, "kernels")]
    assert {type(m).__name__ for m in holders} == {"Linear", "LMHead", "RMSNorm", "Attention", "SiluAndMul"}
    choices = holders[0].kernels
    assert all(m.kernels is choices for m in holders)
    assert choices.lora.name == "triton"           # the LoRA backend chosen once for the device
    assert (choices.gemv_row_limit, choices.skinny_row_limit) == (1, 16)
    assert choices.programmatic_launch == (torch.cuda.get_device_capability() >= (9, 0))
    assert choices.skinny_counters.is_cuda and not choices.skinny_counters.any()
    assert KernelChoices.resolve(KernelConfig(programmatic_launch=False), device).programmatic_launch is False
    assert KernelChoices.resolve(KernelConfig(skinny_row_limit=0), device).skinny_counters is None
    with pytest.raises(ValueError, match="gemv_row_limit=8"):
        KernelChoices.resolve(KernelConfig(gemv_row_limit=8), device)


def test_adapter_mix_changes_between_replays_without_recapture(hf_models):
    engine = make_engine(hf_models["llama"], enforce_eager=False)
    captured = len(engine.runner.graph_runner.graphs)
    first, _ = run(engine, rows=[(n, a) for n, a in ROWS])
    second, _ = run(engine, rows=[(n, "r16-mlp-rs" if a is None else None) for n, a in ROWS])
    assert len(engine.runner.graph_runner.graphs) == captured
    alone, _ = run(make_engine(hf_models["llama"], enforce_eager=True),
                   rows=[(n, "r16-mlp-rs" if a is None else None) for n, a in ROWS])
    assert second == alone


LISTS = dict(allowed_token_ids=list(range(300)) * 3, bad_words_token_ids=[[5, 6], [7], [8, 9, 10]],
             logit_bias={3: 2.0, 4: -1.0}, min_tokens=4, stop_token_ids=[11, 12])


@pytest.mark.parametrize("extra", [{}, dict(presence_penalty=0.5, repetition_penalty=1.1), LISTS],
                         ids=["greedy-and-sampled", "with-penalties", "with-lists"])
def test_steps_make_no_host_device_sync(hf_models, extra):
    engine = make_engine(hf_models["qwen3"], enforce_eager=False, overlap_loading=True, max_num_batched_tokens=64)
    run(engine)                                       # warm-up: Triton compilation and autotuning
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=8, ignore_eos=True,
                            logprobs=2, **extra)
    for i, (prompt, (_, adapter)) in enumerate(zip(prompts(), ROWS)):
        engine.add_request(f"s{i}", prompt, params, adapter)
    torch.cuda.set_sync_debug_mode("error")
    try:
        steps = 0
        while engine.has_unfinished():                 # chunked prefill, mixed, then graph decode
            engine.step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert steps >= 8
