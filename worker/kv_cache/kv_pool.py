"""Device memory for K/V: one [num_blocks, block_size, num_kv_heads, head_dim] pair per layer."""
from __future__ import annotations

import logging

import torch

from worker.config import CacheConfig
from worker.models.hf_config import ArchConfig

logger = logging.getLogger(__name__)


def bytes_per_block(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * arch.num_layers * block_size * arch.kv_size * dtype.itemsize


def kv_budget_bytes(cache: CacheConfig, device: torch.device) -> int:
    """Bytes the KV pool may take: explicit, else the CPU default, else what is left on the GPU."""
    if cache.kv_cache_memory_bytes is not None:
        return cache.kv_cache_memory_bytes
    if device.type != "cuda":
        return cache.cpu_kv_cache_bytes
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return max(0, int(total * cache.gpu_memory_utilization) - used)


class KVPool:
    def __init__(self, arch: ArchConfig, cache: CacheConfig, dtype: torch.dtype, device: torch.device,
                 max_model_len: int):
        self.block_size = cache.block_size
        per_block = bytes_per_block(arch, cache.block_size, dtype)
        num_blocks = cache.num_blocks_override or kv_budget_bytes(cache, device) // per_block
        if num_blocks < 1:
            raise ValueError("No memory is left for the KV cache; lower --max-model-len or raise "
                             "--gpu-memory-utilization")
        self.num_blocks = num_blocks
        shape = (num_blocks, cache.block_size, arch.num_kv_heads, arch.head_dim)
        self.caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(arch.num_layers)]
        logger.info("KV pool: %d blocks of %d tokens (%.1f MiB, %.0f max-length sequences)", num_blocks,
                    cache.block_size, num_blocks * per_block / 2**20,
                    num_blocks * cache.block_size / max_model_len)
