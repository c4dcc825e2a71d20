"""The engine with an FP8 KV cache (--kv-cache-dtype fp8) on the CPU, where the torch references store K/V as E4M3 and
read them back in float32.

Exactly the quantized math: its logits are those of a float32-cache engine whose K/V are rounded through E4M3 as they
are stored (the same values reach the same float32 attention). Against the float32 cache itself: every K and V
element carries a relative error of at most u8 = 2^-4 (E4M3 keeps 3 mantissa bits, rounded to nearest) of the
tensor's scale; taking, as tests/fp32_bounds.py does for sums, each of the 2 · num_layers quantized tensors to move
the logits by at most u8 of their scale, unamplified, gives |Δlogits| ≤ 2 · num_layers · u8 · max|logits| (1/4 for
the 2-layer fixtures; 0.02-0.08 measured). Greedy tokens then agree up to a near-tie: on the tiny random Llama, 65 of
128 tokens (8 prompts × 16) come before the runs part, because its logits are nearly flat (the top two are often
within 1 % of the largest logit, where an FP8 cache moves them by 2-8 %); every parting was at such a tie.
"""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import save_file

from tests.fp32_bounds import assert_same_until_a_tie, forward_rtol
from worker.arch import ArchConfig
from worker.config import CacheConfig, ModelConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams
from worker.kernels import reference
from worker.kv_cache.kv_pool import bytes_per_block

STEPS = 8
E4M3_UNIT_ROUNDOFF = 2.0 ** -4


def prompts(n: int) -> list[list[int]]:
    return [torch.randint(2, 320, (9 + 3 * i,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(n)]


def make_engine(model_dir, kv_cache_dtype: str, **cache) -> Engine:
    cache = CacheConfig(block_size=4, kv_cache_dtype=kv_cache_dtype, **({"num_gpu_blocks_override": 128} | cache))
    return Engine(WorkerConfig(ModelConfig(str(model_dir)), cache=cache, device="cpu"))


def greedy(engine: Engine, prompt: list[int], steps: int = STEPS) -> tuple[list[int], torch.Tensor, int]:
    """One request alone: its greedy tokens, its logits [steps, vocab], the prompt tokens it found cached."""
    captured, execute = [], engine.runner.execute

    def capture(batch, prev=None):
        out = execute(batch, prev)
        captured.append(out.logits[0].clone())
        return out

    engine.runner.execute = capture
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True))
    tokens, cached = [], None
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens if cached is None else cached
    engine.runner.execute = execute
    return tokens, torch.stack(captured), cached


@pytest.fixture
def with_kv_scales(hf_models, tmp_path):
    """The tiny Llama with compressed-tensors' per-layer k_scale / v_scale beside its weights."""
    model_dir = tmp_path / "llama-kv-scales"
    shutil.copytree(hf_models["llama"], model_dir, ignore=shutil.ignore_patterns("adapters*"))
    scales = {f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor([s])
              for i in range(2) for kv, s in (("k", 0.0137 * (i + 1)), ("v", 0.0041 * (i + 2)))}
    save_file(scales, str(model_dir / "kv_scales.safetensors"))
    return model_dir


def test_fp8_cache_is_a_float32_cache_whose_kv_are_rounded_through_e4m3(with_kv_scales, monkeypatch):
    fp8_engine = make_engine(with_kv_scales, "fp8")
    loaded = [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in fp8_engine.runner.model.layers]
    assert loaded == [(pytest.approx(0.0137), pytest.approx(0.0082)), (pytest.approx(0.0274), pytest.approx(0.0123))]
    fp8 = [greedy(fp8_engine, p) for p in prompts(3)]
    quantize = reference.quantize_kv

    def round_trip(x, scale, cache_dtype):      # stored in float32 as the FP8 cache reads them back
        return reference.dequantize_kv(quantize(x, scale, reference.KV_FP8_DTYPE), scale)

    monkeypatch.setattr(reference, "quantize_kv", round_trip)
    engine = make_engine(with_kv_scales, "auto")
    for layer, (k, v) in zip(engine.runner.model.layers, loaded):     # auto ignores the checkpoint's: set them
        layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale = k, v
    rtol = forward_rtol(ArchConfig.from_dir(with_kv_scales), longest_seq=15 + STEPS)
    for prompt, (tokens, logits, _) in zip(prompts(3), fp8):
        want_tokens, want_logits, _ = greedy(engine, prompt)
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, rtol=0, atol=rtol * want_logits.abs().max().item())


def test_fp8_cache_logits_stay_within_the_e4m3_bound_of_a_float32_cache(hf_models):
    fp8, fp32 = make_engine(hf_models["llama"], "fp8"), make_engine(hf_models["llama"], "auto")
    num_layers = ArchConfig.from_dir(hf_models["llama"]).num_layers
    rtol = 2 * num_layers * E4M3_UNIT_ROUNDOFF
    for i, prompt in enumerate(prompts(4)):
        tokens, logits, _ = greedy(fp8, prompt)
        want_tokens, want_logits, _ = greedy(fp32, prompt)
        assert_same_until_a_tie(tokens, want_tokens, want_logits, logits, rtol, f"prompt {i}")


def test_fp8_cache_holds_four_times_the_blocks_of_a_float32_cache_in_the_cpu_budget(hf_models):
    engines = {dtype: make_engine(hf_models["llama"], dtype, num_gpu_blocks_override=None) for dtype in ("auto", "fp8")}
    arch = ArchConfig.from_dir(hf_models["llama"])
    budget = CacheConfig().cpu_kv_cache_bytes
    assert engines["auto"].num_kv_blocks == budget // bytes_per_block(arch, 4, torch.float32)
    assert engines["fp8"].num_kv_blocks == budget // bytes_per_block(arch, 4, torch.float8_e4m3fn)
    assert engines["fp8"].num_kv_blocks == 4 * engines["auto"].num_kv_blocks      # the budget divides evenly
    assert all(k.dtype == torch.float8_e4m3fn for k, _ in engines["fp8"].runner.kv_pool.caches)


def test_a_cached_fp8_prefix_gives_what_computing_it_gives(hf_models):
    """Prefix caching is untouched: blocks hold the same E4M3 bytes whether found cached or computed again; the
    logits part by the summation order alone (the suffix computed in a 1-row step instead of a 21-row one)."""
    prompt = prompts(1)[0] + prompts(2)[1]        # 21 tokens: 5 full blocks of 4 before the last token
    engine = make_engine(hf_models["llama"], "fp8")
    first = greedy(engine, prompt)
    again = greedy(engine, prompt)
    fresh = greedy(make_engine(hf_models["llama"], "fp8", enable_prefix_caching=False), prompt)
    assert (first[2], again[2], fresh[2]) == (0, 20, 0)
    assert again[0] == fresh[0] == first[0]
    rtol = forward_rtol(ArchConfig.from_dir(hf_models["llama"]), longest_seq=len(prompt) + STEPS)
    torch.testing.assert_close(again[1], fresh[1], rtol=0, atol=rtol * fresh[1].abs().max().item())
