"""Paged attention over the KV pool: norms q and k per head (Qwen3), rotates them, writes the step's K/V, then
attends (prefill, extend and decode alike)."""
from __future__ import annotations

import torch
from torch import nn

from worker.batch import ForwardBatch
from worker.kernels import reference
from worker.layers.kernel_choices import KernelChoices
from worker.layers.norm import RMSNorm
from worker.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, rotary: RotaryEmbedding,
                 kernels: KernelChoices):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.rotary, self.kernels = rotary, kernels

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                batch: ForwardBatch, qkv_delta: torch.Tensor | None = None,
                qk_norm: tuple[RMSNorm, RMSNorm] | None = None) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]; q and k normed (qk_norm:
        # Qwen3's per-head q_norm, k_norm) and rotated in place; qkv_delta: the qkv projection's LoRA output still to
        # be added first (Linear.forward_deferred; CUDA only)
        k_cache, v_cache = kv_cache                     # each [num_blocks, block_size, num_kv_heads, head_dim]
        if q.is_cuda:   # Triton kernels; imported here so CPU-only installs need no triton
            from worker.kernels.attention import paged_attention
            from worker.kernels.fused import rotary_store_kv
            pdl = self.kernels.programmatic_launch
            # q_norm and k_norm share the model's rms_norm_eps (models/llama.py): the kernel takes one eps
            norms = None if qk_norm is None else (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)
            rotary_store_kv(batch.positions, q, k, v, self.rotary.cos, self.rotary.sin, k_cache, v_cache,
                            batch.kv_slot_mapping, qkv_delta, programmatic_launch=pdl, qk_norm=norms)
            return paged_attention(q, k_cache, v_cache, batch.block_tables, batch.query_start_loc, batch.seq_lens,
                                   self.scale, batch.num_seqs, batch.max_query_len, programmatic_launch=pdl)
        assert qkv_delta is None, "deferred LoRA deltas exist on CUDA only"
        if qk_norm is not None:
            q, k = qk_norm[0](q), qk_norm[1](k)
        self.rotary(batch.positions, q, k)
        reference.store_kv(k, v, k_cache, v_cache, batch.kv_slot_mapping)
        return reference.paged_attention(q, k_cache, v_cache, batch.block_tables, batch.query_start_loc_host,
                                         batch.seq_lens_host, self.scale)
