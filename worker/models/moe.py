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
from worker.lora.targets import ExpertShape, LoRATargets
from worker.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from worker.arch import ArchConfig


class MoEForCausalLM(LlamaForCausalLM):
    """A Llama-family decoder whose sparse layers route each token to its top-k experts."""
    # Mixtral multiplies by the float32 routing weights; Qwen casts them to the hidden dtype first
    float32_routing_weights = False
    moe_module = "mlp"          # the sparse block's name in the checkpoint (Mixtral: block_sparse_moe) ...
    expert_modules = ("gate_proj", "up_proj", "down_proj")     # ... and an expert's (Mixtral: w1, w3, w2)

    def build_mlp(self, layer: int, dtype: torch.dtype, kernels: KernelChoices) -> nn.Module:
        c = self.cfg
        if not c.is_sparse_layer(layer):
            return LlamaMLP(c, dtype, kernels, tp=self.tp, prefix=f"model.layers.{layer}.mlp")
        prefix = f"model.layers.{layer}.{self.moe_module}"
        # the shared expert's partial sum joins the routed experts' before the block's one all-reduce
        shared = (LlamaMLP(c, dtype, kernels, c.shared_expert_intermediate_size, self.tp, reduce_results=False,
                           prefix=f"{prefix}.shared_expert")
                  if c.shared_expert_intermediate_size else None)
        return SparseMoE(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                         c.norm_topk_prob, self.float32_routing_weights, dtype, kernels, shared, self.tp, prefix,
                         self.expert_modules)

    @classmethod
    def lora_targets(cls, cfg: ArchConfig) -> LoRATargets:
        """Attention in every layer; then a dense layer's MLP, or a sparse layer's shared expert (Qwen2-MoE) and
        its routed experts. The shared expert's sigmoid gate takes no LoRA."""
        attention = LlamaAttention.lora_targets(cfg)
        dense = LlamaMLP.lora_targets(cfg, cfg.intermediate_size)
        shared_size = cfg.shared_expert_intermediate_size
        shared = LlamaMLP.lora_targets(cfg, shared_size, "shared_expert.") if shared_size else ()
        dense_layers = tuple(layer for layer in range(cfg.num_layers) if not cfg.is_sparse_layer(layer))
        layers = tuple(attention + (dense if layer in dense_layers else shared) for layer in range(cfg.num_layers))
        used = {t for layer in layers for t in layer}
        experts = ExpertShape(cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                              dense_layers)
        unsupported = ({"mlp.shared_expert_gate": "LoRA on the shared expert's gate is not supported"}
                       if shared_size else {})
        return LoRATargets(cfg.architecture, tuple(t for t in attention + dense + shared if t in used),
                           tuple(tuple(t.projection for t in layer) for layer in layers), experts, unsupported)

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
    moe_module = "block_sparse_moe"
    expert_modules = ("w1", "w3", "w2")
