"""PEFT LoRA adapters: read, validate against the base model, and hold per-module weights on the host."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from worker.models.hf_config import ArchConfig

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(ValueError):
    """A user-facing adapter problem; `status_code` is the HTTP status the gateway should answer with."""

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code


@dataclass
class LoRAModule:
    a: torch.Tensor     # [rank, in_features]
    b: torch.Tensor     # [out_features, rank]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int                                      # the largest rank over its modules
    target_modules: tuple[str, ...]
    modules: dict[tuple[int, str], LoRAModule] = field(default_factory=dict)   # (layer, target) -> weights

    @property
    def num_bytes(self) -> int:
        return sum(m.a.numel() * m.a.element_size() + m.b.numel() * m.b.element_size()
                   for m in self.modules.values())


def load_adapter(name: str, path: str | Path, arch: ArchConfig, max_lora_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """Read a PEFT directory and check it fits the base model; raises AdapterError naming what is wrong."""
    path = Path(path)
    config = _read_config(path)
    _check_config(config, max_lora_rank)
    tensors = _read_tensors(path)
    pairs = _group_tensors(tensors)
    expected = _module_shapes(arch)
    modules = {}
    for (layer, target), ab in sorted(pairs.items()):
        if "A" not in ab or "B" not in ab:
            raise AdapterError(f"adapter '{name}': layer {layer} {target} has lora_A or lora_B missing")
        a, b = ab["A"], ab["B"]
        _check_shapes(name, layer, target, a, b, arch, expected, max_lora_rank)
        module_key = f"model.layers.{layer}.{'self_attn' if target in ('q_proj','k_proj','v_proj','o_proj') else 'mlp'}.{target}"
        scaling = _scaling(config, module_key, a.shape[0])
        modules[(layer, target)] = LoRAModule(a.to(dtype).contiguous(), b.to(dtype).contiguous(), scaling)
    if not modules:
        raise AdapterError(f"adapter '{name}': {path} holds no LoRA weights for {', '.join(SUPPORTED_TARGETS)}")
    targets = tuple(sorted({t for _, t in modules}, key=SUPPORTED_TARGETS.index))
    return LoRAAdapter(name, str(path), max(m.rank for m in modules.values()), targets, modules)


def _read_config(path: Path) -> dict:
    cfg_file = path / "adapter_config.json"
    if not path.is_dir():
        raise AdapterError(f"No adapter found at {path}: the directory does not exist", status_code=404)
    if not cfg_file.is_file():
        raise AdapterError(f"No adapter found at {path}: adapter_config.json is missing", status_code=404)
    try:
        return json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter_config.json in {path} is unreadable: {e}") from e


def _check_config(config: dict, max_lora_rank: int) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type {peft_type!r} is not supported; only LORA adapters are")
    if config.get("use_dora"):
        raise AdapterError("use_dora=true is not supported: DoRA adapters cannot be served")
    if config.get("modules_to_save"):
        raise AdapterError(f"modules_to_save={config['modules_to_save']!r} is not supported: "
                           "only LoRA weights on the base model's projections can be served")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias={config['bias']!r} is not supported; only bias=\"none\" is")
    if config.get("lora_bias"):
        raise AdapterError("lora_bias=true is not supported")
    ranks = [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    if max(ranks) > max_lora_rank:
        raise AdapterError(f"LoRA rank {max(ranks)} is greater than max_lora_rank {max_lora_rank}. "
                           "Raise --max-lora-rank to serve it.")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    for target in names:
        if isinstance(targets, list) and target not in SUPPORTED_TARGETS:
            raise AdapterError(f"target_modules contains {target!r}, which is not supported; "
                               f"supported target modules: {list(SUPPORTED_TARGETS)}")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        if (path / "adapter_model.bin").is_file():
            raise AdapterError(f"{path} holds adapter_model.bin; only adapter_model.safetensors is supported")
        raise AdapterError(f"No adapter found at {path}: adapter_model.safetensors is missing", status_code=404)
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as e:
        raise AdapterError(f"adapter_model.safetensors in {path} is unreadable: {e}") from e


def _group_tensors(tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise AdapterError(f"adapter tensor {key!r} is not supported: only lora_A/lora_B weights of "
                               f"{', '.join(SUPPORTED_TARGETS)} are")
        layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
        if target not in SUPPORTED_TARGETS:
            raise AdapterError(f"adapter targets module {target!r}, which the base model lacks or "
                               f"LoRA does not support; supported: {list(SUPPORTED_TARGETS)}")
        pairs.setdefault((layer, target), {})[ab] = tensor
    return pairs


def _module_shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module of the base model."""
    h, i = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (h, arch.q_size), "k_proj": (h, arch.kv_size), "v_proj": (h, arch.kv_size),
            "o_proj": (arch.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def _check_shapes(name: str, layer: int, target: str, a: torch.Tensor, b: torch.Tensor, arch: ArchConfig,
                  expected: dict[str, tuple[int, int]], max_lora_rank: int) -> None:
    if layer >= arch.num_layers:
        raise AdapterError(f"adapter '{name}' has weights for layer {layer}, but the base model has "
                           f"{arch.num_layers} layers")
    fan_in, fan_out = expected[target]
    r = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r):
        raise AdapterError(f"adapter '{name}' layer {layer} {target}: lora_A {tuple(a.shape)} and lora_B "
                           f"{tuple(b.shape)} do not fit the base model (expected [r, {fan_in}] and [{fan_out}, r])")
    if r > max_lora_rank:
        raise AdapterError(f"LoRA rank {r} is greater than max_lora_rank {max_lora_rank}. "
                           "Raise --max-lora-rank to serve it.")


def _scaling(config: dict, module_key: str, rank: int) -> float:
    """PEFT's rule: alpha (alpha_pattern overrides lora_alpha) / r, or / sqrt(r) with use_rslora."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            alpha = value
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
