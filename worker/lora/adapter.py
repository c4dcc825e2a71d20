"""PEFT LoRA adapters: validate against the model's LoRA targets (lora/targets.py) from the file header alone,
read per-module weights.

The tensor file is read by lora/safetensors_file.py; which tensors adapt which module is lora/formats/'s: the
expert formats take theirs first (kept as ExpertLayerLoRA, read when packed), PEFT's per-module tensors the rest.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from worker.lora.errors import AdapterError
from worker.lora.formats.dense import dense_tensors
from worker.lora.formats.expert_lora import ExpertLayerLoRA
from worker.lora.formats.experts import EXPERT_MODULE_NAMES, expert_coverage, expert_tensors
from worker.lora.peft_config import module_scaling, parse_config, read_config, read_config_bytes
from worker.lora.safetensors_file import (parse_header, read_data, read_header, read_header_bytes, tensor_bytes,
                                          tensor_file)
from worker.lora.targets import LoRATargets

_MAX_SCALING = 65504.0   # float16's largest value: beyond it a delta overflows the serving dtypes


@dataclass(frozen=True)
class AdapterSpec:
    """A validated adapter directory: what registration knows before any weight is read."""
    name: str
    path: str
    rank: int                                      # the largest rank over its modules, experts included
    # what it adapts, in LoRATargets.modules' order: q_proj ... down_proj, shared_expert.*_proj, experts.*_proj
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
    modules: dict[tuple[int, str], ModuleBytes]    # (layer, module) -> weights
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
    modules: dict[tuple[int, str], ModuleSource]   # (layer, module) -> where its weights lie
    experts: dict[int, ExpertLayerLoRA] = field(default_factory=dict)   # MoE layer -> its expert LoRA


def inspect_adapter(name: str, path: str | Path, targets: LoRATargets, max_lora_rank: int) -> AdapterSpec:
    """Check that a PEFT directory fits the base model's LoRA targets from its config and tensor header, reading
    no weights; raises AdapterError naming what is wrong."""
    path = Path(path)
    config = read_config(path)
    _check_config(config, targets, max_lora_rank)
    header, data_start = read_header(path)
    checked, experts = _check_modules(name, path, header, data_start, config, targets, max_lora_rank)
    return _spec(name, path, header, checked, experts, targets)


def read_adapter(name: str, path: str | Path, targets: LoRATargets, max_lora_rank: int,
                 dtype: torch.dtype) -> AdapterBytes:
    """Read and check a PEFT directory, its weights converted to `dtype`; raises AdapterError."""
    path = Path(path)
    header, data_start, checked, scalings, experts = _check_directory(name, path, targets, max_lora_rank)
    dense = {key: header[key] for keys in checked.values() for key in keys.values()}
    tensors = tensor_bytes(dense, read_data(path, data_start), dtype) if dense else {}
    modules = {}
    for key, keys in checked.items():
        (rank, fan_in), (fan_out, _) = header[keys["A"]][1], header[keys["B"]][1]
        modules[key] = ModuleBytes(tensors[keys["A"]], tensors[keys["B"]], rank, fan_in, fan_out, scalings[key])
    return AdapterBytes(_spec(name, path, header, checked, experts, targets), dtype, modules, experts,
                        tensor_file(path))


class AdapterContents(NamedTuple):
    """What a directory's checks and its weights' places depend on: adapter_config.json and the safetensors header
    as stored, and the size of the data after the header. Two directories with equal contents pass the same checks
    and hold their weights at the same file offsets."""
    config: bytes
    header: bytes
    data_size: int


def read_contents(path: str | Path) -> AdapterContents:
    path = Path(path)
    return AdapterContents(read_config_bytes(path), *read_header_bytes(path))


def locate_adapter(name: str, path: str | Path, targets: LoRATargets, max_lora_rank: int,
                   contents: AdapterContents | None = None) -> AdapterSource:
    """Check a PEFT directory as read_adapter does and locate each module's weights in its tensor file,
    reading no weights (slot_layout.SlotLayout.read_packed reads them straight into place); raises AdapterError.
    `contents`: the directory's, read already (read_contents), checked instead of reading them again."""
    path = Path(path)
    header, data_start, checked, scalings, experts = _check_directory(name, path, targets, max_lora_rank, contents)
    modules = {}
    for key, keys in checked.items():
        (_, a_shape, a_begin, a_end), (_, b_shape, b_begin, b_end) = header[keys["A"]], header[keys["B"]]
        modules[key] = ModuleSource((data_start + a_begin, data_start + a_end),
                                    (data_start + b_begin, data_start + b_end),
                                    a_shape[0], a_shape[1], b_shape[0], scalings[key])
    return AdapterSource(_spec(name, path, header, checked, experts, targets), tensor_file(path),
                         {entry[0] for entry in header.values()}, modules, experts)


def _check_directory(name: str, path: Path, targets: LoRATargets, max_lora_rank: int,
                     contents: AdapterContents | None = None) -> tuple[dict, int, dict, dict,
                                                                       dict[int, ExpertLayerLoRA]]:
    """The checks of read_adapter: (header, data start, (layer, module) -> tensor keys, -> scaling, experts)."""
    config = read_config(path) if contents is None else parse_config(contents.config, path)
    _check_config(config, targets, max_lora_rank)
    header, data_start = (read_header(path) if contents is None else
                          parse_header(contents.header, contents.data_size, path))
    checked, experts = _check_modules(name, path, header, data_start, config, targets, max_lora_rank)
    scalings = {}
    for (layer, module), keys in checked.items():
        target, _ = targets.packing(layer, module)
        scalings[(layer, module)] = module_scaling(config, f"model.layers.{layer}.{target.path(module)}",
                                                   header[keys["A"]][1][0])
    return header, data_start, checked, scalings, experts


def _spec(name: str, path: Path, header: dict, modules: dict, experts: dict[int, ExpertLayerLoRA],
          targets: LoRATargets) -> AdapterSpec:
    expert_names, expert_rank = expert_coverage(experts)
    rank = max([header[keys["A"]][1][0] for keys in modules.values()] + [expert_rank])
    adapted = tuple(sorted({m for _, m in modules} | expert_names, key=targets.modules.index))
    return AdapterSpec(name, str(path), rank, adapted)


def _check_config(config: dict, targets: LoRATargets, max_lora_rank: int) -> None:
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
    entries = config.get("target_modules")
    names = [entries] if isinstance(entries, str) else list(entries or [])
    known = set(targets.short_names) | set(EXPERT_MODULE_NAMES)    # an expert-only name is the tensors' to refuse
    for entry in names:
        if isinstance(entries, list) and entry.rsplit(".", 1)[-1] not in known:   # PEFT matches suffixes
            raise AdapterError(f"target_modules contains {entry!r}, which is not supported; "
                               f"supported target modules: {list(targets.short_names)}")


def _check_modules(name: str, path: Path, header: dict, data_start: int, config: dict, targets: LoRATargets,
                   max_lora_rank: int) -> tuple[dict[tuple[int, str], dict[str, str]], dict[int, ExpertLayerLoRA]]:
    """((layer, module) -> {"A": key, "B": key}, in key order, once every module has both matrices of
    shapes that fit the base model; MoE layer -> its expert LoRA)."""
    experts, others = expert_tensors(header, data_start, config, targets, max_lora_rank)
    pairs = dense_tensors(others, targets)
    for (layer, module), keys in sorted(pairs.items()):
        if "A" not in keys or "B" not in keys:
            raise AdapterError(f"adapter '{name}': layer {layer} {module} has lora_A or lora_B missing")
        _check_shapes(name, layer, module, header[keys["A"]][1], header[keys["B"]][1], targets, max_lora_rank)
    if not pairs and not experts:
        raise AdapterError(f"adapter '{name}': {path} holds no LoRA weights for {', '.join(targets.short_names)}")
    return dict(sorted(pairs.items())), experts


def _check_shapes(name: str, layer: int, module: str, a: tuple[int, ...], b: tuple[int, ...], targets: LoRATargets,
                  max_lora_rank: int) -> None:
    if layer >= targets.num_layers:
        raise AdapterError(f"adapter '{name}' has weights for layer {layer}, but the base model has "
                           f"{targets.num_layers} layers")
    target, slice_ = targets.packing(layer, module)
    fan_in, fan_out = target.in_features, target.out_features[slice_]
    if len(a) != 2 or len(b) != 2 or a[1] != fan_in or b != (fan_out, a[0]):
        raise AdapterError(f"adapter '{name}' layer {layer} {module}: lora_A {list(a)} and lora_B "
                           f"{list(b)} do not fit the base model (expected [r, {fan_in}] and [{fan_out}, r])")
    if a[0] > max_lora_rank:
        raise AdapterError(f"LoRA rank {a[0]} is greater than max_lora_rank {max_lora_rank}. "
                           "Raise --max-lora-rank to serve it.")
