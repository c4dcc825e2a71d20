"""Expert LoRA on MoE base models (Qwen3-MoE, Mixtral, Qwen2-MoE) served through the Engine matches Hugging Face
transformers row for row, fp32 on the CPU: PEFT target_parameters adapters (with attention LoRA, and Qwen2-MoE's
shared-expert and dense-layer MLP LoRA) against PEFT itself, hand-written per-expert, stacked and shared-outer
adapters against the HF model with their deltas merged into the expert weights; in one batch with base-only
rows, with chunked prefill and after preemption. A batch without adapters is bitwise the same with LoRA on
and off."""
from __future__ import annotations


import pytest
import torch

from tests.hf_fixtures import capture_sampled_logits, run_greedy
from tests.moe_fixtures import (HandExpertAdapter, PeftExpertAdapter, merged_hf_model, save_hand_expert_adapter,
                                save_peft_expert_adapter)
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams
from worker.arch import ArchConfig
from worker.models.builder import lora_targets

ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe"]
NUM_DECODE = 16
MAX_RANK = 8


def peft_adapters(arch: str) -> tuple[PeftExpertAdapter, ...]:
    """Format (a); on Qwen2-MoE "gate_proj"... also adapt the shared expert (layer 0) and the dense MLP (layer 1)."""
    mlp = ("gate_proj", "up_proj", "down_proj") if arch == "qwen2_moe" else ()
    return (PeftExpertAdapter("tp-attn", 4, alpha=8, modules=("q_proj", "v_proj", *mlp), rank_pattern={"down_proj": 2}),
            PeftExpertAdapter("tp-r8", 8, alpha=16, use_rslora=True, rank_pattern={"gate_up_proj": 6}))


HAND_ADAPTERS = (HandExpertAdapter("per-expert", "per_expert", (3, 5, 2), experts=(0, 2, 3)),
                 HandExpertAdapter("stacked", "stacked", (4, 4, 6)),
                 HandExpertAdapter("shared-outer", "stacked", (6, 6, 4), shared_outer=True))
# (prompt length, adapter name or None); base-only rows between adapter rows
ROWS = [(7, None), (23, "tp-attn"), (5, "per-expert"), (40, None), (11, "stacked"), (9, "shared-outer"),
        (17, "tp-r8"), (13, "tp-attn")]


@pytest.fixture(scope="module")
def expert_adapters(hf_moe_models, tmp_path_factory) -> dict[str, dict]:
    """arch -> {"model": dir, "paths": name -> adapter dir, "deltas": name -> merged deltas (hand-written ones)}."""
    out = {}
    for arch in ARCHS:
        model_dir, root = hf_moe_models[arch], tmp_path_factory.mktemp(f"experts-{arch}")
        shape = lora_targets(ArchConfig.from_dir(model_dir)).experts
        sparse = [layer for layer in range(shape.num_layers) if layer not in shape.dense_layers]
        paths, deltas = {}, {}
        for i, spec in enumerate(peft_adapters(arch)):
            paths[spec.name] = root / spec.name
            save_peft_expert_adapter(model_dir, spec, paths[spec.name], seed=200 + i)
        for i, spec in enumerate(HAND_ADAPTERS):
            paths[spec.name] = root / spec.name
            deltas[spec.name] = save_hand_expert_adapter(spec, sparse, shape, arch == "mixtral", paths[spec.name],
                                                         seed=300 + i)
        out[arch] = {"model": model_dir, "paths": paths, "deltas": deltas}
    return out


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(2, 320, (n,), generator=gen).tolist() for n, _ in ROWS]


_HF_CACHE: dict = {}


def hf_model(fixture: dict, adapter: str | None) -> torch.nn.Module:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    if adapter in fixture["deltas"]:
        return merged_hf_model(fixture["model"], fixture["deltas"][adapter])
    model = AutoModelForCausalLM.from_pretrained(fixture["model"], dtype=torch.float32)
    return (model if adapter is None else PeftModel.from_pretrained(model, fixture["paths"][adapter])).eval()


def hf_rows(fixture: dict, prompts) -> list[tuple[list[int], torch.Tensor]]:
    """Per row, HF's greedy tokens and logits [1 + NUM_DECODE, vocab], each prompt run alone."""
    key = str(fixture["model"])
    if key not in _HF_CACHE:
        rows = []
        for prompt, (_, adapter) in zip(prompts, ROWS):
            model, ids, logits = hf_model(fixture, adapter), list(prompt), []
            with torch.no_grad():
                for _ in range(NUM_DECODE + 1):
                    step = model(torch.tensor([ids])).logits[0, -1].float()    # [vocab]
                    logits.append(step)
                    ids.append(int(step.argmax()))
            rows.append((ids[len(prompt):], torch.stack(logits)))
        _HF_CACHE[key] = rows
    return _HF_CACHE[key]


def make_engine(fixture: dict, max_loras: int = 4, block_size: int = 16, num_blocks: int | None = None,
                async_scheduling: bool = True, **sched) -> Engine:
    config = WorkerConfig(model=ModelConfig(str(fixture["model"])),
                          cache=CacheConfig(block_size=block_size, num_gpu_blocks_override=num_blocks),
                          lora=LoRAConfig(max_loras=max_loras, max_lora_rank=MAX_RANK),
                          scheduler=SchedulerConfig(**sched), device="cpu", async_scheduling=async_scheduling)
    engine = Engine(config)
    for name, path in fixture["paths"].items():
        engine.add_adapter(name, str(path))
    return engine


def run_engine(fixture: dict, prompts, **options) -> tuple[Engine, dict, dict]:
    """(engine, tokens, logits [steps, vocab]) per request id, the logits as the runner returns them."""
    engine = make_engine(fixture, **options)
    engine.preemptions_seen = 0

    def count_preemptions(batch):
        engine.preemptions_seen += len(batch.preempted)
    tokens, logits = run_greedy(engine, prompts, [a for _, a in ROWS], NUM_DECODE + 1, count_preemptions)
    return engine, tokens, {key: torch.stack(rows) for key, rows in logits.items()}


def assert_rows_match(fixture: dict, prompts, tokens, logits) -> None:
    for i, (hf_tokens, hf_logits) in enumerate(hf_rows(fixture, prompts)):
        assert tokens[f"r{i}"] == hf_tokens, f"row {i} ({ROWS[i][1]}): greedy tokens differ"
        rel = (logits[f"r{i}"] - hf_logits).abs().max() / hf_logits.abs().max()
        assert rel < 1e-4, f"row {i} ({ROWS[i][1]}): logits differ by {rel:.2e} relative"


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_of_expert_adapters_matches_hf(expert_adapters, arch):
    prompts = _prompts()
    _, tokens, logits = run_engine(expert_adapters[arch], prompts)
    assert_rows_match(expert_adapters[arch], prompts, tokens, logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_with_expert_adapters_matches_hf(expert_adapters, arch):
    prompts = _prompts()
    _, tokens, logits = run_engine(expert_adapters[arch], prompts, max_num_batched_tokens=16)
    assert_rows_match(expert_adapters[arch], prompts, tokens, logits)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_preempted_and_recomputed_expert_adapter_rows_match_hf(expert_adapters, arch):
    prompts = _prompts()
    # 24 blocks of 4 tokens hold 96 tokens; the eight rows need 125 + 8 * 16 at the end
    engine, tokens, logits = run_engine(expert_adapters[arch], prompts, block_size=4, num_blocks=24,
                                        max_num_batched_tokens=32)
    assert engine.preemptions_seen > 0
    assert_rows_match(expert_adapters[arch], prompts, tokens, logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_expert_adapter_changes_the_reference_logits(expert_adapters, arch):
    """Guards the comparisons above: an adapter row would fail them if its expert LoRA were dropped."""
    prompts, fixture = _prompts(), expert_adapters[arch]
    base = hf_model(fixture, None)
    for i, (_, hf_logits) in enumerate(hf_rows(fixture, prompts)):
        if ROWS[i][1] is None:
            continue
        with torch.no_grad():
            plain = base(torch.tensor([prompts[i]])).logits[0, -1]     # [vocab]
        rel = (hf_logits[0] - plain).abs().max() / plain.abs().max()
        assert rel > 1e-2, f"adapter {ROWS[i][1]} barely changes the logits ({rel:.1e})"


def test_expert_lora_alone_changes_the_reference_logits(expert_adapters):
    """The attention LoRA of tp-attn is not what moves its logits: its experts' LoRA alone does too."""
    fixture = expert_adapters["qwen3_moe"]
    prompt = _prompts()[1]
    model = hf_model(fixture, "tp-attn")
    with torch.no_grad():
        with_experts = model(torch.tensor([prompt])).logits[0, -1]
        for name, p in model.named_parameters():
            if "lora_B" in name and ".experts." in name:
                p.zero_()
        attention_only = model(torch.tensor([prompt])).logits[0, -1]
    assert (with_experts - attention_only).abs().max() / attention_only.abs().max() > 1e-2


@pytest.mark.parametrize("arch", ARCHS)
def test_a_batch_without_adapters_is_bitwise_the_same_with_lora_on_and_off(expert_adapters, arch):
    """Adapters resident in every slot; a base-only batch run with the LoRA path forced on (every token row
    slot -1) and with LoRA off gives identical logits, prefill and decode."""
    engine = make_engine(expert_adapters[arch], async_scheduling=False)
    for i, name in enumerate(["tp-attn", "per-expert", "stacked", "shared-outer"]):
        engine.add_request(f"warm{i}", _prompts()[i], SamplingParams(temperature=0.0, max_tokens=2), name)
    while engine.has_unfinished():
        engine.step()
    assert all(engine.runner.lora_pool.ranks_host)
    runner, compared = engine.runner, []

    def compare(batch):
        with torch.inference_mode():
            off = runner.model(runner.input_builder.build(batch, lora=False), runner.kv_pool.caches)
            forced = runner.input_builder.build(batch, lora=True)
            assert forced.lora is not None and set(forced.lora.token_lora_slots_host) == {-1}
            on = runner.model(forced, runner.kv_pool.caches)
        assert torch.equal(on, off)
        compared.append(batch.num_tokens)
    capture_sampled_logits(engine, compare)
    for i, prompt in enumerate(_prompts()[:4]):
        engine.add_request(f"base{i}", prompt, SamplingParams(temperature=0.0, max_tokens=3), None)
    while engine.has_unfinished():
        engine.step()
    assert compared[0] == sum(n for n, _ in ROWS[:4]) and compared[1:] == [4, 4]
