"""Mixture-of-experts decoders: Qwen3-MoE, Mixtral and Qwen2-MoE (with its gated shared expert).

The Llama-family decoder (models/llama.py) with a sparse MoE block (layers/sparse_moe.py) as the MLP of its sparse
layers; layers the config keeps dense (`mlp_only_layers`, `decoder_sparse_step`) get a LlamaMLP. LoRA covers the
attention projections, the dense layers' MLPs, Qwen2-MoE's shared expert (all as Linear slot regions) and the
experts of every sparse layer (`SparseMoE.lora`, the slot's expert regions: lora/expert_layout.py).

Tensor parallelism (`tp`): attention and dense MLPs as in models/llama.py; a sparse block's experts hold this
rank's share of the expert intermediate size, its shared expert is column-/row-parallel like a LlamaMLP, its
router and shared-expert gate stay whole, and the block ends in one all-reduce (layers/sparse_moe.py).
"""
from __future__ import annotations

import torch
from torch import nn

from worker.kernels.choices import KernelChoices
from worker.layers.linear import Linear
from worker.layers.sparse_moe import SparseMoE
from worker.models.llama import LlamaForCausalLM, LlamaMLP


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers route each token to its top-k experts."""
    # Mixtral multiplies by the float32 routing weights; Qwen casts them to the hidden dtype first
    float32_routing_weights = False
    # LoRA target module -> (our projection, slice): gate/up/down_proj are the dense layers' MLP, shared_expert.*
    # Qwen2-MoE's shared expert (lora/moe_adapter.py checks which layer has which)
    lora_targets = {**LlamaForCausalLM.lora_targets,
                    "shared_expert.gate_proj": ("shared_expert.gate_up_proj", 0),
                    "shared_expert.up_proj": ("shared_expert.gate_up_proj", 1),
                    "shared_expert.down_proj": ("shared_expert.down_proj", 0)}

    def build_mlp(self, layer: int, dtype: torch.dtype, kernels: KernelChoices) -> nn.Module:
        c = self.cfg
        if not c.is_sparse_layer(layer):
            return LlamaMLP(c, dtype, kernels, tp=self.tp)
        # the shared expert's partial sum joins the routed experts' before the block's one all-reduce
        shared = (LlamaMLP(c, dtype, kernels, c.shared_expert_intermediate_size, self.tp, reduce_results=False)
                  if c.shared_expert_intermediate_size else None)
        return SparseMoE(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                         c.norm_topk_prob, self.float32_routing_weights, dtype, kernels, shared, self.tp)

    def lora_projections(self) -> list[tuple[int, str]]:
        """In layer order: attention, then a dense layer's MLP or a sparse layer's shared expert (if any)."""
        projections = []
        for layer in range(self.cfg.num_layers):
            projections += [(layer, "qkv_proj"), (layer, "o_proj")]
            if not self.cfg.is_sparse_layer(layer):
                projections += [(layer, "gate_up_proj"), (layer, "down_proj")]
            elif self.cfg.shared_expert_intermediate_size:
                projections += [(layer, "shared_expert.gate_up_proj"), (layer, "shared_expert.down_proj")]
        return projections

    def lora_expert_layers(self) -> list[int]:
        return [layer for layer in range(self.cfg.num_layers) if self.cfg.is_sparse_layer(layer)]

    @property
    def moe_intermediate_size_per_rank(self) -> int:
        """The expert intermediate size this rank holds (moe_intermediate_size / world size): what the Triton
        path's MoEWorkspace (kernels/fused_moe.py) must be sized with."""
        return self.tp.split(self.cfg.moe_intermediate_size, "MoE intermediate size")[1]

    def moe_block(self, layer: int) -> SparseMoE:
        return self.layers[layer].mlp

    def projection(self, layer: int, name: str) -> Linear:
        """Our fused projection `name` of a layer; "shared_expert.gate_up_proj" / ".down_proj": the shared expert's."""
        if name.startswith("shared_expert."):
            return getattr(self.layers[layer].mlp.shared_expert, name.removeprefix("shared_expert."))
        return super().projection(layer, name)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE: q/k norms, top-k renormalised when norm_topk_prob."""


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE: q/k/v biases and a shared expert gated by sigmoid(shared_expert_gate(x))."""


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral: top-k weights always renormalised and kept in float32 for the weighted sum."""
    float32_routing_weights = True
