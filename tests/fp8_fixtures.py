"""Tiny FP8 checkpoints in the published formats, written from the tiny models of tests/hf_fixtures.py, each with a
dequantized float32 copy of itself (a plain HF checkpoint: the reference HF + PEFT run on).

Formats (shared/background/fp8-notes.md §1-2):
  ct-fp8          compressed-tensors "float-quantized", preset FP8: `weight_scale` [1] and static `input_scale` [1]
  ct-fp8-dynamic  compressed-tensors, preset FP8_DYNAMIC: `weight_scale` [out, 1], no input scale
  ct-fp8-block    compressed-tensors, preset FP8_BLOCK: `weight_scale` [ceil(out/128), ceil(in/128)]
  fp8-block       quant_method "fp8" (DeepSeek-V3 / Qwen3-FP8): float32 `weight_scale_inv`
                  [ceil(out/128), ceil(in/128)], experts stored one by one
  fp8-block-fused the same with the experts fused as transformers 5 holds them (integrations/finegrained_fp8.py
                  FP8Experts): `mlp.experts.gate_up_proj` [E, 2I, H] + `gate_up_proj_scale_inv`
                  [E, ceil(2I/128), ceil(H/128)], `mlp.experts.down_proj` [E, H, I] + `down_proj_scale_inv`

The compressed-tensors checkpoints are what a bfloat16 model quantized by compressed-tensors looks like: every
unquantized tensor in bfloat16, scales in the weight's dtype (bfloat16), the arithmetic in that dtype. The "fp8"
checkpoints keep unquantized tensors in bfloat16 and float32 scales, as DeepSeek-V3 publishes them.
"""
from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.hf_fixtures import build_hf_model, build_hf_moe_model

E4M3_MAX = 448.0              # torch.finfo(torch.float8_e4m3fn).max
BLOCK = 128                   # weight_block_size / block_structure [128, 128]
COMPRESSED_TENSORS_VERSION = "0.20.1"

DENSE_ARCHS = ("llama", "qwen2", "qwen3")
MOE_ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")
FORMATS = ("ct-fp8", "ct-fp8-dynamic", "ct-fp8-block", "fp8-block", "fp8-block-fused")
CT_STRATEGY = {"ct-fp8": "tensor", "ct-fp8-dynamic": "channel", "ct-fp8-block": "block"}

# Sizes with a partial last 128-block: intermediate 320 = 2.5 blocks, Qwen3's head_dim 48 (q 192 rows, k/v 96),
# expert intermediate 192 = 1.5 blocks (the fused gate_up's middle block spans the gate/up seam)
PARTIAL_DENSE = {"hidden_size": 256, "intermediate_size": 320, "head_dim": 48}
PARTIAL_MOE = {"hidden_size": 256, "moe_intermediate_size": 192, "intermediate_size": 320,
               "shared_expert_intermediate_size": 320, "head_dim": 48}
# Sizes in whole 128-blocks: transformers' FP8 dequantizer derives the block from the scale grid
# (rows // scale_rows), which is right only when every dimension is a multiple of 128
WHOLE_DENSE = {"hidden_size": 256, "intermediate_size": 384, "head_dim": 64}
WHOLE_MOE = {"hidden_size": 256, "moe_intermediate_size": 128, "intermediate_size": 384,
             "shared_expert_intermediate_size": 256, "head_dim": 64}

# a projection's weight in a decoder layer: what the formats quantize (routers, norms, embeddings, lm_head not)
_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(shared_expert\.)?(gate|up|down)_proj"
                     r"|mlp\.experts\.\d+\.(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight")
_EXPERT = re.compile(r"(model\.layers\.\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_GATE_UP_DOWN = {"gate_proj": 0, "up_proj": 1, "down_proj": 2, "w1": 0, "w3": 1, "w2": 2}


@dataclass(frozen=True)
class Fp8Checkpoint:
    path: Path           # the FP8 checkpoint: config.json with its quantization_config, model.safetensors
    dequantized: Path    # the same model with every FP8 weight dequantized, float32 (fp8 as float × scale)
    source: Path         # the float32 model it was quantized from; its adapters lie beside it (adapter_dir)


def build_fp8_source(arch: str, root: Path, whole_blocks: bool = False) -> Path:
    """The tiny float32 HF model `arch` (dense or MoE) at sizes that make 128-blocks matter (PARTIAL_*, or WHOLE_*
    when `whole_blocks`), with the hf_fixtures adapters beside it."""
    if arch in MOE_ARCHS:
        return build_hf_moe_model(arch, root, **(WHOLE_MOE if whole_blocks else PARTIAL_MOE))
    dims = dict(WHOLE_DENSE if whole_blocks else PARTIAL_DENSE)
    if arch != "qwen3":
        dims.pop("head_dim")     # llama, qwen2: head_dim = hidden_size / num_attention_heads = 64
    return build_hf_model(arch, root, **dims)


# --- quantization, as compressed-tensors and the DeepSeek / Qwen FP8 tools do it ---------------------------------

def quantize_fp8(w: torch.Tensor, strategy: str, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q [out, in] float8_e4m3fn, scale in `scale_dtype`) with w ≈ q × scale:
    scale = amax / 448 over the whole tensor ("tensor": [1]), each output row ("channel": [out, 1]) or each
    128×128 block ("block": [ceil(out/128), ceil(in/128)], w zero-padded to whole blocks, the padding dropped
    after); a zero scale becomes the scale dtype's eps; q = clamp(w / scale, ±448) rounded to E4M3. The arithmetic
    runs in `scale_dtype`, the weight's own dtype in compressed-tensors."""
    w = w.to(scale_dtype)
    if strategy == "tensor":
        amax = w.abs().amax().reshape(1)
    elif strategy == "channel":
        amax = w.abs().amax(dim=1, keepdim=True)
    elif strategy == "block":
        amax = _pad_to_blocks(w).abs().amax(dim=(1, 3))
    else:
        raise ValueError(f"unknown strategy {strategy!r}")
    scale = amax / torch.tensor(E4M3_MAX, dtype=scale_dtype)
    scale = torch.where(scale == 0, torch.tensor(torch.finfo(scale_dtype).eps, dtype=scale_dtype), scale)
    q = (w / expand_scale(scale, w.shape)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """W = q.float() × scale (per tensor, per row or per 128×128 block, told apart by the scale's shape), fp32."""
    return q.float() * expand_scale(scale.float(), q.shape)


def expand_scale(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A [1], [out, 1] or [ceil(out/128), ceil(in/128)] scale broadcast to the weight's [out, in]."""
    rows, cols = shape
    if scale.numel() == 1 or scale.shape == (rows, 1):
        return scale.reshape(-1, 1).expand(rows, cols)
    assert scale.shape == (-(-rows // BLOCK), -(-cols // BLOCK)), (tuple(scale.shape), tuple(shape))
    return scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]


def round_through_e4m3(w: torch.Tensor) -> torch.Tensor:
    """What online `--quantization fp8` computes with on the CPU: w [out, in] quantized per output row in float32
    (scale = amax / 448) and dequantized."""
    return dequantize_fp8(*quantize_fp8(w.float(), "channel", torch.float32))


def _pad_to_blocks(w: torch.Tensor) -> torch.Tensor:
    """w [out, in] zero-padded to whole 128-blocks, viewed [out/128, 128, in/128, 128]."""
    rows, cols = w.shape
    pad_rows, pad_cols = -rows % BLOCK, -cols % BLOCK
    padded = torch.nn.functional.pad(w, (0, pad_cols, 0, pad_rows))
    return padded.reshape((rows + pad_rows) // BLOCK, BLOCK, (cols + pad_cols) // BLOCK, BLOCK)


# --- quantization_config as the writers dump it -------------------------------------------------------------------

def compressed_tensors_config(strategy: str, ignore: list[str]) -> dict:
    """The `quantization_config` a compressed-tensors writer dumps (ModelCompressor.update_config: the
    QuantizationConfig's model_dump plus quant_method, version, sparsity_config, transform_config) for the preset of
    `strategy`: FP8 ("tensor"), FP8_DYNAMIC ("channel") or FP8_BLOCK ("block"), targets ["Linear"]."""
    weights = {"dynamic": False, "group_size": None, "num_bits": 8, "strategy": strategy, "symmetric": True,
               "type": "float"}
    activations = {"dynamic": True, "group_size": None, "num_bits": 8, "strategy": "token", "symmetric": True,
                   "type": "float"}
    if strategy == "tensor":
        activations.update(dynamic=False, strategy="tensor", observer="static_minmax")
    elif strategy == "block":
        weights["block_structure"] = [BLOCK, BLOCK]
        activations.update(strategy="group", group_size=BLOCK)
    group = {"format": None, "input_activations": activations, "output_activations": None, "targets": ["Linear"],
             "weights": weights}
    return {"config_groups": {"group_0": group}, "format": "float-quantized", "global_compression_ratio": None,
            "ignore": ignore, "kv_cache_scheme": None, "moe_sparsity_config": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
            "transform_config": {}, "version": COMPRESSED_TENSORS_VERSION}


def block_fp8_config(modules_to_not_convert: list[str]) -> dict:
    """The `quantization_config` of a DeepSeek-V3 / Qwen3-FP8 checkpoint."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "modules_to_not_convert": modules_to_not_convert,
            "quant_method": "fp8", "weight_block_size": [BLOCK, BLOCK]}


def default_ignore(arch: str) -> list[str]:
    """compressed-tensors `ignore`: lm_head, and on MoE models the routers (and Qwen2-MoE's shared-expert gate),
    anchored regexes as llm-compressor's MoE recipes write them."""
    if arch not in MOE_ARCHS:
        return ["lm_head"]
    router = "re:.*block_sparse_moe.gate$" if arch == "mixtral" else "re:.*mlp.gate$"
    return ["lm_head", router] + (["re:.*mlp.shared_expert_gate$"] if arch == "qwen2_moe" else [])


def default_not_converted(arch: str, num_layers: int, fused: bool = False) -> list[str]:
    """modules_to_not_convert as Qwen3-30B-A3B-FP8 writes it: lm_head, then per layer the norms and the router
    (and Qwen2-MoE's shared-expert gate); Mixtral's router is block_sparse_moe.gate, mlp.gate when `fused`."""
    names = ["lm_head"]
    block = "block_sparse_moe" if arch == "mixtral" and not fused else "mlp"
    for i in range(num_layers):
        names.append(f"model.layers.{i}.input_layernorm")
        if arch in MOE_ARCHS:
            names.append(f"model.layers.{i}.{block}.gate")
        if arch == "qwen2_moe":
            names.append(f"model.layers.{i}.mlp.shared_expert_gate")
        names.append(f"model.layers.{i}.post_attention_layernorm")
    return names


def is_projection(key: str) -> bool:
    """Whether the checkpoint tensor `key` is the weight of a projection in a decoder layer, what the formats
    quantize unless ignored (routers, norms, embeddings and lm_head are not projections here)."""
    return _LINEAR.fullmatch(key) is not None


def is_ignored(module: str, ignore: list[str]) -> bool:
    """compressed-tensors' rule: an exact module name, or a `re:` pattern applied with re.match."""
    return any(re.match(entry[3:], module) if entry.startswith("re:") else entry == module for entry in ignore)


# --- writers ------------------------------------------------------------------------------------------------------

def write_fp8_checkpoint(source: Path, fmt: str, out: Path, extra_ignore: tuple[str, ...] = ()) -> Fp8Checkpoint:
    """The model in `source` written in `fmt` (FORMATS) to `out`, and its dequantized copy to `out`-dequantized.
    `extra_ignore`: more module names (or `re:` patterns, compressed-tensors only) kept unquantized, stored as a
    plain `weight` in bfloat16."""
    config = json.loads((source / "config.json").read_text())
    arch = config["model_type"]
    fused = fmt == "fp8-block-fused"
    tensors = _fused_tensors(source) if fused else load_file(str(source / "model.safetensors"))
    if fmt in CT_STRATEGY:
        ignore = default_ignore(arch) + list(extra_ignore)
        quant_config = compressed_tensors_config(CT_STRATEGY[fmt], ignore)
    else:
        ignore = default_not_converted(arch, config["num_hidden_layers"], fused) + list(extra_ignore)
        quant_config = block_fp8_config(ignore)
    stored, reference = {}, {}
    for key, w in tensors.items():
        module = key.removesuffix(".weight")
        if is_projection(key) and not is_ignored(module, ignore):
            stored.update(_quantized(module, w, fmt))
            reference[key] = dequantize_fp8(stored[key], stored[f"{module}.{_scale_name(fmt)}"])
        elif fused and key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            q, scale = zip(*(quantize_fp8(w_e, "block", torch.float32) for w_e in w))   # per expert, block-wise
            stored[key], stored[f"{key}_scale_inv"] = torch.stack(q), torch.stack(scale)
            reference[key] = torch.stack([dequantize_fp8(a, b) for a, b in zip(q, scale)])
        else:
            stored[key] = w.to(torch.bfloat16)
            reference[key] = stored[key].float()
    _write(out, {**config, "dtype": "bfloat16", "quantization_config": quant_config}, stored)
    dequantized = out.parent / f"{out.name}-dequantized"
    _write(dequantized, {**config, "dtype": "float32"}, reference)
    return Fp8Checkpoint(out, dequantized, source)


def write_rounded_copy(source: Path, out: Path, skip: tuple[str, ...] = ()) -> Path:
    """The float32 model in `source` with every projection weight of the decoder layers (the experts included, not
    the routers, embeddings or lm_head) rounded through E4M3 per output row (round_through_e4m3): what online
    `--quantization fp8` computes with on the CPU. `skip`: module names left as they are."""
    config = json.loads((source / "config.json").read_text())
    tensors = load_file(str(source / "model.safetensors"))
    rounded = {key: round_through_e4m3(w) if is_projection(key) and key.removesuffix(".weight") not in skip
               else w for key, w in tensors.items()}
    _write(out, config, rounded)
    return out


def _quantized(module: str, w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one projection in `fmt`."""
    if fmt in CT_STRATEGY:
        q, scale = quantize_fp8(w.to(torch.bfloat16), CT_STRATEGY[fmt], torch.bfloat16)
        out = {f"{module}.weight": q, f"{module}.weight_scale": scale}
        if fmt == "ct-fp8":       # static per-tensor activation scale, as calibration leaves it: amax / 448
            out[f"{module}.input_scale"] = torch.tensor([4.0 / E4M3_MAX], dtype=torch.bfloat16)
        return out
    q, scale = quantize_fp8(w, "block", torch.float32)
    return {f"{module}.weight": q, f"{module}.weight_scale_inv": scale}


def _scale_name(fmt: str) -> str:
    return "weight_scale" if fmt in CT_STRATEGY else "weight_scale_inv"


def _fused_tensors(source: Path) -> dict[str, torch.Tensor]:
    """The source's tensors with each MoE layer's experts fused, transformers 5's in-memory names (Mixtral's
    block_sparse_moe becomes mlp): experts.gate_up_proj [E, 2I, H] (gate rows, then up rows), experts.down_proj
    [E, H, I]."""
    tensors, experts = {}, {}
    for key, w in load_file(str(source / "model.safetensors")).items():
        found = _EXPERT.fullmatch(key)
        if found is None:
            tensors[key.replace(".block_sparse_moe.", ".mlp.")] = w
            continue
        layer, _, expert, name = found.groups()
        experts.setdefault(layer, {})[(int(expert), _GATE_UP_DOWN[name])] = w
    for layer, parts in experts.items():
        num_experts = 1 + max(e for e, _ in parts)
        tensors[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, 0)], parts[(e, 1)]]) for e in range(num_experts)])
        tensors[f"{layer}.mlp.experts.down_proj"] = torch.stack([parts[(e, 2)] for e in range(num_experts)])
    return tensors


def _write(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))


def with_quantization_config(source: Path, out: Path, quantization_config: dict) -> Path:
    """A copy of the model in `source` whose config.json carries `quantization_config` (the tensors unchanged)."""
    shutil.copytree(source, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return out
