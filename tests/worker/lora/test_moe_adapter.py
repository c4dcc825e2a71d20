"""Adapters on MoE base models (lora/formats/ through lora/adapter.py, against the models' LoRA targets): what an
adapter's spec says it covers (target_modules, the rank over every module, experts included), and what is refused,
by name."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tests.moe_fixtures import SHAPE, HandExpertAdapter, save_hand_expert_adapter
from worker.lora.adapter import AdapterError, inspect_adapter
from worker.arch import ArchConfig
from worker.models.builder import lora_targets

PREFIX = "base_model.model.model.layers."


def _write(path, tensors: dict[str, torch.Tensor], **config) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, **config}))


def _pair(module: str, r: int, fan_in: int, fan_out: int) -> dict[str, torch.Tensor]:
    return {f"{PREFIX}{module}.lora_A.weight": torch.randn(r, fan_in), f"{PREFIX}{module}.lora_B.weight":
            torch.randn(fan_out, r)}


@pytest.mark.parametrize("spec, mixtral_names, targets", [
    (HandExpertAdapter("per-expert", "per_expert", (3, 5, 2), experts=(0, 2)), False,
     ("experts.gate_proj", "experts.up_proj", "experts.down_proj")),
    (HandExpertAdapter("stacked", "stacked", (4, 4, 7)), True,
     ("experts.gate_proj", "experts.up_proj", "experts.down_proj")),
], ids=["per-expert", "stacked-mixtral-names"])
def test_expert_adapter_spec_lists_the_experts_and_their_largest_rank(hf_moe_models, tmp_path, spec, mixtral_names,
                                                                     targets):
    arch_name = "mixtral" if mixtral_names else "qwen3_moe"
    save_hand_expert_adapter(spec, [0, 1], SHAPE, mixtral_names, tmp_path / "a", seed=0)
    found = inspect_adapter("a", tmp_path / "a", lora_targets(ArchConfig.from_dir(hf_moe_models[arch_name])), 8)
    assert found.target_modules == targets and found.rank == max(spec.ranks)


def test_shared_expert_and_dense_layer_mlp_lora_are_dense_modules_of_qwen2_moe(hf_moe_models, tmp_path):
    """Qwen2-MoE: layer 0 is sparse with a shared expert (intermediate 48), layer 1 dense (intermediate 96)."""
    tensors = {**_pair("0.mlp.shared_expert.gate_proj", 2, 64, 48), **_pair("0.mlp.shared_expert.down_proj", 3, 48, 64),
               **_pair("1.mlp.up_proj", 5, 64, 96), **_pair("0.self_attn.q_proj", 2, 64, 64),
               **_pair("0.mlp.experts.1.down_proj", 6, 32, 64)}
    _write(tmp_path / "a", tensors)
    found = inspect_adapter("a", tmp_path / "a", lora_targets(ArchConfig.from_dir(hf_moe_models["qwen2_moe"])), 8)
    assert found.target_modules == ("q_proj", "up_proj", "shared_expert.gate_proj", "shared_expert.down_proj",
                                    "experts.down_proj")
    assert found.rank == 6


@pytest.mark.parametrize("arch, module, fans, words", [
    ("qwen2_moe", "0.mlp.gate_proj", (64, 96), "sparse MoE layer"),
    ("qwen3_moe", "0.mlp.shared_expert.gate_proj", (64, 48), "sparse MoE layer"),
    ("qwen2_moe", "0.mlp.shared_expert_gate", (64, 1), "shared expert's gate"),
    ("qwen2_moe", "0.mlp.gate", (64, 4), "LoRA on the MoE router"),
    ("mixtral", "1.block_sparse_moe.gate", (64, 4), "LoRA on the MoE router"),
    ("mixtral", "1.block_sparse_moe.experts.0.w4", (64, 32), "format that is not understood"),
])
def test_modules_a_moe_base_cannot_serve_are_refused_by_name(hf_moe_models, tmp_path, arch, module, fans, words):
    _write(tmp_path / "a", _pair(module, 2, *fans))
    with pytest.raises(AdapterError, match=words) as raised:
        inspect_adapter("a", tmp_path / "a", lora_targets(ArchConfig.from_dir(hf_moe_models[arch])), 8)
    assert f"layers.{module}.lora_" in str(raised.value)


@pytest.mark.parametrize("fmt", ["per_expert", "stacked"])
def test_expert_lora_on_a_dense_base_model_is_refused(hf_models, tmp_path, fmt):
    save_hand_expert_adapter(HandExpertAdapter("a", fmt, (2, 2, 2)), [0], SHAPE, False, tmp_path / "a", seed=0)
    with pytest.raises(AdapterError, match=r"base model \(LlamaForCausalLM\) is dense") as raised:
        inspect_adapter("a", tmp_path / "a", lora_targets(ArchConfig.from_dir(hf_models["llama"])), 8)
    assert ".mlp.experts." in str(raised.value)


def test_expert_rank_above_max_lora_rank_is_refused(hf_moe_models, tmp_path):
    save_hand_expert_adapter(HandExpertAdapter("a", "stacked", (2, 2, 12)), [0], SHAPE, False, tmp_path / "a", seed=0)
    with pytest.raises(AdapterError, match="greater than max_lora_rank 8"):
        inspect_adapter("a", tmp_path / "a", lora_targets(ArchConfig.from_dir(hf_moe_models["qwen3_moe"])), 8)


def test_shared_expert_lora_of_the_wrong_width_is_refused(hf_moe_models, tmp_path):
    _write(tmp_path / "a", _pair("0.mlp.shared_expert.gate_proj", 2, 64, 96))      # the dense layers' width
    with pytest.raises(AdapterError, match=r"layer 0 shared_expert.gate_proj: .* \(expected \[r, 64\] and \[48, r\]\)"):
        inspect_adapter("a", tmp_path / "a", lora_targets(ArchConfig.from_dir(hf_moe_models["qwen2_moe"])), 8)
