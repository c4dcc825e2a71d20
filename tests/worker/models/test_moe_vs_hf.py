"""MoE base models (Qwen3-MoE, Mixtral, Qwen2-MoE) served through the Engine match HF transformers (+ PEFT on the
attention) row for row, fp32 on the CPU; both checkpoint layouts and dummy weights load; LoRA on a module the
base cannot serve is refused by name (expert LoRA: test_moe_lora_vs_hf.py)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.hf_fixtures import MOE_ADAPTERS, adapter_dir, run_greedy
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.lora.adapter import AdapterError, inspect_adapter
from worker.arch import ArchConfig
from worker.models.builder import lora_targets

ARCHS = ["qwen3_moe", "mixtral", "qwen2_moe"]
NUM_DECODE = 16
# (prompt length, adapter name or None); base-only rows between adapter rows
ROWS = [(7, None), (23, "r4-qv"), (5, "r8-attn"), (40, None), (11, "r8-attn")]


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(2, 320, (n,), generator=gen).tolist() for n, _ in ROWS]


_HF_CACHE: dict = {}


def hf_rows(model_dir: Path, prompts) -> list[tuple[list[int], torch.Tensor]]:
    """Per row, HF's (+ PEFT's) greedy tokens and logits [1 + NUM_DECODE, vocab], each prompt run alone."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    if str(model_dir) in _HF_CACHE:
        return _HF_CACHE[str(model_dir)]
    rows = []
    for prompt, (_, adapter) in zip(prompts, ROWS):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if adapter is not None:
            model = PeftModel.from_pretrained(model, adapter_dir(model_dir, adapter))
        ids, logits = list(prompt), []
        with torch.no_grad():
            for _ in range(NUM_DECODE + 1):
                step = model.eval()(torch.tensor([ids])).logits[0, -1].float()    # [vocab]
                logits.append(step)
                ids.append(int(step.argmax()))
        rows.append((ids[len(prompt):], torch.stack(logits)))
    _HF_CACHE[str(model_dir)] = rows
    return rows


def run_engine(model_dir: Path, prompts, load_format: str = "auto", adapters: bool = True, **sched):
    """(tokens, logits) per request id, the logits [steps, vocab] captured as the runner returns them."""
    config = WorkerConfig(model=ModelConfig(str(model_dir), load_format=load_format), cache=CacheConfig(),
                          lora=LoRAConfig(max_loras=2, max_lora_rank=8), scheduler=SchedulerConfig(**sched),
                          device="cpu")
    engine = Engine(config)
    if adapters:
        for spec in MOE_ADAPTERS:
            engine.add_adapter(spec.name, str(adapter_dir(model_dir, spec.name)))
    tokens, logits = run_greedy(engine, prompts, [a if adapters else None for _, a in ROWS], NUM_DECODE + 1)
    return tokens, {key: torch.stack(rows) for key, rows in logits.items()}


def assert_rows_match(model_dir: Path, prompts, tokens, logits) -> None:
    for i, (hf_tokens, hf_logits) in enumerate(hf_rows(model_dir, prompts)):
        assert tokens[f"r{i}"] == hf_tokens, f"row {i} ({ROWS[i][1]}): greedy tokens differ"
        rel = (logits[f"r{i}"] - hf_logits).abs().max() / hf_logits.abs().max()
        assert rel < 1e-4, f"row {i} ({ROWS[i][1]}): logits differ by {rel:.2e} relative"


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_matches_hf_peft(hf_moe_models, arch):
    prompts = _prompts()
    tokens, logits = run_engine(hf_moe_models[arch], prompts)
    assert_rows_match(hf_moe_models[arch], prompts, tokens, logits)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_hf_peft(hf_moe_models, arch):
    prompts = _prompts()
    tokens, logits = run_engine(hf_moe_models[arch], prompts, max_num_batched_tokens=16)
    assert_rows_match(hf_moe_models[arch], prompts, tokens, logits)


def test_adapters_change_the_reference_logits(hf_moe_models):
    """Guards the comparison above: adapter rows would fail it if our attention LoRA were dropped."""
    from transformers import AutoModelForCausalLM
    model_dir, prompts = hf_moe_models["qwen3_moe"], _prompts()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, (hf_tokens, hf_logits) in enumerate(hf_rows(model_dir, prompts)):
        if ROWS[i][1] is None:
            continue
        with torch.no_grad():
            base = model(torch.tensor([prompts[i]])).logits[0, -1]     # [vocab]
        rel = (hf_logits[0] - base).abs().max() / base.abs().max()
        assert rel > 1e-2, f"adapter {ROWS[i][1]} barely changes the logits ({rel:.1e})"


def _fused_checkpoint(model_dir: Path, out: Path) -> Path:
    """The model in transformers 5's in-memory layout (experts fused as gate_up_proj / down_proj), which
    save_pretrained does not write (it writes per-expert names)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"
             or not model.config.tie_word_embeddings}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    shutil.copy(model_dir / "config.json", out / "config.json")
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_and_per_expert_checkpoints_give_identical_logits(hf_moe_models, arch, tmp_path):
    saved = hf_moe_models[arch]
    with safe_open(str(saved / "model.safetensors"), framework="pt") as f:   # transformers 5 saves per expert
        assert any(".experts.0." in name for name in f.keys())
    fused = _fused_checkpoint(saved, tmp_path / "fused")
    prompts = _prompts()
    per_expert_tokens, per_expert_logits = run_engine(saved, prompts, adapters=False)
    fused_tokens, fused_logits = run_engine(fused, prompts, adapters=False)
    assert fused_tokens == per_expert_tokens
    for key, rows in per_expert_logits.items():
        assert torch.equal(fused_logits[key], rows), key


@pytest.mark.parametrize("arch", ARCHS)
def test_dummy_weights_build_and_step(hf_moe_models, arch, tmp_path):
    (tmp_path / "config.json").write_text((hf_moe_models[arch] / "config.json").read_text())
    tokens, logits = run_engine(tmp_path, _prompts(), load_format="dummy", adapters=False)
    assert all(len(t) == NUM_DECODE + 1 for t in tokens.values())
    assert all(torch.isfinite(rows).all() for rows in logits.values())


@pytest.mark.parametrize("arch, key, words", [
    ("qwen3_moe", "base_model.model.model.layers.0.mlp.experts.1.gate_proj.lora_A.weight", "no lora_B beside it"),
    ("qwen3_moe", "base_model.model.model.layers.0.mlp.experts.gate_up.lora_A.weight", "format that is not understood"),
    ("qwen3_moe", "base_model.model.model.layers.1.mlp.gate.lora_A.weight", "LoRA on the MoE router"),
    ("mixtral", "base_model.model.model.layers.1.block_sparse_moe.gate.lora_A.weight", "LoRA on the MoE router"),
    ("qwen3_moe", "base_model.model.model.layers.1.mlp.gate_proj.lora_A.weight", "sparse MoE layer"),
    ("qwen3_moe", "base_model.model.model.layers.1.mlp.shared_expert.gate_proj.lora_A.weight", "sparse MoE layer"),
    ("qwen2_moe", "base_model.model.model.layers.0.mlp.shared_expert_gate.lora_A.weight", "shared expert's gate"),
    ("qwen2_moe", "base_model.model.model.layers.1.mlp.shared_expert.up_proj.lora_A.weight", "dense MLP"),
])
def test_adapter_on_a_module_a_moe_model_cannot_serve_is_refused_by_name(hf_moe_models, tmp_path, arch, key, words):
    source = adapter_dir(hf_moe_models[arch], "r4-qv")
    shutil.copytree(source, tmp_path / "a")
    tensors = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    tensors[key] = torch.zeros(4, 64)
    save_file(tensors, str(tmp_path / "a" / "adapter_model.safetensors"))
    targets = lora_targets(ArchConfig.from_dir(hf_moe_models[arch]))
    with pytest.raises(AdapterError, match=words) as raised:
        inspect_adapter("bad", tmp_path / "a", targets, 8)
    assert key.removeprefix("base_model.model.") in str(raised.value)
    inspect_adapter("good", source, targets, 8)   # the attention adapter itself is served
