"""Tiny Hugging Face models and PEFT adapters built in the test session (no network): the oracle."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass(frozen=True)
class FixtureAdapter:
    """A PEFT LoRA config the fixtures build an adapter from (random weights, init_lora_weights=False)."""
    name: str
    r: int
    targets: tuple[str, ...]
    alpha: int
    use_rslora: bool = False
    rank_pattern: dict | None = None
    alpha_pattern: dict | None = None


ADAPTERS = (
    FixtureAdapter("r4-qv", 4, ("q_proj", "v_proj"), alpha=8),
    FixtureAdapter("r8-all", 8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                alpha=16, rank_pattern={"down_proj": 4}, alpha_pattern={"o_proj": 32}),
    FixtureAdapter("r16-mlp-rs", 16, ("k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"), alpha=8,
                use_rslora=True),
)


def _hf_config(arch: str, **dims):
    """`dims` (hidden_size=..., head_dim=...) replace the tiny defaults."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-5, eos_token_id=1, bos_token_id=0, initializer_range=0.1)
    head_dim = dims.pop("head_dim", 24)
    common.update(dims)
    if arch == "llama":
        return LlamaConfig(**common, rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                      "original_max_position_embeddings": 64})
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    return Qwen3Config(**common, head_dim=head_dim, tie_word_embeddings=False)


def _randomize_extras(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Biases and norm weights start as constants in HF; make them random so loading them is tested."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.copy_(p + 0.1 * torch.randn(p.shape, generator=gen))


def build_hf_model(arch: str, root: Path, **dims) -> Path:
    """A tiny random checkpoint of `arch` (llama, qwen2, qwen3) in root/arch with ADAPTERS beside it; `dims`
    replace the tiny sizes (hidden_size=..., intermediate_size=..., head_dim=... for Qwen3)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(arch, **dims), dtype=torch.float32)
    _randomize_extras(model, torch.Generator().manual_seed(1))
    model_dir = root / arch
    model.save_pretrained(model_dir, safe_serialization=True)
    _save_adapters(model_dir, ADAPTERS)
    return model_dir


def _save_adapters(model_dir: Path, adapters: tuple[FixtureAdapter, ...]) -> None:
    """Each of `adapters` made with PEFT on the checkpoint in `model_dir`, saved beside it (adapter_dir)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    for i, spec in enumerate(adapters):
        torch.manual_seed(100 + i)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        cfg = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                         use_rslora=spec.use_rslora, rank_pattern=spec.rank_pattern or {},
                         alpha_pattern=spec.alpha_pattern or {}, init_lora_weights=False, lora_dropout=0.0)
        peft_model = get_peft_model(base, cfg)
        with torch.no_grad():   # PEFT's non-default init is small; make each adapter matter
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.mul_(20.0)
        peft_model.save_pretrained(adapter_dir(model_dir, spec.name))


def adapter_dir(model_dir: Path, name: str) -> Path:
    return model_dir.parent / f"{model_dir.name}-{name}"


def peft_lora(model_dir: Path, spec: FixtureAdapter) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor, float]]:
    """The adapter `spec` as PEFT saved it beside `model_dir`, read with safetensors alone: (layer, module) ->
    (lora_A [r, in_features], lora_B [out_features, r], scaling by PEFT's rules: alpha / r, or alpha / sqrt(r)
    with rsLoRA, each from its pattern where the module has one)."""
    from safetensors.torch import load_file
    tensors = load_file(str(adapter_dir(model_dir, spec.name) / "adapter_model.safetensors"))
    modules = {}
    for key, a in tensors.items():     # base_model.model.model.layers.{layer}.{block}.{module}.lora_A.weight
        if ".lora_A." in key:
            layer, module = int(key.split(".")[4]), key.split(".")[6]
            r = (spec.rank_pattern or {}).get(module, spec.r)
            alpha = (spec.alpha_pattern or {}).get(module, spec.alpha)
            modules[(layer, module)] = (a, tensors[key.replace(".lora_A.", ".lora_B.")],
                                        alpha / math.sqrt(r) if spec.use_rslora else alpha / r)
    return modules


MOE_ADAPTERS = (
    FixtureAdapter("r4-qv", 4, ("q_proj", "v_proj"), alpha=8),
    FixtureAdapter("r8-attn", 8, ("q_proj", "k_proj", "v_proj", "o_proj"), alpha=16, rank_pattern={"o_proj": 4},
                   alpha_pattern={"k_proj": 32}),
)


def _hf_moe_config(arch: str, hidden_size: int = 64, moe_intermediate_size: int = 32, intermediate_size: int = 96,
                   shared_expert_intermediate_size: int = 48, head_dim: int = 24):
    """E=4 experts, top-2, 2 layers (hidden 64, expert intermediate 32 unless given); Qwen2-MoE's layer 1 stays
    dense. Mixtral's experts take moe_intermediate_size as their intermediate_size."""
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    common = dict(vocab_size=320, hidden_size=hidden_size, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, eos_token_id=1,
                  bos_token_id=0, initializer_range=0.1, num_experts_per_tok=2)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=moe_intermediate_size,
                              intermediate_size=intermediate_size, norm_topk_prob=True, head_dim=head_dim,
                              tie_word_embeddings=False)
    if arch == "mixtral":
        return MixtralConfig(**common, num_local_experts=4, intermediate_size=moe_intermediate_size)
    return Qwen2MoeConfig(**common, num_experts=4, moe_intermediate_size=moe_intermediate_size,
                          intermediate_size=intermediate_size,
                          shared_expert_intermediate_size=shared_expert_intermediate_size, norm_topk_prob=False,
                          mlp_only_layers=[1])


def build_hf_moe_model(arch: str, root: Path, **dims) -> Path:
    """A tiny random MoE checkpoint as transformers saves it, with MOE_ADAPTERS (attention only) beside it; `dims`
    replace the tiny sizes (_hf_moe_config's keywords)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_moe_config(arch, **dims), dtype=torch.float32)
    _randomize_extras(model, torch.Generator().manual_seed(1))
    model_dir = root / arch
    model.save_pretrained(model_dir, safe_serialization=True)
    _save_adapters(model_dir, MOE_ADAPTERS)
    return model_dir


def capture_sampled_logits(engine, on_batch=None) -> dict[str, list[torch.Tensor]]:
    """Wrap engine.runner.execute so the logits row of every sampling sequence is kept, per request id in step
    order; `on_batch(batch)`, when given, sees each batch before it runs."""
    logits: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def capture(batch, prev=None):
        if on_batch is not None:
            on_batch(batch)
        out = execute(batch, prev)
        for seq, row in zip((s for s in batch.seqs if s.samples), out.logits):
            logits.setdefault(seq.request.request_id, []).append(row.clone())
        return out

    engine.runner.execute = capture
    return logits


def run_greedy(engine, prompts: list[list[int]], adapters: list[str | None], max_tokens: int,
               on_batch=None) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """Greedy requests r0, r1, ... (prompt i on adapter i, ignore_eos) through `engine` to the end: the tokens
    and the sampled logits rows per request id (capture_sampled_logits; `on_batch` sees each batch)."""
    from collections import defaultdict

    from worker.ipc.messages import SamplingParams
    logits = capture_sampled_logits(engine, on_batch)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, (prompt, adapter) in enumerate(zip(prompts, adapters)):
        engine.add_request(f"r{i}", prompt, params, adapter)
    tokens: dict[str, list[int]] = defaultdict(list)
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens, logits
