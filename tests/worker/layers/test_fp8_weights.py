"""FP8 weights (layers/weights/fp8.py, format.py): quantization against E4M3's rounding bound, which scheme each
projection gets from each quantization_config (ignore lists matched as compressed-tensors and transformers match
them), the formats refused by name, and each tensor-parallel rank's share of an FP8 weight and its scales equal to
the rows and columns of the whole model's.

E4M3 keeps 3 mantissa bits: a value in the normal range (|v| >= 2^-6) rounds to within 2^-4 of itself relatively,
a subnormal one to within half the subnormal step, 2^-10; with v = w / scale, the dequantized weight is within
scale * max(2^-4 |v|, 2^-10) of w. (The checkpoint fixtures of tests/fp8_fixtures.py hold whole models to HF + PEFT.)
"""
from __future__ import annotations

import json

import pytest
import torch

from worker.config import KernelConfig
from worker.distributed.tensor_parallel import TensorParallel
from worker.layers.weights.format import read_weight_format
from worker.layers.weights.fp8 import FP8, FP8_MAX, Fp8Experts, Fp8Linear, dequantize, quantize
from worker.layers.weights.unquantized import UnquantizedExperts, UnquantizedLinear
from worker.models.builder import build_model

CPU = torch.device("cpu")


def _rounding_bound(w: torch.Tensor, scale_full: torch.Tensor) -> torch.Tensor:
    v = w.abs() / scale_full
    return scale_full * torch.maximum(v * 2.0 ** -4, torch.full_like(v, 2.0 ** -10))


@pytest.mark.parametrize("weights", ["tensor", "channel", "block"])
@pytest.mark.parametrize("shape", [(256, 384), (200, 320), (7, 129)])
def test_quantize_is_within_e4m3_rounding_and_scales_are_amax_over_448(weights, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen) * torch.logspace(-3, 1, shape[0])[:, None]   # rows at many scales
    w[1] = 0.0                                                                           # an all-zero row
    block = (128, 128) if weights == "block" else None
    q, scale = quantize(w, weights, block)
    assert q.dtype == FP8 and not torch.isnan(q.float()).any()
    rows, cols = shape
    if weights == "tensor":
        assert scale.shape == (1,) and scale.item() == pytest.approx(w.abs().max().item() / FP8_MAX, rel=1e-6)
        full = scale.expand(rows)[:, None]
        back = q.float() * scale
    elif weights == "channel":
        assert scale.shape == (rows,)
        nonzero = w.abs().amax(1) > 0
        torch.testing.assert_close(scale[nonzero], w.abs().amax(1)[nonzero] / FP8_MAX, rtol=1e-6, atol=0)
        full = scale[:, None]
        back = dequantize(q, scale)
    else:
        assert scale.shape == (-(-rows // 128), -(-cols // 128))
        full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :cols]
        back = dequantize(q, scale, block)
    assert (q.float().abs() <= FP8_MAX).all()
    assert ((back - w).abs() <= _rounding_bound(w, full) * (1 + 1e-6)).all()
    assert (back[1] == 0).all()


def test_quantize_clamps_before_the_cast():
    """The largest element lands on 448 exactly, never past it (CUDA would cast an overflow to NaN)."""
    w = torch.tensor([[1.0, -3.0, 2.9999]])
    q, scale = quantize(w, "channel")
    assert q.float().abs().max().item() == FP8_MAX and q.float()[0, 1].item() == -FP8_MAX


# formats --------------------------------------------------------------------------------------------------------

def _ct(strategy="channel", acts="token", dynamic=True, targets=("Linear",), ignore=("lm_head",), **weights):
    w = {"type": "float", "num_bits": 8, "strategy": strategy, "symmetric": True, "dynamic": False, **weights}
    a = None if acts is None else {"type": "float", "num_bits": 8, "strategy": acts, "symmetric": True,
                                   "dynamic": dynamic}
    return {"quantization_config": {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": list(targets), "weights": w, "input_activations": a,
                                      "output_activations": None, "format": None}},
        "ignore": list(ignore), "sparsity_config": {}, "transform_config": {}}}


def _scheme(fmt, *names, router=False):
    return fmt.linear(list(names), router)


def test_compressed_tensors_formats_give_their_specs():
    attn = [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"]
    dynamic = read_weight_format(_ct())
    s = _scheme(dynamic, *attn)
    assert isinstance(s, Fp8Linear) and s.spec.weights == "channel" and not s.spec.static_activations
    static = _scheme(read_weight_format(_ct("tensor", "tensor", dynamic=False)), *attn)
    assert static.spec.weights == "tensor" and static.spec.static_activations
    assert static.spec.checkpoint_tensors() == ("weight", "weight_scale", "input_scale")
    block = _scheme(read_weight_format(_ct("block", "group", block_structure=[128, 128], group_size=128)), *attn)
    assert block.spec.weights == "block" and block.spec.block == (128, 128)
    weight_only = _scheme(read_weight_format(_ct(acts=None)), *attn)
    assert weight_only.spec.weights == "channel" and not weight_only.spec.static_activations


def test_compressed_tensors_ignore_and_targets_match_as_compressed_tensors_does():
    fmt = read_weight_format(_ct(ignore=("lm_head", "re:.*mlp.gate$", "model.layers.1.self_attn.o_proj")))
    assert isinstance(_scheme(fmt, "model.layers.0.mlp.gate"), UnquantizedLinear)             # the router
    assert isinstance(_scheme(fmt, "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"), Fp8Linear)
    assert isinstance(_scheme(fmt, "model.layers.1.self_attn.o_proj"), UnquantizedLinear)     # exact name
    assert isinstance(_scheme(fmt, "model.layers.11.self_attn.o_proj"), Fp8Linear)
    assert isinstance(fmt.experts("model.layers.0.mlp.experts", ("gate_proj", "up_proj", "down_proj")), Fp8Experts)
    only_mlp = read_weight_format(_ct(targets=("re:.*mlp\\..*_proj$",)))
    assert isinstance(_scheme(only_mlp, "model.layers.0.self_attn.o_proj"), UnquantizedLinear)
    assert isinstance(_scheme(only_mlp, "model.layers.0.mlp.down_proj"), Fp8Linear)


def test_fused_slices_that_disagree_are_refused():
    fmt = read_weight_format(_ct(ignore=("model.layers.0.self_attn.k_proj",)))
    with pytest.raises(ValueError, match="fused into one projection"):
        _scheme(fmt, *[f"model.layers.0.self_attn.{p}_proj" for p in "qkv"])


def test_block_fp8_modules_to_not_convert_match_as_transformers_does():
    fmt = read_weight_format({"quantization_config": {
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
        "modules_to_not_convert": ["lm_head", "model.layers.0.mlp.gate", "layers.1", "shared_expert_gate"]}})
    s = _scheme(fmt, "model.layers.0.mlp.down_proj")
    assert isinstance(s, Fp8Linear) and s.spec.scale_name == "weight_scale_inv" and s.spec.block == (128, 128)
    assert isinstance(_scheme(fmt, "model.layers.0.mlp.gate", router=True), UnquantizedLinear)
    assert isinstance(_scheme(fmt, "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"), Fp8Linear)
    assert isinstance(_scheme(fmt, "model.layers.1.self_attn.o_proj"), UnquantizedLinear)    # "layers.1" ...
    assert isinstance(_scheme(fmt, "model.layers.11.self_attn.o_proj"), Fp8Linear)          # ... not layers.11
    assert isinstance(_scheme(fmt, "model.layers.3.mlp.shared_expert_gate"), UnquantizedLinear)   # a suffix
    per_tensor = read_weight_format({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}})
    s = _scheme(per_tensor, "model.layers.0.mlp.down_proj")
    assert s.spec.weights == "tensor" and s.spec.static_activations


def test_online_fp8_quantizes_projections_and_experts_but_not_routers():
    fmt = read_weight_format({}, "fp8")
    s = _scheme(fmt, "model.layers.0.self_attn.o_proj")
    assert isinstance(s, Fp8Linear) and s.spec.weights == "channel" and not s.spec.serialized
    assert s.spec.checkpoint_tensors() == ("weight",)
    assert isinstance(_scheme(fmt, "model.layers.0.mlp.gate", router=True), UnquantizedLinear)
    assert isinstance(fmt.experts("model.layers.0.mlp.experts", ("gate_proj", "up_proj", "down_proj")), Fp8Experts)
    assert isinstance(read_weight_format({}).experts("x", ("w1", "w3", "w2")), UnquantizedExperts)


@pytest.mark.parametrize("config, quantization, named", [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, None, "awq"),
    ({"quantization_config": {"quant_method": "gptq", "bits": 4}}, None, "gptq"),
    ({"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}, None, "bitsandbytes"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, None, "[64, 64]"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                              "weight_block_size": [128, 128]}}, None, "static"),
    ({"quantization_config": {**_ct()["quantization_config"], "format": "int-quantized"}}, None, "int-quantized"),
    (_ct("group", group_size=128), None, "strategy 'group'"),
    (_ct("block", block_structure=[64, 64]), None, "block_structure"),
    (_ct(num_bits=4), None, "num_bits 4"),
    ({}, "awq", "awq"),
    (_ct(), "fp8", "does not match"),
    ({}, "compressed-tensors", "needs a checkpoint"),
])
def test_unsupported_formats_stop_the_build_naming_the_method(config, quantization, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")) as e:
        read_weight_format(config, quantization)
    assert "supported" in str(e.value) or "match" in str(e.value) or "needs" in str(e.value)


# tensor parallelism ---------------------------------------------------------------------------------------------

def _model_dir(tmp_path, quantization_config: dict | None, moe: bool = False):
    """A Llama (or Qwen3-MoE) config whose shards align with 128-blocks at 2 ranks: 2 heads of 128, 2 KV heads,
    intermediate 512 (256 a rank), experts' 256 (128 a rank)."""
    cfg = {"architectures": ["Qwen3MoeForCausalLM" if moe else "LlamaForCausalLM"], "vocab_size": 64,
           "hidden_size": 256, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
           "head_dim": 128, "intermediate_size": 512, "rms_norm_eps": 1e-6, "max_position_embeddings": 64,
           "torch_dtype": "float32", "tie_word_embeddings": False}
    if moe:
        cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True)
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


BLOCK_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128],
             "modules_to_not_convert": ["lm_head", "mlp.gate"]}


@pytest.mark.parametrize("config, quantization", [(BLOCK_FP8, None), (None, "fp8")], ids=["block", "online"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_each_rank_holds_the_rows_and_columns_of_the_whole_fp8_weight(tmp_path, config, quantization, moe):
    """--load-format dummy draws the same whole tensors at every world size and quantizes them whole, so each
    rank's dequantized share is exactly the corresponding part of the unsharded model's."""
    path = _model_dir(tmp_path, config, moe)
    whole = build_model(path, torch.float32, CPU, "dummy", 64, KernelConfig(), quantization=quantization)
    ranks = [build_model(path, torch.float32, CPU, "dummy", 64, KernelConfig(), tp=TensorParallel(r, 2),
                         quantization=quantization) for r in range(2)]
    attn = whole.layers[0].self_attn
    assert isinstance(attn.qkv_proj.scheme, Fp8Linear) and attn.qkv_proj.weight.dtype == torch.float32
    for r, model in enumerate(ranks):
        a = model.layers[0].self_attn
        q, kv = 128, 128                                     # each rank: one query head and one KV head
        rows = torch.cat([torch.arange(r * q, (r + 1) * q), 256 + torch.arange(r * kv, (r + 1) * kv),
                          512 + torch.arange(r * kv, (r + 1) * kv)])
        assert torch.equal(a.qkv_proj.weight, attn.qkv_proj.weight[rows])
        assert torch.equal(a.o_proj.weight, attn.o_proj.weight[:, r * 128:(r + 1) * 128])
        mlp, whole_mlp = model.layers[0].mlp, whole.layers[0].mlp
        if moe:
            i = 128
            gate_up = whole_mlp.experts.gate_up_proj
            expected = torch.cat([gate_up[:, r * i:(r + 1) * i], gate_up[:, 256 + r * i:256 + (r + 1) * i]], 1)
            assert torch.equal(mlp.experts.gate_up_proj, expected)
            assert torch.equal(mlp.experts.down_proj, whole_mlp.experts.down_proj[:, :, r * i:(r + 1) * i])
            assert isinstance(mlp.gate.scheme, UnquantizedLinear)
        else:
            i = 256
            expected = torch.cat([whole_mlp.gate_up_proj.weight[r * i:(r + 1) * i],
                                  whole_mlp.gate_up_proj.weight[512 + r * i:512 + (r + 1) * i]])
            assert torch.equal(mlp.gate_up_proj.weight, expected)
            assert torch.equal(mlp.down_proj.weight, whole_mlp.down_proj.weight[:, r * i:(r + 1) * i])


def test_a_share_that_does_not_start_on_a_block_is_refused(tmp_path):
    path = _model_dir(tmp_path, BLOCK_FP8)
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 320                    # 160 a rank: rank 1's share starts inside a block
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="start on a block of 128"):
        build_model(path, torch.float32, CPU, "dummy", 64, KernelConfig(), tp=TensorParallel(1, 2))
