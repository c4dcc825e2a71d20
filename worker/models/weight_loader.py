"""Checkpoint loading: safetensors files (single, or sharded with an index) into our fused modules."""
from __future__ import annotations

import json
import logging
import re
from collections import Counter
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from worker.models.kv_scales import load_kv_scale

logger = logging.getLogger(__name__)

# one expert's matrix in the per-expert layout (transformers 4, and what transformers 5 saves):
# 'layers.3.mlp.experts.7.up_proj.weight', Mixtral 'layers.3.block_sparse_moe.experts.7.w3.weight'
# (and, in FP8 checkpoints, its scales beside it: 'layers.3.mlp.experts.7.up_proj.weight_scale_inv')
_EXPERT = re.compile(r"^layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.(weight|weight_scale|weight_scale_inv|input_scale)$")
# the other spelling of a tensor some FP8 writers use: transformers' per-tensor FP8 saves `weight_scale_inv` and
# `activation_scale` where vLLM's and compressed-tensors' checkpoints say `weight_scale` and `input_scale`
_ALIASES = {"weight_scale_inv": "weight_scale", "activation_scale": "input_scale"}
_EXPERT_PART = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_checkpoint(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for file in checkpoint_files(model_dir):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_targets(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Every checkpoint tensor the model takes, by our name -> (its module, the tensor's name there), in the order
    of model.named_parameters(): the tensors a module's weight scheme names (`checkpoint_tensors`: Linear,
    FusedExperts; layers/weights/), and the parameters of every other module (a tied one once)."""
    targets: dict[str, tuple[nn.Module, str]] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if hasattr(module, "checkpoint_tensors"):
            for tensor in module.checkpoint_tensors():
                targets[prefix + tensor] = (module, tensor)
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                targets[prefix + param_name] = (module, param_name)
    return targets


def load_weights(model: nn.Module, model_dir: Path, kv_cache_scales: bool = False) -> None:
    """Fill every checkpoint tensor `model` takes (checkpoint_targets); q/k/v and gate/up go into fused slices. A
    module with `load_shard` (Linear, the vocab-parallel embedding and LM head, the fused experts) is handed the
    whole checkpoint tensor and copies its share: this rank's shard under tensor parallelism (layers/linear.py,
    layers/embedding.py, layers/sparse_moe.py), in the form its weight scheme holds; per-expert matrices go through
    FusedExperts.load_expert, which keeps the share too. KV-cache scales go to the layers' attention when
    `kv_cache_scales` (an FP8 cache) and are dropped otherwise (models/kv_scales.py). A tensor no module takes is
    refused by name."""
    targets = checkpoint_targets(model)
    loaded: set[str] = set()
    expert_parts: Counter[str] = Counter()       # fused expert parameter -> per-expert matrices loaded
    for hf_name, tensor in iter_checkpoint(model_dir):
        if load_kv_scale(model, hf_name, tensor, use=kv_cache_scales):
            continue
        target = _our_name(model, hf_name)
        if target is None:
            continue
        expert = _EXPERT.match(target[0])
        if expert is not None:
            expert_parts[_load_expert(model, targets, expert, tensor, hf_name)] += 1
            continue
        name, shard = target
        if name not in targets:
            name = _alias(name, targets)
        if name not in targets:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(model).__name__}")
        module, param = targets[name]
        if hasattr(module, "load_shard"):
            module.load_shard(param, shard, tensor)
        else:
            _copy(getattr(module, param), tensor, hf_name)
        loaded.add(name)
    num_experts = model.cfg.num_experts
    loaded |= {name for name, n in expert_parts.items()
               if n == (2 * num_experts if ".gate_up_proj" in name else num_experts)}
    tied = {"lm_head.weight"} if model.cfg.tie_word_embeddings else set()
    missing = set(targets) - loaded - tied
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    logger.info("loaded %d tensors from %s", len(loaded), model_dir)


def finish_loading(model: nn.Module) -> None:
    """Every checkpoint tensor is in (loaded, or drawn by --load-format dummy): each projection's weight scheme
    settles its weights into the form they multiply in (FP8 dequantized on a device without FP8 kernels, ...)."""
    for module in model.modules():
        if hasattr(module, "finish_loading"):
            module.finish_loading()


def _alias(name: str, targets: dict) -> str:
    """`name` in the other spelling of an FP8 tensor (_ALIASES) when the model takes that one."""
    prefix, _, leaf = name.rpartition(".")
    other = f"{prefix}.{_ALIASES.get(leaf, leaf)}"
    return other if other in targets else name


def _our_name(model: nn.Module, hf_name: str) -> tuple[str, int | None] | None:
    """'model.layers.0.self_attn.k_proj.weight' -> ('layers.0.self_attn.qkv_proj.weight', 1)."""
    if hf_name.endswith("rotary_emb.inv_freq"):
        return None
    name = hf_name.removeprefix("model.")
    if ".block_sparse_moe.gate." in name:       # Mixtral's router
        return name.replace(".block_sparse_moe.", ".mlp."), None
    if _EXPERT.match(name):
        return name, None
    for ckpt, (ours, shard) in model.stacked_params.items():
        if f".{ckpt}." in name:
            return name.replace(f".{ckpt}.", f".{ours}."), shard
    return name, None


def _load_expert(model: nn.Module, targets: dict, match: re.Match, tensor: torch.Tensor, hf_name: str) -> str:
    """One expert's gate, up or down matrix (or a scale beside it) into the fused experts; returns the name of
    the fused tensor it counts toward (the weights' scales: `gate_up_proj_scale_inv`, ...)."""
    layer, expert, part = int(match.group(1)), int(match.group(2)), _EXPERT_PART[match.group(3)]
    tensor_name = match.group(4)
    name = f"layers.{layer}.mlp.experts.{'down_proj' if part == 'down' else 'gate_up_proj'}"
    counted = name if tensor_name == "weight" else f"{name}{tensor_name.removeprefix('weight')}"
    if (counted not in targets and tensor_name != "input_scale") or name not in targets \
            or expert >= model.cfg.num_experts:
        raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(model).__name__}")
    module, _ = targets[name]
    module.load_expert(name, expert, part, tensor, tensor_name)
    return counted


def _copy(param: torch.Tensor, tensor: torch.Tensor, hf_name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != model shape {tuple(param.shape)}")
    param.copy_(tensor)
