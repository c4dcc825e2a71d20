"""FP8 KV-cache scales in a checkpoint: the names that carry them, handed to each layer's attention.

The spellings quantization tools write (N: the decoder layer):

    model.layers.N.self_attn.k_scale, v_scale                    compressed-tensors / llm-compressor
    model.layers.N.self_attn.k_proj.k_scale, v_proj.v_scale      ModelOpt
    model.layers.N.self_attn.k_proj.output_scale, v_proj.output_scale   older compressed-tensors / AutoFP8
    model.layers.N.self_attn.kv_scale                            one legacy scale, for K and V both

Each must be per-tensor (a scalar or shape [1]): compressed-tensors' per-head scales ([num_kv_heads, 1, 1],
strategy "attn_head") are refused. With --kv-cache-dtype auto they are read and dropped, as vLLM drops them; with
fp8 they become the layer's Attention.k_scale / v_scale (layers/attention.py), the same float on every
tensor-parallel rank.
"""
from __future__ import annotations

import logging
import math
import re

import torch
from torch import nn

logger = logging.getLogger(__name__)

_KV_SCALE = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(?:(k_scale|v_scale|kv_scale)"
                       r"|k_proj\.(k_scale|output_scale)|v_proj\.(v_scale|output_scale))$")


def kv_scale_target(hf_name: str) -> tuple[int, str] | None:
    """(layer, which of "k", "v", "kv") if `hf_name` is a KV-cache scale, else None.

    'model.layers.3.self_attn.v_proj.output_scale' -> (3, "v"); 'model.layers.0.self_attn.kv_scale' -> (0, "kv")"""
    match = _KV_SCALE.match(hf_name)
    if match is None:
        return None
    bare, k_proj, v_proj = match.group(2, 3, 4)
    which = "kv" if bare == "kv_scale" else "k" if bare == "k_scale" or k_proj else "v"
    return int(match.group(1)), which


def load_kv_scale(model: nn.Module, hf_name: str, tensor: torch.Tensor, use: bool) -> bool:
    """Whether `hf_name` is a KV-cache scale. If it is and `use` (an FP8 cache), its value goes to its layer's
    attention; without `use` it is dropped. Raises ValueError for a per-head or non-positive scale, or a layer the
    model lacks."""
    target = kv_scale_target(hf_name)
    if target is None:
        return False
    if not use:
        return True
    layer, which = target
    if tensor.numel() != 1:
        raise ValueError(f"checkpoint tensor {hf_name!r} holds per-head KV-cache scales (shape {tuple(tensor.shape)}); "
                         f"--kv-cache-dtype fp8 takes one scale per layer for K and one for V (a compressed-tensors "
                         f"kv_cache_scheme with strategy 'tensor'). Requantize with per-tensor scales, or serve with "
                         f"--kv-cache-dtype auto")
    value = float(tensor.float().item())
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"checkpoint tensor {hf_name!r}: a KV-cache scale must be positive and finite, got {value}")
    try:
        attention = model.get_submodule(f"layers.{layer}.self_attn.attn")
    except AttributeError:
        raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(model).__name__}") from None
    for part in which:
        setattr(attention, f"{part}_scale", value)
    return True


def log_kv_scales(model: nn.Module) -> None:
    """One line on the scales an FP8 cache runs with; a warning when every one is 1.0 (none in the checkpoint:
    K/V past ±448 are clipped)."""
    pairs = [(m.k_scale, m.v_scale) for name, m in model.named_modules() if name.endswith("self_attn.attn")]
    if all(pair == (1.0, 1.0) for pair in pairs):
        logger.warning("FP8 KV cache with k_scale = v_scale = 1.0 in every layer (the checkpoint has no KV-cache "
                       "scales): keys and values past ±448 are clipped")
        return
    k, v = [p[0] for p in pairs], [p[1] for p in pairs]
    logger.info("FP8 KV cache scales over %d layers: k_scale %.4g to %.4g, v_scale %.4g to %.4g", len(pairs),
                min(k), max(k), min(v), max(v))
