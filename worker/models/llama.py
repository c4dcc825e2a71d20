"""Llama-family decoder (Llama 2/3.x, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm).

Our own modules: fused qkv and gate_up projections, paged attention, LoRA on every projection. `kernels`
(kernels/choices.py) is handed to every layer that launches a kernel, `tp` (distributed/tensor_parallel.py) to
every layer that holds a shard: qkv and gate_up column-parallel, o and down row-parallel (one all-reduce each),
heads and KV heads split across ranks, embedding and LM head vocab-parallel.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.batch import ForwardBatch
from worker.distributed.tensor_parallel import SINGLE, TensorParallel
from worker.kernels.choices import KernelChoices
from worker.layers.activation import SiluAndMul
from worker.layers.attention import Attention
from worker.layers.embedding import Embedding, LMHead
from worker.layers.linear import Linear
from worker.layers.lora.deferred import Deferred
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding
from worker.lora.targets import LoRATarget, LoRATargets
from worker.arch import ArchConfig


class LlamaAttention(nn.Module):
    """This rank's query heads (an even share) and KV heads (TensorParallel.kv_heads) of the attention."""

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, dtype: torch.dtype, kernels: KernelChoices,
                 tp: TensorParallel = SINGLE, prefix: str = "model.layers.0.self_attn"):
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        head_start, self.num_heads = tp.split(cfg.num_heads, "Total number of attention heads")
        kv_start, self.num_kv_heads = tp.kv_heads(cfg.num_kv_heads)
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        kv_shard = (kv_start * d, self.kv_size)
        self.qkv_proj = Linear.column_parallel(cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size],
                                               [(head_start * d, self.q_size), kv_shard, kv_shard], cfg.qkv_bias,
                                               dtype, kernels, kernels.linear_scheme(
                                                   [f"{prefix}.{n}" for n in ("q_proj", "k_proj", "v_proj")]))
        self.o_proj = Linear.row_parallel(cfg.q_size, [cfg.hidden_size], cfg.o_bias, dtype, kernels, tp,
                                          scheme=kernels.linear_scheme([f"{prefix}.o_proj"]))
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, kernels) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, kernels) if cfg.qk_norm else None
        qk_norm = (self.q_norm, self.k_norm) if cfg.qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, d, rotary, kernels, qk_norm)

    @staticmethod
    def lora_targets(cfg: ArchConfig) -> tuple[LoRATarget, ...]:
        """qkv_proj packs the checkpoint's q_proj, k_proj, v_proj; o_proj is itself (whole-model shapes)."""
        h = cfg.hidden_size
        return (LoRATarget("qkv_proj", "self_attn", ("q_proj", "k_proj", "v_proj"), h,
                           (cfg.q_size, cfg.kv_size, cfg.kv_size)),
                LoRATarget("o_proj", "self_attn", ("o_proj",), cfg.q_size, (h,)))

    def forward(self, x: torch.Tensor, kv_cache, batch: ForwardBatch) -> torch.Tensor | Deferred:
        """x: [num_tokens, hidden] -> the o_proj output [num_tokens, hidden] (projections may hand their LoRA delta
        to the next kernel: layers/lora/deferred.py)."""
        qkv = self.qkv_proj(x, batch.lora)
        return self.o_proj(self.attn(qkv, kv_cache, batch), batch.lora)


class LlamaMLP(nn.Module):
    """gate_up column-parallel, down row-parallel; `reduce_results=False` leaves down's output a partial sum at
    world size > 1, for the caller to all-reduce (Qwen2-MoE's shared expert: layers/sparse_moe.py)."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, kernels: KernelChoices, intermediate_size: int = 0,
                 tp: TensorParallel = SINGLE, reduce_results: bool = True, prefix: str = "model.layers.0.mlp"):
        super().__init__()
        i = intermediate_size or cfg.intermediate_size
        shard = tp.split(i, "Intermediate size")
        self.gate_up_proj = Linear.column_parallel(
            cfg.hidden_size, [i, i], [shard, shard], cfg.mlp_bias, dtype, kernels,
            kernels.linear_scheme([f"{prefix}.gate_proj", f"{prefix}.up_proj"]))
        self.down_proj = Linear.row_parallel(i, [cfg.hidden_size], cfg.mlp_bias, dtype, kernels, tp, reduce_results,
                                             kernels.linear_scheme([f"{prefix}.down_proj"]))
        self.act = SiluAndMul(kernels)

    @staticmethod
    def lora_targets(cfg: ArchConfig, intermediate_size: int, prefix: str = "") -> tuple[LoRATarget, ...]:
        """gate_up_proj packs the checkpoint's gate_proj and up_proj; down_proj is itself. `prefix`: the MLP's
        name under the layer's `mlp` ("shared_expert." for Qwen2-MoE's shared expert)."""
        h, i = cfg.hidden_size, intermediate_size
        return (LoRATarget(f"{prefix}gate_up_proj", "mlp", (f"{prefix}gate_proj", f"{prefix}up_proj"), h, (i, i)),
                LoRATarget(f"{prefix}down_proj", "mlp", (f"{prefix}down_proj",), i, (h,)))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor | Deferred:
        """x: [num_tokens, hidden] -> the down_proj output [num_tokens, hidden]."""
        return self.down_proj(self.act(self.gate_up_proj(x, batch.lora)), batch.lora)


class LlamaDecoderLayer(nn.Module):
    """Attention, then `mlp` (called as mlp(x, batch) -> y): a LlamaMLP or a sparse MoE block
    (layers/sparse_moe.py)."""

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, dtype: torch.dtype, kernels: KernelChoices,
                 mlp: nn.Module, tp: TensorParallel = SINGLE, prefix: str = "model.layers.0"):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary, dtype, kernels, tp, f"{prefix}.self_attn")
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)

    def forward(self, h: torch.Tensor | Deferred, residual: torch.Tensor | None, kv_cache,
                batch: ForwardBatch) -> tuple[torch.Tensor | Deferred, torch.Tensor]:
        """h: the previous layer's output (the embeddings at layer 0), residual: the running sum before it (None
        at layer 0). Returns (this layer's MLP output, the running sum before it); each add is fused into the
        next norm."""
        if residual is None:
            residual = h
            x = self.input_layernorm(h)
        else:
            x = self.input_layernorm(h, residual)
        h = self.self_attn(x, kv_cache, batch)
        x = self.post_attention_layernorm(h, residual)
        return self.mlp(x, batch), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (our parameter, output slice); everything else maps one to one
    stacked_params = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, max_positions: int, kernels: KernelChoices,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        tp.split(cfg.num_heads, "Total number of attention heads")     # refused first, in vLLM's words
        self.cfg, self.tp = cfg, tp
        rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, dtype)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, rotary, dtype, kernels, self.build_mlp(i, dtype, kernels),
                                                      tp, f"model.layers.{i}")
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, kernels)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype,
                              self.embed_tokens if cfg.tie_word_embeddings else None, kernels, tp)

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank caches (the KV pool's per-layer width): all of them at world size 1."""
        return self.layers[0].self_attn.num_kv_heads

    def build_mlp(self, layer: int, dtype: torch.dtype, kernels: KernelChoices) -> nn.Module:
        """The MLP of decoder layer `layer` (MoE models override it)."""
        return LlamaMLP(self.cfg, dtype, kernels, tp=self.tp, prefix=f"model.layers.{layer}.mlp")

    @classmethod
    def lora_targets(cls, cfg: ArchConfig) -> LoRATargets:
        """Which projections take LoRA and how the checkpoint's modules pack into them (lora/targets.py), from the
        architecture alone: qkv_proj, o_proj, gate_up_proj, down_proj in every layer (MoE models override it)."""
        targets = LlamaAttention.lora_targets(cfg) + LlamaMLP.lora_targets(cfg, cfg.intermediate_size)
        names = tuple(t.projection for t in targets)
        return LoRATargets(cfg.architecture, targets, (names,) * cfg.num_layers)

    def projection(self, layer: int, name: str) -> Linear:
        """Our fused projection `name` (a LoRATarget.projection: qkv_proj, o_proj, gate_up_proj, down_proj) of a
        layer."""
        block = self.layers[layer]
        return getattr(block.self_attn if name in ("qkv_proj", "o_proj") else block.mlp, name)

    def forward(self, batch: ForwardBatch, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                out: torch.Tensor | None = None) -> torch.Tensor:
        """Returns logits [num_logits, vocab] (float32) for batch.logits_indices, written into `out` when given
        (the CUDA graphs' shared logits buffer)."""
        h = self.embed_tokens(batch.input_ids)                     # [num_tokens, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, kv_cache, batch)
        rows = batch.logits_indices
        h = self.norm(h[rows], residual[rows])                      # [num_logits, hidden]
        logits = self.lm_head(h)                                    # [num_logits, vocab]
        return logits.float() if out is None else out.copy_(logits)
