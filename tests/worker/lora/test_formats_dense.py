"""PEFT's per-module tensors (lora/formats/dense.py through lora/adapter.py) are read against the model's LoRA
targets: the modules, shapes and packing of the table, whatever they are called, and refusals that name the
table's modules."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from worker.arch import ArchConfig
from worker.lora.adapter import AdapterError, inspect_adapter, read_adapter
from worker.lora.formats.dense import dense_tensors
from worker.lora.targets import LoRATarget, LoRATargets
from worker.models.builder import lora_targets

PREFIX = "base_model.model.model.layers."
# a made-up family: attention as one fused c_attn (no q/k/v), an MLP of fc_in and fc_out packed together
TOY = LoRATargets("ToyForCausalLM",
                  (LoRATarget("c_attn", "attn", ("c_attn",), 16, (48,)),
                   LoRATarget("fc", "mlp", ("fc_in", "fc_out"), 16, (32, 8))),
                  (("c_attn", "fc"), ("c_attn",)))


def _write(path, tensors: dict[str, torch.Tensor], **config) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, **config}))


def _pair(module: str, r: int, fan_in: int, fan_out: int) -> dict[str, torch.Tensor]:
    return {f"{PREFIX}{module}.lora_A.weight": torch.randn(r, fan_in),
            f"{PREFIX}{module}.lora_B.weight": torch.randn(fan_out, r)}


def test_an_adapter_is_read_on_the_modules_and_shapes_of_the_table(tmp_path):
    _write(tmp_path / "a", {**_pair("0.attn.c_attn", 2, 16, 48), **_pair("0.mlp.fc_out", 4, 16, 8),
                            **_pair("1.attn.c_attn", 2, 16, 48)},
           target_modules=["c_attn", "fc_out"], alpha_pattern={"fc_out": 2})
    adapter = read_adapter("a", tmp_path / "a", TOY, 8, torch.float32)
    assert adapter.spec.target_modules == ("c_attn", "fc_out") and adapter.spec.rank == 4
    assert sorted(adapter.modules) == [(0, "c_attn"), (0, "fc_out"), (1, "c_attn")]
    assert [adapter.modules[k].scaling for k in sorted(adapter.modules)] == [8.0, 0.5, 8.0]


@pytest.mark.parametrize("tensors, config, message", [
    (_pair("0.self_attn.q_proj", 2, 16, 16), {},
     "adapter tensor 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' is not supported: only "
     "lora_A/lora_B weights of c_attn, fc_in, fc_out are"),
    (_pair("0.attn.q_proj", 2, 16, 16), {},
     "adapter targets module 'q_proj', which the base model lacks or LoRA does not support; "
     "supported: ['c_attn', 'fc_in', 'fc_out']"),
    (_pair("1.mlp.fc_in", 2, 16, 32), {},       # layer 1 has no MLP target
     "adapter targets module 'mlp.fc_in', which the base model lacks"),
    (_pair("0.mlp.c_attn", 2, 16, 48), {},      # c_attn is the attention's, never the MLP's
     "adapter targets module 'mlp.c_attn', which the base model lacks"),
    (_pair("0.mlp.fc_out", 2, 16, 32), {},      # fc_out is the second slice, 8 wide
     "adapter 'a' layer 0 fc_out: lora_A [2, 16] and lora_B [32, 2] do not fit the base model "
     "(expected [r, 16] and [8, r])"),
    (_pair("2.attn.c_attn", 2, 16, 48), {}, "adapter 'a' has weights for layer 2, but the base model has 2 layers"),
    (_pair("0.attn.c_attn", 2, 16, 48), {"target_modules": ["c_attn", "q_proj"]},
     "target_modules contains 'q_proj', which is not supported; supported target modules: "
     "['c_attn', 'fc_in', 'fc_out']"),
], ids=["unknown-block", "unknown-module", "not-in-that-layer", "wrong-block", "slice-shape", "layer-past-model", "config"])
def test_refusals_name_the_tables_modules_and_shapes(tmp_path, tensors, config, message):
    _write(tmp_path / "a", tensors, **config)
    with pytest.raises(AdapterError) as raised:
        inspect_adapter("a", tmp_path / "a", TOY, 8)
    assert message in str(raised.value)


@pytest.mark.parametrize("key, why", [
    ("1.mlp.shared_expert.up_proj", "layer 1 has a dense MLP (mlp.gate_proj, mlp.up_proj, mlp.down_proj)"),
    ("0.mlp.gate_proj", "layer 0 is a sparse MoE layer: its experts take LoRA as mlp.experts.*, its shared expert "
                        "as mlp.shared_expert.*"),
    ("0.mlp.shared_expert_gate", "LoRA on the shared expert's gate is not supported"),
])
def test_a_moe_layer_refusal_says_what_the_table_has_at_that_layer(key, why):
    """Qwen2-MoE of the fixtures' shape (layer 0 sparse with a shared expert, layer 1 dense): the reason is read
    from the table."""
    cfg = ArchConfig.from_dict({"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 32, "hidden_size": 64,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 96,
                                "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]})
    module = key.split(".", 2)[2]
    with pytest.raises(AdapterError) as raised:
        dense_tensors([f"{PREFIX}{key}.lora_A.weight"], lora_targets(cfg))
    assert str(raised.value) == (f"adapter tensor '{PREFIX}{key}.lora_A.weight' targets '{module}', which the base "
                                 f"model (Qwen2MoeForCausalLM) cannot serve there: {why}")
