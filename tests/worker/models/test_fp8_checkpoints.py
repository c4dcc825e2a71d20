"""FP8 base models on the CPU, fp32: a checkpoint in each published FP8 format (compressed-tensors FP8, FP8_DYNAMIC,
FP8_BLOCK; block-wise quant_method "fp8", experts one by one and fused) built by build_model gives the logits of HF
transformers + PEFT run on the same weights dequantized, with LoRA adapters on top, for every dense and MoE family;
online `--quantization fp8` gives those of HF + PEFT on the weights rounded through E4M3 per output row; a layer the
ignore list names loads its plain weight; quantization methods we do not serve are refused by name."""
from __future__ import annotations

import json

import pytest
import torch

from tests.fp32_bounds import assert_logits_close, forward_rtol
from tests.fp8_fixtures import (DENSE_ARCHS, FORMATS, MOE_ARCHS, block_fp8_config, build_fp8_source,
                                compressed_tensors_config, is_ignored, is_projection, with_quantization_config,
                                write_fp8_checkpoint, write_rounded_copy)
from tests.hf_fixtures import ADAPTERS, MOE_ADAPTERS, adapter_dir
from tests.moe_fixtures import PeftExpertAdapter, save_peft_expert_adapter
from tests.worker.distributed.tp_ranks import BLOCK_SIZE, forward_batch
from worker.arch import ArchConfig
from worker.config import KernelConfig
from worker.lora.adapter import read_adapter
from worker.lora.gpu_pool import GPULoRAPool
from worker.models.builder import build_model, lora_targets

CPU = torch.device("cpu")
MAX_RANK = 16
MAX_POSITIONS = 64
NUM_DECODE = 2
# (prompt length, adapter slot or None): base rows between adapter rows; every adapter of the model gets a row
ROWS = [(7, None), (19, 0), (5, 1), (12, 2), (9, None)]
EXPERT_ADAPTER = PeftExpertAdapter("experts-r4", 4, alpha=8, modules=("q_proj",))
# the fused expert layout is held to HF + PEFT at whole blocks below (at I = 192 its one block grid over gate and
# up together straddles their seam, which the loader refuses by name: test_fused_scales_straddling_gate_and_up_...)
CASES = [(arch, fmt) for arch in DENSE_ARCHS + MOE_ARCHS for fmt in FORMATS if fmt != "fp8-block-fused"]


def rtol(model_dir) -> float:
    """The fp32 summation-order bound of tests/fp32_bounds.py, relative to the largest logit: 22 sums (10 a layer,
    2 layers, + final norm and LM head) of at most 320 terms (the intermediate size) each, times eps: 8.4e-4 at
    the partial-block sizes (1.0e-3 at the whole-block ones, intermediate 384). The
    reference computes with exactly the weights our model should hold after dequantizing, so nothing but the order
    of fp32 sums may part the two; a wrong scale layout, a scale divided instead of multiplied, a block misplaced at
    a partial edge or a shard requantized with another's scale moves the logits by 1e-2 and more (see
    test_quantization_moves_the_reference_logits_beyond_the_bound)."""
    return forward_rtol(ArchConfig.from_dir(model_dir), max(n for n, _ in ROWS) + NUM_DECODE)


def _build_sources(root, archs, whole_blocks: bool = False) -> dict[str, dict]:
    out = {}
    for arch in archs:
        model_dir = build_fp8_source(arch, root, whole_blocks)
        specs = MOE_ADAPTERS if arch in MOE_ARCHS else ADAPTERS
        adapters = [adapter_dir(model_dir, spec.name) for spec in specs]
        if arch in MOE_ARCHS:
            adapters.append(root / f"{arch}-{EXPERT_ADAPTER.name}")
            save_peft_expert_adapter(model_dir, EXPERT_ADAPTER, adapters[-1], seed=400)
        out[arch] = {"model": model_dir, "adapters": adapters}
    return out


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, dict]:
    """arch -> {"model": the float32 source (sizes with partial 128-blocks), "adapters": directories, slot order}:
    the hf_fixtures adapters, and on MoE models also a PEFT adapter on the experts (target_parameters) and q_proj."""
    return _build_sources(tmp_path_factory.mktemp("fp8-sources"), DENSE_ARCHS + MOE_ARCHS)


@pytest.fixture(scope="module")
def whole_block_sources(tmp_path_factory) -> dict[str, dict]:
    """The MoE sources at sizes in whole 128-blocks (expert intermediate 128)."""
    return _build_sources(tmp_path_factory.mktemp("fp8-whole-sources"), MOE_ARCHS, whole_blocks=True)


def _prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Random prompt ids per row, and the NUM_DECODE tokens each row is fed after its prompt."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n, _ in ROWS]
    return prompts, [torch.randint(2, vocab, (NUM_DECODE,), generator=gen).tolist() for _ in ROWS]


@torch.inference_mode()
def our_logits(model, adapters: list) -> torch.Tensor:
    """[(1 + NUM_DECODE) * rows, vocab]: every row's prefill logits in one batch, then each decode step over every
    row (tests/worker/distributed/tp_ranks.forward_batch), the adapters packed into slots 0, 1, ..."""
    cfg = model.cfg
    pool = GPULoRAPool(model, len(adapters), MAX_RANK, torch.float32, CPU)
    for slot, path in enumerate(adapters):
        adapter = read_adapter(path.name, path, lora_targets(cfg), MAX_RANK, torch.float32)
        pool.start_load(slot, pool.layout.pack(adapter), adapter.spec.rank, path.name)
    shape = (len(ROWS) * 2, BLOCK_SIZE, model.num_kv_heads, cfg.head_dim)
    kv = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(cfg.num_layers)]
    prompts, decode = _prompts(cfg.vocab_size)
    slots = [-1 if a is None else a for _, a in ROWS]
    out = [model(forward_batch([(p, 0) for p in prompts], slots, pool.ranks_host), kv)]
    for step in range(NUM_DECODE):
        seqs = [([tokens[step]], len(p) + step) for p, tokens in zip(prompts, decode)]
        out.append(model(forward_batch(seqs, slots, pool.ranks_host), kv))
    return torch.cat(out)


@torch.inference_mode()
def hf_logits(model_dir, adapters: list) -> torch.Tensor:
    """What our_logits computes, from HF transformers (+ PEFT) on `model_dir`, each row alone along its prompt and
    decode tokens (teacher forcing)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    prompts, decode = _prompts(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    rows = []
    for (_, slot), prompt, tokens in zip(ROWS, prompts, decode):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if slot is not None:
            model = PeftModel.from_pretrained(model, adapters[slot])
        ids = torch.tensor([prompt + tokens])
        rows.append(model.eval()(ids).logits[0, len(prompt) - 1:].float())      # [1 + NUM_DECODE, vocab]
    return torch.stack(rows, dim=1).flatten(0, 1)     # step-major, as our_logits


def test_harness_matches_hf_on_the_unquantized_source(sources):
    """The comparison below, on the float32 sources themselves: adapters, batch and reference line up."""
    for arch in ("qwen3", "qwen2_moe"):
        source = sources[arch]
        model = build_model(source["model"], torch.float32, CPU, "auto", MAX_POSITIONS, KernelConfig())
        assert_logits_close(our_logits(model, source["adapters"]), hf_logits(source["model"], source["adapters"]),
                            rtol(source["model"]), f"{arch}, unquantized")


@pytest.mark.parametrize("arch", ["qwen3", "mixtral"])
def test_quantization_moves_the_reference_logits_beyond_the_bound(sources, tmp_path, arch):
    """Guards the comparisons: the dequantized reference parts from the float32 source by far more than the
    tolerance, so a loader that skipped or misapplied the scales could not pass."""
    source = sources[arch]
    checkpoint = write_fp8_checkpoint(source["model"], "fp8-block", tmp_path / "fp8")
    quantized = hf_logits(checkpoint.dequantized, source["adapters"])
    full = hf_logits(source["model"], source["adapters"])
    moved = ((quantized - full).abs().max() / full.abs().max()).item()
    assert moved > 10 * rtol(source["model"]), f"FP8 rounding moves the logits by only {moved:.1e}"


@pytest.mark.parametrize("arch, fmt", CASES)
def test_fp8_checkpoint_matches_hf_peft_on_the_dequantized_weights(sources, tmp_path, arch, fmt):
    source = sources[arch]
    checkpoint = write_fp8_checkpoint(source["model"], fmt, tmp_path / fmt)
    model = build_model(checkpoint.path, torch.float32, CPU, "auto", MAX_POSITIONS, KernelConfig())
    assert_logits_close(our_logits(model, source["adapters"]), hf_logits(checkpoint.dequantized, source["adapters"]),
                        rtol(checkpoint.path), f"{arch}, {fmt}")


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fused_fp8_experts_in_whole_blocks_match_hf_peft(whole_block_sources, tmp_path, arch):
    """The fused layout where no 128-block of gate_up straddles the gate/up seam (2I = 256): scale rows split into
    gate's and up's alike either way. (The partial-block cases above have I = 192: the fused grid's middle row of
    blocks covers gate rows 128-191 and up rows 0-63.)"""
    source = whole_block_sources[arch]
    checkpoint = write_fp8_checkpoint(source["model"], "fp8-block-fused", tmp_path / "fused")
    model = build_model(checkpoint.path, torch.float32, CPU, "auto", MAX_POSITIONS, KernelConfig())
    assert_logits_close(our_logits(model, source["adapters"]), hf_logits(checkpoint.dequantized, source["adapters"]),
                        rtol(checkpoint.path), f"{arch}, fp8-block-fused, whole blocks")


def test_fused_scales_straddling_gate_and_up_are_refused_by_name(sources, tmp_path):
    """I = 192: the fused grid's middle block row holds gate rows 128-191 and up rows 0-63 under one scale, which
    the gate-then-up block layout of the experts cannot hold; published checkpoints have I in whole blocks."""
    checkpoint = write_fp8_checkpoint(sources["qwen3_moe"]["model"], "fp8-block-fused", tmp_path / "fused")
    with pytest.raises(ValueError, match="multiple of 128"):
        build_model(checkpoint.path, torch.float32, CPU, "auto", MAX_POSITIONS, KernelConfig())


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_online_fp8_matches_hf_peft_on_weights_rounded_through_e4m3(sources, tmp_path, arch):
    """`--quantization fp8` on a float32 checkpoint: every projection of the decoder layers (experts included;
    routers, embeddings and lm_head not) quantized per output row with scale amax / 448 in float32."""
    source = sources[arch]
    rounded = write_rounded_copy(source["model"], tmp_path / "rounded")
    model = build_model(source["model"], torch.float32, CPU, "auto", MAX_POSITIONS, KernelConfig(),
                        quantization="fp8")
    assert_logits_close(our_logits(model, source["adapters"]), hf_logits(rounded, source["adapters"]),
                        rtol(source["model"]), f"{arch}, online fp8")


@pytest.mark.parametrize("arch, fmt, ignored", [
    ("llama", "ct-fp8-dynamic", ("model.layers.0.self_attn.o_proj", r"re:.*layers\.1\.mlp\.down_proj$")),
    ("qwen3", "ct-fp8", ("re:.*layers\\.1\\.self_attn\\.[qkv]_proj$",)),
    ("qwen3_moe", "fp8-block", ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
                                "model.layers.1.self_attn.v_proj", "model.layers.0.self_attn.o_proj")),
])
def test_layers_the_ignore_list_names_load_their_plain_weight(sources, tmp_path, arch, fmt, ignored):
    """Named in `ignore` / `modules_to_not_convert` (all shards of q/k/v together, as vLLM requires): stored as a
    plain bfloat16 `weight` without scales, served in full precision beside FP8 layers."""
    from safetensors import safe_open
    source = sources[arch]
    checkpoint = write_fp8_checkpoint(source["model"], fmt, tmp_path / fmt, extra_ignore=ignored)
    with safe_open(str(checkpoint.path / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        plain = [k.removesuffix(".weight") for k in keys if is_projection(k)
                 and is_ignored(k.removesuffix(".weight"), list(ignored))]
        assert len(plain) >= 2, plain
        for module in plain:
            assert f.get_slice(f"{module}.weight").get_dtype() == "BF16"
            assert not {f"{module}.weight_scale", f"{module}.weight_scale_inv", f"{module}.input_scale"} & keys
    model = build_model(checkpoint.path, torch.float32, CPU, "auto", MAX_POSITIONS, KernelConfig())
    assert_logits_close(our_logits(model, source["adapters"]), hf_logits(checkpoint.dequantized, source["adapters"]),
                        rtol(checkpoint.path), f"{arch}, {fmt}, ignoring {ignored}")


_INT8 = compressed_tensors_config("channel", ["lm_head"])
_INT8["format"] = "int-quantized"
_INT8["config_groups"]["group_0"]["weights"]["type"] = "int"
_INT8["config_groups"]["group_0"]["input_activations"]["type"] = "int"


@pytest.mark.parametrize("quantization_config, words", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm"}, "awq"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}, "gptq"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
      "bnb_4bit_compute_dtype": "bfloat16"}, "bitsandbytes"),
    ({**block_fp8_config(["lm_head"]), "weight_block_size": [64, 64]}, "fp8"),
    (_INT8, "int-quantized"),
], ids=["awq", "gptq", "bitsandbytes", "fp8-block-64", "compressed-tensors-int8"])
def test_unsupported_quantization_is_refused_by_name(sources, tmp_path, quantization_config, words):
    model_dir = with_quantization_config(sources["llama"]["model"], tmp_path / "model", quantization_config)
    with pytest.raises(ValueError, match=words):
        build_model(model_dir, torch.float32, CPU, "auto", MAX_POSITIONS, KernelConfig())
