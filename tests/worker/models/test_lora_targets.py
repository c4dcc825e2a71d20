"""Each model family's LoRA targets (lora/targets.py), computed from config.json alone, against two independent
sources: the Hugging Face model of the same config (checkpoint module names and weight shapes, what PEFT adapters
are trained on) and our built model (its fused projections and experts, which the slot layout fills)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from worker.arch import ArchConfig
from worker.config import KernelConfig
from worker.layers.linear import Linear
from worker.layers.sparse_moe import SparseMoE
from worker.models.builder import build_model, lora_targets

FAMILIES = ["llama", "qwen3", "qwen2_moe", "mixtral", "qwen3_moe-mlp-only-layer-0"]


@pytest.fixture(scope="module")
def model_dirs(hf_models, hf_moe_models, tmp_path_factory) -> dict:
    """The fixtures' checkpoints by family; Qwen3-MoE with its layer 0 kept dense (mlp_only_layers) as a config
    only (random weights: the test reads names and shapes)."""
    dirs = {"llama": hf_models["llama"], "qwen3": hf_models["qwen3"], "qwen2_moe": hf_moe_models["qwen2_moe"],
            "mixtral": hf_moe_models["mixtral"]}
    path = tmp_path_factory.mktemp("qwen3_moe_mlp_only")
    config = json.loads((hf_moe_models["qwen3_moe"] / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "mlp_only_layers": [0]}))
    dirs["qwen3_moe-mlp-only-layer-0"] = path
    return dirs


def _hf_model(model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_module_of_the_table_is_a_linear_of_the_hf_model_of_its_shape(model_dirs, family):
    """Each packed module's path under a layer names a Linear of the HF model with weight [out, in], and the
    layer's MLP modules are exactly the HF layer's (a dense MLP, a shared expert, or none)."""
    cfg = ArchConfig.from_dir(model_dirs[family])
    table, hf = lora_targets(cfg), _hf_model(model_dirs[family])
    for layer, hf_layer in enumerate(hf.model.layers):
        for target in table.at(layer):
            for module, out_features in zip(target.modules, target.out_features):
                weight = hf_layer.get_submodule(target.path(module)).weight
                assert tuple(weight.shape) == (out_features, target.in_features), (layer, module)
        hf_mlp_linears = {f"mlp.{name}" for name, m in hf_layer.mlp.named_modules()
                          if isinstance(m, torch.nn.Linear) and name not in ("gate", "shared_expert_gate")}
        assert {t.path(m) for t in table.at(layer) if t.block == "mlp" for m in t.modules} == hf_mlp_linears


@pytest.mark.parametrize("family", FAMILIES)
def test_the_table_experts_are_the_hf_models_sparse_layers(model_dirs, family):
    cfg = ArchConfig.from_dir(model_dirs[family])
    table, hf = lora_targets(cfg), _hf_model(model_dirs[family])
    sparse = [layer for layer, hf_layer in enumerate(hf.model.layers) if hasattr(hf_layer.mlp, "experts")]
    if table.experts is None:
        assert sparse == [] and table.modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj")
        return
    assert list(table.experts.sparse_layers) == sparse and table.experts.block == "mlp"
    e, h, i = table.experts.num_experts, table.experts.hidden_size, table.experts.intermediate_size
    for layer in sparse:
        experts = hf.model.layers[layer].mlp.experts
        assert tuple(experts.gate_up_proj.shape) == (e, 2 * i, h) and tuple(experts.down_proj.shape) == (e, h, i)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_table_is_the_built_models_projections_and_experts(model_dirs, family, tmp_path):
    """Every Linear of our built model takes LoRA as the table says (routers and the shared expert's gate never),
    with the table's shapes and slices; the sparse layers are the model's SparseMoE blocks."""
    shutil.copy(model_dirs[family] / "config.json", tmp_path / "config.json")
    model = build_model(tmp_path, torch.float32, torch.device("cpu"), "dummy", 64, KernelConfig())
    table = lora_targets(model.cfg)
    assert table == type(model).lora_targets(model.cfg)
    projections = table.layer_projections()
    for layer, name in projections:
        target, proj = table.target(name), model.projection(layer, name)
        assert (proj.in_features, tuple(proj.output_sizes)) == (target.in_features, target.out_features)
    linears = {name for name, m in model.named_modules() if isinstance(m, Linear)}
    never_lora = {name for name in linears if name.endswith((".mlp.gate", ".mlp.shared_expert_gate"))}
    assert linears - never_lora == {f"layers.{layer}.{table.target(name).block}.{name}" for layer, name in projections}
    sparse = [layer for layer, block in enumerate(model.layers) if isinstance(block.mlp, SparseMoE)]
    assert sparse == (list(table.experts.sparse_layers) if table.experts else [])
    for layer in sparse:
        e, two_i, h = model.moe_block(layer).experts.gate_up_proj.shape
        assert (e, two_i // 2, h) == (table.experts.num_experts, table.experts.intermediate_size,
                                      table.experts.hidden_size)


def test_the_modules_adapters_list_follow_the_tables_order(model_dirs):
    """Qwen2-MoE: attention, the dense layer's MLP, the shared expert, then the experts."""
    table = lora_targets(ArchConfig.from_dir(model_dirs["qwen2_moe"]))
    assert table.modules == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                             "shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj",
                             "experts.gate_proj", "experts.up_proj", "experts.down_proj")
    assert table.layers == (("qkv_proj", "o_proj", "shared_expert.gate_up_proj", "shared_expert.down_proj"),
                            ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert table.packing(0, "shared_expert.up_proj") == (table.target("shared_expert.gate_up_proj"), 1)
    assert table.find(1, "mlp.shared_expert.up_proj") is None and table.find(2, "self_attn.q_proj") is None
