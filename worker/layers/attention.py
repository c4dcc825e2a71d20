"""Paged attention over the KV pool: norms q and k per head (Qwen3), rotates them, writes the step's K/V, then
attends (prefill, extend and decode alike)."""
from __future__ import annotations

import torch
from torch import nn

from worker.batch import ForwardBatch
from worker.kernels import ops
from worker.kernels.choices import KernelChoices
from worker.layers.lora.deferred import Deferred, split
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding,
                 kernels: KernelChoices, qk_norm: tuple[RMSNorm, RMSNorm] | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim ** -0.5
        self.rotary, self.kernels = rotary, kernels
        # Qwen3's per-head q_norm and k_norm (owned by the model's attention block, which loads them); they share
        # the model's rms_norm_eps, so the fused kernel takes one eps
        self.qk_norm = qk_norm
        # per-tensor scales of an FP8 KV cache (kernels/reference.store_kv: stored = x / scale, read = stored * scale):
        # set by the weight loader from the checkpoint (models/kv_scales.py), else 1.0; a cache in the model's dtype
        # ignores them. Host floats fixed at load, so CUDA graphs capture them as constants
        self.k_scale, self.v_scale = 1.0, 1.0

    def forward(self, qkv: torch.Tensor | Deferred, kv_cache: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch) -> torch.Tensor:
        """qkv: [num_tokens, q | k | v of this rank's heads], the qkv projection's output (its LoRA delta still to
        add, or not: layers/lora/deferred.py) -> [num_tokens, num_heads * head_dim]."""
        qkv, delta = split(qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)        # [num_tokens, this rank's heads, head_dim]
        k = k.view(-1, self.num_kv_heads, self.head_dim)     # [num_tokens, this rank's KV heads, head_dim]
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        norms = None if self.qk_norm is None else (self.qk_norm[0].weight, self.qk_norm[1].weight,
                                                   self.qk_norm[0].eps)
        out = ops.attention(q, k, v, delta, kv_cache, batch, self.rotary.cos, self.rotary.sin, self.scale, norms,
                            self.kernels, (self.k_scale, self.v_scale))
        return out.reshape(-1, self.q_size)
