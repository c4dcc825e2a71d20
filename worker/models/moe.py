"""Mixture-of-experts decoders: Qwen3-MoE, Mixtral and Qwen2-MoE (with its gated shared expert).

The Llama-family decoder (models/llama.py) with a sparse MoE block (layers/moe.py) as the MLP of its sparse
layers; layers the config keeps dense (`mlp_only_layers`, `decoder_sparse_step`) get a LlamaMLP. LoRA for
now covers the attention projections only: expert LoRA comes with the MoE-LoRA kernels.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.layers.kernel_choices import KernelChoices
from worker.layers.moe import SparseMoE
from worker.models.llama import LlamaForCausalLM, LlamaMLP


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers route each token to its top-k experts."""
    # Mixtral multiplies by the float32 routing weights; Qwen casts them to the hidden dtype first
    float32_routing_weights = False
    lora_targets = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                    "o_proj": ("o_proj", 0)}

    def build_mlp(self, layer: int, dtype: torch.dtype, kernels: KernelChoices) -> nn.Module:
        c = self.cfg
        if not c.is_sparse_layer(layer):
            return LlamaMLP(c, dtype, kernels)
        shared = (LlamaMLP(c, dtype, kernels, c.shared_expert_intermediate_size)
                  if c.shared_expert_intermediate_size else None)
        return SparseMoE(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                         c.norm_topk_prob, self.float32_routing_weights, dtype, kernels, shared)

    def lora_projections(self) -> list[tuple[int, str]]:
        """Attention only, in layer order: expert, shared-expert and dense-layer MLP LoRA are not served yet."""
        return [(layer, name) for layer in range(self.cfg.num_layers) for name in ("qkv_proj", "o_proj")]


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE: q/k norms, top-k renormalised when norm_topk_prob."""


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE: q/k/v biases and a shared expert gated by sigmoid(shared_expert_gate(x))."""


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral: top-k weights always renormalised and kept in float32 for the weighted sum."""
    float32_routing_weights = True
