"""The MoE facts of ArchConfig from config.json, in transformers 5's and the older spellings."""
from __future__ import annotations

import pytest

from worker.arch import ArchConfig

_COMMON = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=96)


def test_dense_config_has_no_experts():
    cfg = ArchConfig.from_dict(dict(_COMMON, architectures=["LlamaForCausalLM"]))
    assert not cfg.is_moe and cfg.num_experts == 0
    assert not any(cfg.is_sparse_layer(i) for i in range(4))


@pytest.mark.parametrize("experts_key", ["num_experts", "num_local_experts"])
def test_qwen3_moe_fields(experts_key):
    cfg = ArchConfig.from_dict(dict(_COMMON, architectures=["Qwen3MoeForCausalLM"], moe_intermediate_size=32,
                                    num_experts_per_tok=2, norm_topk_prob=True, **{experts_key: 8}))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.norm_topk_prob and cfg.qk_norm and not cfg.qkv_bias
    assert cfg.intermediate_size == 96 and cfg.shared_expert_intermediate_size == 0


def test_mixtral_experts_take_intermediate_size_and_always_renormalise():
    cfg = ArchConfig.from_dict(dict(_COMMON, architectures=["MixtralForCausalLM"], num_local_experts=8,
                                    num_experts_per_tok=2))
    assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 96, True)


@pytest.mark.parametrize("extra, qkv_bias", [({}, True), ({"qkv_bias": True}, True), ({"qkv_bias": False}, False)])
def test_qwen2_moe_shared_expert_dense_layers_and_bias(extra, qkv_bias):
    cfg = ArchConfig.from_dict(dict(_COMMON, architectures=["Qwen2MoeForCausalLM"], num_experts=8,
                                    num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, decoder_sparse_step=2, mlp_only_layers=[3],
                                    **extra))
    assert cfg.shared_expert_intermediate_size == 48 and cfg.qkv_bias == qkv_bias and not cfg.o_bias
    # sparse when (i + 1) % 2 == 0 and i not in mlp_only_layers
    assert [cfg.is_sparse_layer(i) for i in range(4)] == [False, True, False, False]
