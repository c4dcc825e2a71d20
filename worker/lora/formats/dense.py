"""PEFT's per-module LoRA tensors: one lora_A [r, in] and one lora_B [out, r] per module of a decoder layer that
the model's LoRA targets list (lora/targets.py), named by the module's path under its layer:

    base_model.model.model.layers.3.self_attn.k_proj.lora_A.weight   ->  (3, "k_proj"), slice 1 of layer 3's qkv_proj
    base_model.model.model.layers.0.mlp.shared_expert.down_proj.lora_B.weight  ->  (0, "shared_expert.down_proj")

A tensor of a module the model lacks at that layer, or takes no LoRA on, is refused by name; shapes are
lora/adapter.py's to check.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import NoReturn

from worker.lora.errors import AdapterError
from worker.lora.targets import LoRATargets

_KEY = re.compile(r"layers\.(\d+)\.([\w.]+)\.lora_([AB])\.weight$")


def dense_tensors(keys: Iterable[str], targets: LoRATargets) -> dict[tuple[int, str], dict[str, str]]:
    """(layer, module) -> {"A": key, "B": key} of the tensors `keys`, in key order; the module named as
    AdapterSpec.target_modules names it ("q_proj", "shared_expert.gate_proj"). A layer past the model's is kept,
    for lora/adapter.py to refuse by its number."""
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for key in keys:
        m = _KEY.search(key)
        block, _, module = m.group(2).partition(".") if m else ("", "", "")
        if m is None or block not in targets.blocks or not module:
            raise AdapterError(f"adapter tensor {key!r} is not supported: only lora_A/lora_B weights of "
                               f"{', '.join(targets.short_names)} are")
        layer, path = int(m.group(1)), m.group(2)
        if layer < targets.num_layers and targets.find(layer, path) is None:
            _refuse(key, layer, path, module, targets)
        pairs.setdefault((layer, module), {})[m.group(3)] = key
    return pairs


def _refuse(key: str, layer: int, path: str, module: str, targets: LoRATargets) -> NoReturn:
    """Refuse a tensor of module `path` (under layer `layer`), which that layer of the model does not adapt."""
    if targets.experts is None:
        named = path if module in targets.modules else module      # one the model has elsewhere: by its path
        raise AdapterError(f"adapter targets module {named!r}, which the base model lacks or LoRA does not "
                           f"support; supported: {list(targets.short_names)}")
    why = targets.unsupported.get(path) or _what_the_layer_adapts(targets, layer)
    raise AdapterError(f"adapter tensor {key!r} targets {module!r}, which the base model ({targets.architecture}) "
                       f"cannot serve there: {why}")


def _what_the_layer_adapts(targets: LoRATargets, layer: int) -> str:
    """A mixture-of-experts layer's MLP as LoRA sees it: its experts and shared expert, or a dense MLP."""
    experts = targets.experts
    mlp = [t.path(m) for t in targets.at(layer) if t.block == experts.block for m in t.modules]
    if layer in experts.dense_layers:
        return f"layer {layer} has a dense MLP ({', '.join(mlp)})"
    shared = os.path.commonprefix(mlp)
    return (f"layer {layer} is a sparse MoE layer: its experts take LoRA as {experts.block}.experts.*"
            + (f", its shared expert as {shared[:shared.rfind('.') + 1]}*" if mlp else ""))
