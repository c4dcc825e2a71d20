"""What an adapter may adapt on a mixture-of-experts base model, checked from the tensor header alone.

Expert tensors (any of the formats lora/formats.py reads) become per-layer ExpertLayerLoRA; the rest is dense
LoRA, served by the slot regions of our Linear projections: attention everywhere, `mlp.gate_proj/up_proj/
down_proj` on the dense layers (`mlp_only_layers`), `mlp.shared_expert.gate_proj/up_proj/down_proj` on the
sparse layers of Qwen2-MoE. The router (`mlp.gate`, `block_sparse_moe.gate`) and the shared expert's gate
(`mlp.shared_expert_gate`) are refused by name. On a dense base model, expert tensors are refused.
"""
from __future__ import annotations

import re

from worker.lora.errors import AdapterError
from worker.lora.formats import ExpertLayerLoRA, ExpertShape, StoredTensor, detect_expert_formats
from worker.arch import ArchConfig

SHARED_EXPERT_TARGETS = ("shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj")
# the names AdapterSpec.target_modules (GET /v1/adapters) gives the experts' projections, whatever the format
EXPERT_TARGETS = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")
# a dense LoRA tensor of an MoE base: layers.{l}.self_attn.{t} or layers.{l}.mlp[.shared_expert].{t}
MOE_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.((?:shared_expert\.)?\w+)\.lora_([AB])\.weight$")
_ABOUT_EXPERTS = re.compile(r"\.(?:mlp|block_sparse_moe)\.(?:experts|gate|shared_expert_gate)\.|\.block_sparse_moe\.")
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_DENSE_MLP = ("gate_proj", "up_proj", "down_proj")


def expert_shape(arch: ArchConfig) -> ExpertShape:
    return ExpertShape(arch.num_layers, arch.num_experts, arch.hidden_size, arch.moe_intermediate_size,
                       tuple(layer for layer in range(arch.num_layers) if not arch.is_sparse_layer(layer)))


def split_expert_tensors(header: dict, data_start: int, config: dict, arch: ArchConfig,
                         max_lora_rank: int) -> tuple[dict[int, ExpertLayerLoRA], dict]:
    """(layer -> its expert LoRA, the header entries of every other tensor) of an adapter's tensor header
    (key -> (dtype, shape, begin, end)); raises AdapterError naming a tensor that cannot be served."""
    if not arch.is_moe:
        for key in header:
            if _ABOUT_EXPERTS.search(key):
                raise AdapterError(f"adapter tensor {key!r} adapts the experts or router of a mixture-of-experts "
                                   f"model, but the base model ({arch.architecture}) is dense; load an adapter "
                                   "trained for this base model")
        return {}, header
    tensors = {key: StoredTensor(key, dtype, shape, (data_start + begin, data_start + end))
               for key, (dtype, shape, begin, end) in header.items()}
    layers, others = detect_expert_formats(tensors, config, expert_shape(arch), max_lora_rank)
    return layers, {key: header[key] for key in others}


def check_moe_target(key: str, layer: int, target: str, arch: ArchConfig) -> None:
    """Refuse dense LoRA on a module the MoE base lacks at that layer (layers past the model are refused later)."""
    if target in _ATTENTION or layer >= arch.num_layers:
        return
    sparse = arch.is_sparse_layer(layer)
    if target in _DENSE_MLP and not sparse:
        return
    if target in SHARED_EXPERT_TARGETS and sparse and arch.shared_expert_intermediate_size:
        return
    if target == "shared_expert_gate":
        why = "LoRA on the shared expert's gate is not supported"
    elif sparse:
        why = (f"layer {layer} is a sparse MoE layer: its experts take LoRA as mlp.experts.*"
               + (", its shared expert as mlp.shared_expert.*" if arch.shared_expert_intermediate_size else ""))
    else:
        why = f"layer {layer} has a dense MLP (mlp.gate_proj, mlp.up_proj, mlp.down_proj)"
    raise AdapterError(f"adapter tensor {key!r} targets {target!r}, which the base model ({arch.architecture}) "
                       f"cannot serve there: {why}")


def shared_expert_shapes(arch: ArchConfig) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of the shared expert's projections."""
    h, s = arch.hidden_size, arch.shared_expert_intermediate_size
    return {"shared_expert.gate_proj": (h, s), "shared_expert.up_proj": (h, s), "shared_expert.down_proj": (s, h)}


def expert_coverage(layers: dict[int, ExpertLayerLoRA]) -> tuple[set[str], int]:
    """(the EXPERT_TARGETS names the layers adapt, their largest rank; 0 when none)."""
    names, rank = set(), 0
    for found in layers.values():
        for name, proj in zip(EXPERT_TARGETS, (found.gate, found.up, found.down)):
            if proj is not None:
                names.add(name)
                rank = max(rank, proj.rank)
    return names, rank
