"""The FP8 checkpoint writers of tests/fp8_fixtures.py held to the tools that define the formats: compressed-tensors
quantizes to the same scales and FP8 values, dumps the same quantization_config and decompresses the written
checkpoints to the dequantized copies; transformers' FineGrainedFP8 dequantizes the block-wise checkpoints to them and
allocates the fused-expert tensors with the names, shapes and dtypes written.

transformers 5.24 cannot serve as the reader everywhere: its FP8 dequantizer takes the block size from the scale grid
(rows // scale_rows), so it refuses or misreads partial 128-blocks (checked here on whole-block sizes only), and its
compressed-tensors dequantizer does not expand block scales of merged experts (FP8_BLOCK MoE raises at load)."""
from __future__ import annotations

import json

import pytest
import torch

from tests.fp8_fixtures import (CT_STRATEGY, E4M3_MAX, MOE_ARCHS, build_fp8_source, compressed_tensors_config,
                                default_ignore, dequantize_fp8, expand_scale, quantize_fp8, round_through_e4m3,
                                write_fp8_checkpoint)

PRESETS = {"tensor": "FP8", "channel": "FP8_DYNAMIC", "block": "FP8_BLOCK"}


def _weight() -> torch.Tensor:
    """[320, 192] bf16: partial last blocks both ways, one all-zero block, one all-zero row, a large outlier."""
    w = torch.randn(320, 192, generator=torch.Generator().manual_seed(0)).bfloat16()
    w[:128, :128] = 0
    w[300] = 0
    w[200, 150] = 900.0
    return w


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_scales_and_values_are_what_compressed_tensors_computes(strategy):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    args = preset_name_to_scheme(PRESETS[strategy], ["Linear"]).weights
    w = _weight()
    q, scale = quantize_fp8(w, strategy, torch.bfloat16)
    if strategy == "block":
        padded = torch.nn.functional.pad(w, (0, 64, 0, 64)).reshape(3, 128, 2, 128)
        lo, hi = padded.amin(dim=(1, 3)), padded.amax(dim=(1, 3))
    else:
        dims = (0, 1) if strategy == "tensor" else (1,)
        lo, hi = w.amin(dim=dims, keepdim=True), w.amax(dim=dims, keepdim=True)
    expected_scale, _ = calculate_qparams(lo.reshape(scale.shape), hi.reshape(scale.shape), args)
    assert expected_scale.dtype == scale.dtype == torch.bfloat16
    assert torch.equal(expected_scale, scale)
    expected_q = quantize(w, scale, torch.zeros_like(scale), args, dtype=torch.float8_e4m3fn)
    assert torch.equal(expected_q.view(torch.uint8), q.view(torch.uint8))
    # compressed-tensors dequantizes in the scale's dtype; ours in float32 rounds to the same bf16
    assert torch.equal(dequantize(q, scale, args=args), dequantize_fp8(q, scale).bfloat16())


def test_block_scales_cover_partial_blocks_and_zero_blocks():
    w = _weight().float()
    q, scale = quantize_fp8(w, "block", torch.float32)
    assert scale.shape == (3, 2) and scale[0, 0] == torch.finfo(torch.float32).eps
    assert scale[2, 1] == w[256:, 128:].abs().max() / E4M3_MAX          # the 64×64 corner block
    assert q.float().abs().max() == E4M3_MAX
    err = (dequantize_fp8(q, scale) - w).abs()
    # at most half an E4M3 step: the step is 32 between 256 and 448 (3 mantissa bits), so 16 scales
    assert (err <= expand_scale(scale, w.shape) * 16 * (1 + 1e-6)).all()


def test_round_through_e4m3_is_per_output_row():
    w = _weight().float()
    rounded = round_through_e4m3(w)
    assert torch.equal(rounded[300], torch.zeros(192))
    for row in (5, 200):
        q, scale = quantize_fp8(w[row:row + 1], "tensor", torch.float32)
        assert torch.equal(rounded[row], dequantize_fp8(q, scale)[0])


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_quantization_config_is_what_compressed_tensors_dumps(strategy):
    """ModelCompressor.update_config: the QuantizationConfig's dump beside version, quant_method, sparsity_config,
    transform_config."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    ignore = default_ignore("qwen2_moe")
    dumped = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(PRESETS[strategy], ["Linear"])},
                                ignore=ignore, format="float-quantized",
                                quantization_status="compressed").model_dump(exclude=["quant_method"])
    expected = {"version": ct.__version__, "quant_method": "compressed-tensors", "sparsity_config": {},
                "transform_config": {}, **dumped}
    assert json.dumps(compressed_tensors_config(strategy, ignore), sort_keys=True) == json.dumps(expected,
                                                                                                 sort_keys=True)


def _assert_state_equal(model, reference_dir, what: str) -> None:
    from transformers import AutoModelForCausalLM
    expected = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).state_dict()
    got = model.state_dict()
    for key, tensor in expected.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], tensor), f"{what}: {key}"


@pytest.mark.parametrize("arch, fmt", [(arch, fmt) for arch in ("llama", "qwen3") for fmt in CT_STRATEGY]
                         + [("qwen3_moe", "ct-fp8"), ("qwen2_moe", "ct-fp8-dynamic")])
def test_compressed_tensors_decompresses_the_checkpoint_to_the_dequantized_copy(tmp_path, arch, fmt):
    """Partial blocks included (sizes of fp8_fixtures.PARTIAL_*). compressed-tensors decompresses the Linear
    modules; transformers 5 holds experts fused, not as Linear modules, and dequantizes them itself."""
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig
    checkpoint = write_fp8_checkpoint(build_fp8_source(arch, tmp_path), fmt, tmp_path / fmt)
    model = AutoModelForCausalLM.from_pretrained(checkpoint.path, dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=False))
    model.hf_quantizer.compressor.decompress_model(model)
    _assert_state_equal(model, checkpoint.dequantized, f"{arch}, {fmt}")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "mixtral", "qwen2_moe"])
def test_transformers_fp8_dequantizes_the_block_checkpoint_to_the_dequantized_copy(tmp_path, arch):
    """Whole-block sizes (fp8_fixtures.WHOLE_*): transformers reads the block size off the scale grid."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config
    checkpoint = write_fp8_checkpoint(build_fp8_source(arch, tmp_path, whole_blocks=True), "fp8-block",
                                      tmp_path / "fp8-block")
    model = AutoModelForCausalLM.from_pretrained(checkpoint.path, dtype=torch.float32,
                                                 quantization_config=FineGrainedFP8Config(dequantize=True))
    _assert_state_equal(model, checkpoint.dequantized, f"{arch}, fp8-block")


@pytest.mark.parametrize("whole_blocks", [False, True])
@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_fused_experts_have_the_layout_of_transformers_fp8_experts(tmp_path, arch, whole_blocks):
    """transformers' FP8Experts (integrations/finegrained_fp8.py) allocates gate_up_proj [E, 2I, H] and
    down_proj [E, H, I] in float8_e4m3fn with float32 gate_up_proj_scale_inv [E, ceil(2I/128), ceil(H/128)] and
    down_proj_scale_inv [E, ceil(H/128), ceil(I/128)]: the written tensors have those names, shapes and dtypes,
    and (whole blocks) its dequantizer reads each expert as the dequantized copy holds it."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from transformers.integrations.finegrained_fp8 import FP8Experts, Fp8Dequantize
    source = build_fp8_source(arch, tmp_path, whole_blocks=whole_blocks)
    checkpoint = write_fp8_checkpoint(source, "fp8-block-fused", tmp_path / "fused")
    config = AutoConfig.from_pretrained(checkpoint.path)
    expected = {name: (tuple(p.shape), p.dtype)
                for name, p in FP8Experts(config, block_size=(128, 128)).named_parameters()}
    tensors, reference = (load_file(str(d / "model.safetensors")) for d in (checkpoint.path, checkpoint.dequantized))
    sparse = [i for i in range(config.num_hidden_layers) if i not in getattr(config, "mlp_only_layers", [])]
    for layer in sparse:
        prefix = f"model.layers.{layer}.mlp.experts."
        written = {k.removeprefix(prefix): (tuple(t.shape), t.dtype) for k, t in tensors.items()
                   if k.startswith(prefix)}
        assert written == expected
        if whole_blocks:
            dequantize = Fp8Dequantize(None)._dequantize_one
            for name in ("gate_up_proj", "down_proj"):
                got = dequantize(tensors[prefix + name], tensors[f"{prefix}{name}_scale_inv"], torch.float32)
                assert torch.equal(got, reference[prefix + name]), f"layer {layer} {name}"
