"""PEFT LoRA adapters: validate against the base model (from the file header alone), read per-module weights.

The tensor file is read by lora/safetensors_file.py. On a mixture-of-experts base, expert tensors are
lora/formats.py's (kept as ExpertLayerLoRA, read when packed) and lora/moe_adapter.py says which dense modules
take LoRA there.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from worker.lora.errors import AdapterError
from worker.lora.formats import ExpertLayerLoRA
from worker.lora.moe_adapter import (EXPERT_TARGETS, MOE_KEY, SHARED_EXPERT_TARGETS, check_moe_target,
                                     expert_coverage, shared_expert_shapes, split_expert_tensors)
from worker.lora.peft_config import module_scaling, read_config
from worker.lora.safetensors_file import read_data, read_header, tensor_bytes, tensor_file
from worker.arch import ArchConfig

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TARGET_ORDER = SUPPORTED_TARGETS + SHARED_EXPERT_TARGETS + EXPERT_TARGETS
# target_modules entries: PEFT matches them as name suffixes ("shared_expert.gate_proj"); w1/w2/w3: Mixtral's experts
_CONFIG_TARGETS = SUPPORTED_TARGETS + ("w1", "w2", "w3")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_MAX_SCALING = 65504.0   # float16's largest value: beyond it a delta overflows the serving dtypes


@dataclass(frozen=True)
class AdapterSpec:
    """A validated adapter directory: what registration knows before any weight is read."""
    name: str
    path: str
    rank: int                                      # the largest rank over its modules, experts included
    # what it adapts: q_proj ... down_proj, shared_expert.*_proj, experts.{gate,up,down}_proj (moe_adapter.py)
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class ModuleBytes:
    """One module's weights as raw bytes in the serving dtype, row-major."""
    a: torch.Tensor          # [rows * in_features * itemsize] uint8: lora_A [rank, in_features] (fully sharded:
                             # a rank's share of the slot's rows, lora/shards.py)
    b: torch.Tensor          # [out_features * rank * itemsize] uint8: lora_B [out_features, rank]
    rank: int
    in_features: int
    out_features: int
    scaling: float


@dataclass
class AdapterBytes:
    spec: AdapterSpec
    dtype: torch.dtype
    modules: dict[tuple[int, str], ModuleBytes]    # (layer, target) -> weights
    experts: dict[int, ExpertLayerLoRA] = field(default_factory=dict)   # MoE layer -> its expert LoRA (not read)
    file: Path | None = None                       # the tensor file the expert LoRA is read from


@dataclass(frozen=True)
class ModuleSource:
    """Where one module's weights lie in adapter_model.safetensors: absolute byte ranges [begin, end)."""
    a: tuple[int, int]       # lora_A [rank, in_features], row-major, in the file's dtype
    b: tuple[int, int]       # lora_B [out_features, rank]
    rank: int
    in_features: int
    out_features: int
    scaling: float


@dataclass
class AdapterSource:
    """A checked adapter directory with its weights located in the file but not read (`locate_adapter`)."""
    spec: AdapterSpec
    file: Path
    dtypes: set[torch.dtype]                       # the dtypes its tensors are stored in
    modules: dict[tuple[int, str], ModuleSource]   # (layer, target) -> where its weights lie
    experts: dict[int, ExpertLayerLoRA] = field(default_factory=dict)   # MoE layer -> its expert LoRA


@dataclass
class ModuleWeights:
    """One module's LoRA matrices as tensors (tests compare the serving path against them)."""
    a: torch.Tensor     # [rank, in_features]
    b: torch.Tensor     # [out_features, rank]
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class AdapterWeights:
    """A whole adapter's matrices as tensors, per (layer, target) module."""
    name: str
    path: str
    rank: int                                      # the largest rank over its modules
    target_modules: tuple[str, ...]
    modules: dict[tuple[int, str], ModuleWeights]  # (layer, target) -> weights


def inspect_adapter(name: str, path: str | Path, arch: ArchConfig, max_lora_rank: int) -> AdapterSpec:
    """Check that a PEFT directory fits the base model from its config and tensor header, reading no
    weights; raises AdapterError naming what is wrong."""
    path = Path(path)
    config = read_config(path)
    _check_config(config, max_lora_rank)
    header, data_start = read_header(path)
    checked, experts = _check_modules(name, path, header, data_start, config, arch, max_lora_rank)
    return _spec(name, path, header, checked, experts)


def read_adapter(name: str, path: str | Path, arch: ArchConfig, max_lora_rank: int,
                 dtype: torch.dtype) -> AdapterBytes:
    """Read and check a PEFT directory, its weights converted to `dtype`; raises AdapterError."""
    path = Path(path)
    header, data_start, checked, scalings, experts = _check_directory(name, path, arch, max_lora_rank)
    dense = {key: header[key] for keys in checked.values() for key in keys.values()}
    tensors = tensor_bytes(dense, read_data(path, data_start), dtype) if dense else {}
    modules = {}
    for (layer, target), keys in checked.items():
        (rank, fan_in), (fan_out, _) = header[keys["A"]][1], header[keys["B"]][1]
        modules[(layer, target)] = ModuleBytes(tensors[keys["A"]], tensors[keys["B"]], rank, fan_in, fan_out,
                                               scalings[(layer, target)])
    return AdapterBytes(_spec(name, path, header, checked, experts), dtype, modules, experts, tensor_file(path))


def locate_adapter(name: str, path: str | Path, arch: ArchConfig, max_lora_rank: int) -> AdapterSource:
    """Check a PEFT directory as read_adapter does and locate each module's weights in its tensor file,
    reading no weights (slot_layout.SlotLayout.read_packed reads them straight into place); raises AdapterError."""
    path = Path(path)
    header, data_start, checked, scalings, experts = _check_directory(name, path, arch, max_lora_rank)
    modules = {}
    for key, keys in checked.items():
        (_, a_shape, a_begin, a_end), (_, b_shape, b_begin, b_end) = header[keys["A"]], header[keys["B"]]
        modules[key] = ModuleSource((data_start + a_begin, data_start + a_end),
                                    (data_start + b_begin, data_start + b_end),
                                    a_shape[0], a_shape[1], b_shape[0], scalings[key])
    return AdapterSource(_spec(name, path, header, checked, experts), tensor_file(path),
                         {entry[0] for entry in header.values()}, modules, experts)


def _check_directory(name: str, path: Path, arch: ArchConfig,
                     max_lora_rank: int) -> tuple[dict, int, dict, dict, dict[int, ExpertLayerLoRA]]:
    """The checks of read_adapter: (header, data start, (layer, target) -> tensor keys, -> scaling, experts)."""
    config = read_config(path)
    _check_config(config, max_lora_rank)
    header, data_start = read_header(path)
    checked, experts = _check_modules(name, path, header, data_start, config, arch, max_lora_rank)
    scalings = {}
    for (layer, target), keys in checked.items():
        block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        scalings[(layer, target)] = module_scaling(config, f"model.layers.{layer}.{block}.{target}",
                                             header[keys["A"]][1][0])
    return header, data_start, checked, scalings, experts


def read_adapter_weights(name: str, path: str | Path, arch: ArchConfig, max_lora_rank: int,
                         dtype: torch.dtype) -> AdapterWeights:
    """`read_adapter` with each module's matrices as [rank, in] and [out, rank] tensors."""
    raw = read_adapter(name, path, arch, max_lora_rank, dtype)
    modules = {key: ModuleWeights(m.a.view(dtype).view(m.rank, m.in_features),
                                  m.b.view(dtype).view(m.out_features, m.rank), m.scaling)
               for key, m in raw.modules.items()}
    return AdapterWeights(name, str(path), raw.spec.rank, raw.spec.target_modules, modules)


def _spec(name: str, path: Path, header: dict, modules: dict, experts: dict[int, ExpertLayerLoRA]) -> AdapterSpec:
    expert_names, expert_rank = expert_coverage(experts)
    rank = max([header[keys["A"]][1][0] for keys in modules.values()] + [expert_rank])
    targets = tuple(sorted({t for _, t in modules} | expert_names, key=_TARGET_ORDER.index))
    return AdapterSpec(name, str(path), rank, targets)


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
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in ranks):
        raise AdapterError(f"r and rank_pattern must be positive integers, got {ranks}")
    alphas = [config.get("lora_alpha", 8), *(config.get("alpha_pattern") or {}).values()]
    if not all(isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) for a in alphas):
        raise AdapterError(f"lora_alpha and alpha_pattern must be finite numbers, got {alphas}")
    largest = max(map(abs, alphas)) / (math.sqrt(min(ranks)) if config.get("use_rslora") else min(ranks))
    if largest > _MAX_SCALING:
        raise AdapterError(f"the LoRA scaling (lora_alpha / r) can reach {largest:g}; its magnitude must be at most "
                           f"{_MAX_SCALING:g}")
    if max(ranks) > max_lora_rank:
        raise AdapterError(f"LoRA rank {max(ranks)} is greater than max_lora_rank {max_lora_rank}. "
                           "Raise --max-lora-rank to serve it.")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or [])
    for target in names:
        if isinstance(targets, list) and target.rsplit(".", 1)[-1] not in _CONFIG_TARGETS:   # PEFT matches suffixes
            raise AdapterError(f"target_modules contains {target!r}, which is not supported; "
                               f"supported target modules: {list(SUPPORTED_TARGETS)}")


def _check_modules(name: str, path: Path, header: dict, data_start: int, config: dict, arch: ArchConfig,
                   max_lora_rank: int) -> tuple[dict[tuple[int, str], dict[str, str]], dict[int, ExpertLayerLoRA]]:
    """((layer, target) -> {"A": key, "B": key}, in key order, once every module has both matrices of
    shapes that fit the base model; MoE layer -> its expert LoRA)."""
    experts, dense = split_expert_tensors(header, data_start, config, arch, max_lora_rank)
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key in dense:
        m = (MOE_KEY if arch.is_moe else _KEY).search(key)
        if m is None:
            raise AdapterError(f"adapter tensor {key!r} is not supported: only lora_A/lora_B weights of "
                               f"{', '.join(SUPPORTED_TARGETS)} are")
        layer, target, ab = int(m.group(1)), m.group(2), m.group(3)
        if arch.is_moe:
            check_moe_target(key, layer, target, arch)
        elif target not in SUPPORTED_TARGETS:
            raise AdapterError(f"adapter targets module {target!r}, which the base model lacks or "
                               f"LoRA does not support; supported: {list(SUPPORTED_TARGETS)}")
        pairs.setdefault((layer, target), {})[ab] = key
    expected = module_shapes(arch)
    for (layer, target), keys in sorted(pairs.items()):
        if "A" not in keys or "B" not in keys:
            raise AdapterError(f"adapter '{name}': layer {layer} {target} has lora_A or lora_B missing")
        _check_shapes(name, layer, target, header[keys["A"]][1], header[keys["B"]][1], arch, expected,
                      max_lora_rank)
    if not pairs and not experts:
        raise AdapterError(f"adapter '{name}': {path} holds no LoRA weights for {', '.join(SUPPORTED_TARGETS)}")
    return dict(sorted(pairs.items())), experts


def module_shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each target module of the base model (dense layers' MLP for gate_proj,
    up_proj, down_proj; the shared expert's on Qwen2-MoE)."""
    h, i = arch.hidden_size, arch.intermediate_size
    return {"q_proj": (h, arch.q_size), "k_proj": (h, arch.kv_size), "v_proj": (h, arch.kv_size),
            "o_proj": (arch.q_size, h), "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
            **shared_expert_shapes(arch)}


def _check_shapes(name: str, layer: int, target: str, a: tuple[int, ...], b: tuple[int, ...], arch: ArchConfig,
                  expected: dict[str, tuple[int, int]], max_lora_rank: int) -> None:
    if layer >= arch.num_layers:
        raise AdapterError(f"adapter '{name}' has weights for layer {layer}, but the base model has "
                           f"{arch.num_layers} layers")
    fan_in, fan_out = expected[target]
    if len(a) != 2 or len(b) != 2 or a[1] != fan_in or b != (fan_out, a[0]):
        raise AdapterError(f"adapter '{name}' layer {layer} {target}: lora_A {list(a)} and lora_B "
                           f"{list(b)} do not fit the base model (expected [r, {fan_in}] and [{fan_out}, r])")
    if a[0] > max_lora_rank:
        raise AdapterError(f"LoRA rank {a[0]} is greater than max_lora_rank {max_lora_rank}. "
                           "Raise --max-lora-rank to serve it.")
