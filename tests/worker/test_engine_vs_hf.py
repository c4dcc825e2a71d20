"""Every row of a mixed multi-LoRA batch matches Hugging Face transformers + PEFT run alone (fp32)."""
from __future__ import annotations


import pytest
import torch

from tests.hf_fixtures import ADAPTERS, adapter_dir, run_greedy
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine

NUM_DECODE = 16
# (prompt length, adapter name or None); base-only rows sit between adapter rows
ROWS = [(7, None), (23, "r4-qv"), (5, "r8-all"), (40, None), (11, "r16-mlp-rs"), (17, "r8-all")]


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n, _ in ROWS]


def hf_reference(model_dir, prompt: list[int], adapter: str | None) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits [1 + NUM_DECODE, vocab] of HF (+ PEFT) for one prompt, alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter_dir(model_dir, adapter))
    model.eval()
    ids, logits = list(prompt), []
    with torch.no_grad():
        for _ in range(NUM_DECODE + 1):
            step_logits = model(torch.tensor([ids])).logits[0, -1].float()
            logits.append(step_logits)
            ids.append(int(step_logits.argmax()))
    return ids[len(prompt):], torch.stack(logits)


_HF_CACHE: dict = {}


def hf_rows(model_dir, prompts):
    key = str(model_dir)
    if key not in _HF_CACHE:
        _HF_CACHE[key] = [hf_reference(model_dir, p, a) for p, (_, a) in zip(prompts, ROWS)]
    return _HF_CACHE[key]


def run_engine(model_dir, prompts, **sched) -> tuple[Engine, dict, dict]:
    cache = CacheConfig(block_size=sched.pop("block_size", 16), num_gpu_blocks_override=sched.pop("num_blocks", None))
    config = WorkerConfig(model=ModelConfig(str(model_dir)), cache=cache,
                          lora=LoRAConfig(max_loras=sched.pop("max_loras", 4), max_lora_rank=16),
                          scheduler=SchedulerConfig(**sched), device="cpu")
    engine = Engine(config)
    for spec in ADAPTERS:
        engine.add_adapter(spec.name, str(adapter_dir(model_dir, spec.name)))
    def count_preemptions(batch):
        engine.preemptions_seen = getattr(engine, "preemptions_seen", 0) + len(batch.preempted)
    tokens, logits = run_greedy(engine, prompts, [a for _, a in ROWS], NUM_DECODE + 1, count_preemptions)
    return engine, tokens, logits


def assert_rows_match(model_dir, prompts, tokens, logits):
    for i, (hf_tokens, hf_logits) in enumerate(hf_rows(model_dir, prompts)):
        ours = torch.stack(logits[f"r{i}"])
        assert tokens[f"r{i}"] == hf_tokens, f"row {i} ({ROWS[i][1]}): greedy tokens differ"
        rel = (ours - hf_logits).abs().max() / hf_logits.abs().max()
        assert rel < 1e-4, f"row {i} ({ROWS[i][1]}): logits differ by {rel:.2e} relative"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_mixed_batch_matches_hf_peft(hf_models, arch):
    prompts = _prompts(320)
    _, tokens, logits = run_engine(hf_models[arch], prompts)
    assert_rows_match(hf_models[arch], prompts, tokens, logits)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_chunked_prefill_matches_hf_peft(hf_models, arch):
    prompts = _prompts(320)
    _, tokens, logits = run_engine(hf_models[arch], prompts, max_num_batched_tokens=16)
    assert_rows_match(hf_models[arch], prompts, tokens, logits)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_preempted_and_recomputed_rows_match_hf_peft(hf_models, arch):
    prompts = _prompts(320)
    # 24 blocks of 4 tokens hold 96 tokens; the six rows need 103 + 6 * 16 at the end
    engine, tokens, logits = run_engine(hf_models[arch], prompts, block_size=4, num_blocks=24,
                                        max_num_batched_tokens=32)
    assert engine.preemptions_seen > 0
    assert_rows_match(hf_models[arch], prompts, tokens, logits)


def test_adapter_cap_smaller_than_adapters_still_matches(hf_models):
    prompts = _prompts(320)
    _, tokens, logits = run_engine(hf_models["llama"], prompts, max_loras=1)
    assert_rows_match(hf_models["llama"], prompts, tokens, logits)


def test_every_adapter_changes_the_reference_logits(hf_models):
    """Guards the comparison above: adapter rows would fail it if our LoRA delta were dropped."""
    prompts = _prompts(320)
    rows = hf_rows(hf_models["llama"], prompts)
    for i, (_, adapter) in enumerate(ROWS):
        if adapter is None:
            continue
        _, base_logits = hf_reference(hf_models["llama"], prompts[i], None)
        rel = (rows[i][1][0] - base_logits[0]).abs().max() / base_logits[0].abs().max()
        assert rel > 1e-2, f"adapter {adapter} barely changes the logits ({rel:.1e})"
