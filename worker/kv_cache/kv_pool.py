"""Device memory for K/V: one [num_blocks, block_size, num_kv_heads, head_dim] pair per layer, in the model's dtype
or FP8 (--kv-cache-dtype fp8: one byte an element, so the same memory holds twice the blocks of a 16-bit model)."""
from __future__ import annotations

import logging

import torch

from worker.config import CacheConfig
from worker.arch import ArchConfig

logger = logging.getLogger(__name__)

FP8_MIN_CAPABILITY = (8, 9)     # Ada and Hopper on: Triton converts float8_e4m3fn from SM 8.9


def kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The pool's element type for --kv-cache-dtype `name` (config.KV_CACHE_DTYPES): the model's dtype for auto,
    float8_e4m3fn for fp8 and fp8_e4m3 (how values are stored and read: kernels/reference.store_kv). Raises
    ValueError for FP8 on a GPU older than FP8_MIN_CAPABILITY."""
    if name == "auto":
        return model_dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"--kv-cache-dtype {name} needs a GPU of compute capability 8.9 or newer (Ada, Hopper, "
                         f"Blackwell); this one is {major}.{minor}. Use --kv-cache-dtype auto")
    return torch.float8_e4m3fn


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
        self.block_size, self.num_blocks, self.dtype = block_size, num_blocks, dtype
        shape = (num_blocks, block_size, arch.num_kv_heads, arch.head_dim)
        self.caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                       for _ in range(arch.num_layers)]
        self.num_bytes = num_blocks * bytes_per_block(arch, block_size, dtype)

    def describe(self, max_model_len: int) -> str:
        return (f"KV pool: {self.num_blocks} blocks of {self.block_size} tokens = {self.num_blocks * self.block_size} "
                f"tokens ({str(self.dtype).removeprefix('torch.')}, {self.num_bytes / 2**20:.1f} MiB, "
                f"{self.num_blocks * self.block_size / max_model_len:.0f} max-length sequences)")
