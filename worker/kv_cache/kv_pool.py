"""Device memory for K/V: one [num_blocks, block_size, num_kv_heads, head_dim] pair per layer."""
from __future__ import annotations

import logging

import torch

from worker.config import CacheConfig
from worker.arch import ArchConfig

logger = logging.getLogger(__name__)


def bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * arch.num_layers * block_size * arch.kv_size * dtype.itemsize


def fixed_num_blocks(arch: ArchConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device) -> int | None:
    """The pool's size when the configuration fixes it (a block count, a byte budget, or the CPU default);
    None on a GPU without either, where the memory plan sizes it (model_runner/memory_plan.py)."""
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    per_block = bytes_per_block(arch, cache.block_size, dtype)
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes // per_block
    if device.type != "cuda":
        return cache.cpu_kv_cache_bytes // per_block
    return None


class KVPool:
    def __init__(self, arch: ArchConfig, block_size: int, num_blocks: int, dtype: torch.dtype, device: torch.device):
        if num_blocks < 1:
            raise ValueError("No memory is left for the KV cache; lower --max-model-len or raise "
                             "--gpu-memory-utilization")
        self.block_size, self.num_blocks = block_size, num_blocks
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        self.caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(arch.num_layers)]
        self.num_bytes = num_blocks * bytes_per_block(arch, block_size, dtype)

    def describe(self, max_model_len: int) -> str:
        return (f"KV pool: {self.num_blocks} blocks of {self.block_size} tokens ({self.num_bytes / 2**20:.1f} MiB, "
                f"{self.num_blocks * self.block_size / max_model_len:.0f} max-length sequences)")
