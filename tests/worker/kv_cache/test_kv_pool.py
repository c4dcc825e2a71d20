"""The KV pool's element type (--kv-cache-dtype) and what it does to the pool's size: an FP8 pool counts one byte an
element, so a fixed budget holds exactly itemsize(model dtype) times the blocks (2x a 16-bit model's)."""
from __future__ import annotations

import pytest
import torch

from worker.arch import ArchConfig
from worker.config import CacheConfig
from worker.kv_cache.kv_pool import KVPool, bytes_per_block, fixed_num_blocks, kv_cache_dtype
from worker.model_runner.memory_plan import GiB, MemoryLimits, MemoryPlanError, plan_memory

CPU = torch.device("cpu")
# Llama-3-8B's K/V shape: 32 layers, 8 KV heads of 128
ARCH = ArchConfig("LlamaForCausalLM", 128256, 4096, 32, 32, 8, 128, 14336, 1e-5, 5e5, None, 8192, False, False,
                  False, False, False, torch.bfloat16, (1,))


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3"])
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_names_store_e4m3_and_auto_keeps_the_model_dtype(name, model_dtype):
    assert kv_cache_dtype(name, model_dtype, CPU) == torch.float8_e4m3fn
    assert kv_cache_dtype("auto", model_dtype, CPU) == model_dtype


@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float32])
def test_a_byte_budget_holds_the_ratio_of_element_sizes_more_fp8_blocks(model_dtype):
    per_block = bytes_per_block(ARCH, 16, model_dtype)
    assert per_block == 2 * 32 * 16 * 8 * 128 * model_dtype.itemsize         # K and V, every layer, 16 tokens
    assert bytes_per_block(ARCH, 16, torch.float8_e4m3fn) * model_dtype.itemsize == per_block
    cache = CacheConfig(kv_cache_memory_bytes=1000 * per_block)
    assert fixed_num_blocks(ARCH, cache, model_dtype, CPU) == 1000
    assert fixed_num_blocks(ARCH, cache, torch.float8_e4m3fn, CPU) == 1000 * model_dtype.itemsize


def test_a_block_count_override_is_a_count_whatever_the_dtype():
    cache = CacheConfig(num_gpu_blocks_override=77)
    assert fixed_num_blocks(ARCH, cache, torch.float8_e4m3fn, CPU) == fixed_num_blocks(ARCH, cache, torch.bfloat16,
                                                                                       CPU) == 77


def test_the_memory_plan_fits_a_max_length_sequence_in_half_the_bytes_with_fp8():
    """plan_memory takes K/V bytes per token from the pool's element type; 6 GiB left for KV fits a 64k sequence of
    an 8B model in FP8 (4 GiB) but not in bf16 (8 GiB)."""
    limits = MemoryLimits(0.9, 65536, 256, 2048, 4)
    args = dict(total=80 * GiB, free_at_start=79 * GiB, free_now=12 * GiB, torch_reserved=64 * GiB,
                weights=60 * GiB, lora_slots=0, moe_buffers=0, activations=GiB // 2, graphs=GiB // 2, limits=limits)
    per_token = {dtype: bytes_per_block(ARCH, 16, dtype) // 16 for dtype in (torch.bfloat16, torch.float8_e4m3fn)}
    with pytest.raises(MemoryPlanError, match="--max-model-len 65536"):
        plan_memory(kv_bytes_per_token=per_token[torch.bfloat16], **args)
    plan = plan_memory(kv_bytes_per_token=per_token[torch.float8_e4m3fn], **args)
    assert plan.kv // bytes_per_block(ARCH, 16, torch.float8_e4m3fn) == 2 * (plan.kv // bytes_per_block(
        ARCH, 16, torch.bfloat16))


def test_the_pool_allocates_its_element_type_and_says_so():
    arch = ArchConfig("LlamaForCausalLM", 320, 64, 2, 4, 2, 16, 112, 1e-5, 1e4, None, 256, False, False, False,
                      False, False, torch.float32, (1,))
    pool = KVPool(arch, 4, 10, torch.float8_e4m3fn, CPU)
    assert all(k.dtype == v.dtype == torch.float8_e4m3fn and k.shape == (10, 4, 2, 16) for k, v in pool.caches)
    assert pool.num_bytes == 2 * 2 * 10 * 4 * 2 * 16
    assert "10 blocks of 4 tokens = 40 tokens (float8_e4m3fn" in pool.describe(max_model_len=20)
