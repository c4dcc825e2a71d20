"""Expert LoRA formats of MoE adapters: which tensors adapt which experts, detected from the tensors alone and
checked against the routed experts of the model's LoRA targets (lora/targets.py ExpertShape).

Three formats, told apart by tensor names and shapes (no flag), each normalised into per-layer
`ExpertLayerLoRA`: for each of gate, up and down an A [n, r, in] and a B [n, out, r], n = num_experts,
or 1 where one matrix serves every expert.

(a) PEFT `target_parameters` on the fused experts (PEFT 0.21, transformers 5: `ParamWrapper`). PEFT wraps
    each targeted parameter of `mlp.experts` in its own ParamWrapper, nested in the order the experts
    module registers its parameters: gate_up_proj first, so gate_up's wrapper is the inner one and its
    weights are saved as `mlp.experts.base_layer.lora_A/B`, down's as `mlp.experts.lora_A/B` (Mixtral
    included: transformers 5 names its block `mlp`, so `block_sparse_moe` never appears here). Both are
    2-D (checked with PEFT 0.21.2 on tiny Qwen3-MoE and Mixtral):
        gate_up: lora_A [r*E, H], lora_B [2I, r*E];   down: lora_A [r*E, I], lora_B [H, r*E]
    PEFT reads A as A.view(E, r, in), so expert e owns rows e*r:(e+1)*r (expert-major), and B as
    B.view(out, r, E), so expert e owns columns e::E (expert-minor, interleaved); the expert's weight
    becomes W[e] + scaling * B_e @ A_e. One rank-r pair covers gate and up together: gate is rows :I of
    B, up rows I:, both with the same A. We tell gate_up from down by shape, never by nesting order:
    (A in, B out) is (H, 2I) for gate_up and (I, H) for down, which could only coincide if H = I = 2I.
    rank_pattern / alpha_pattern apply as PEFT applies them, to the parameter's key
    `model.layers.{l}.mlp.experts.gate_up_proj` (or `.down_proj`); use_rslora gives alpha / sqrt(r).
(b) Per-expert modules: `experts.{e}.gate_proj/up_proj/down_proj.lora_A/B` (Mixtral's
    `block_sparse_moe.experts.{e}.w1/w3/w2`), A [r, in], B [out, r]; gate and up each with its own rank.
    All experts of one projection share one rank and scaling; an expert left out adds nothing.
(c) Stacked 3-D tensors `experts.gate_proj/up_proj/down_proj.lora_A/B` (or w1/w3/w2), A [n, r, in],
    B [n, out, r], n = E or 1. The "shared outer" adapters (SGLang #21466) have n = 1 for the gate and up
    A's and the down B: x @ A is then computed once per token, not once per (token, expert).

LoRA on the router (`mlp.gate`, `block_sparse_moe.gate`) is refused, and so is any expert tensor that fits
none of these: an AdapterError names the tensor, so an adapter is never served as if it were the base.
"""
from __future__ import annotations

import re
from pathlib import Path

from worker.lora.errors import AdapterError
from worker.lora.formats.expert_lora import ExpertLayerLoRA, ExpertMatrix, ExpertProjection, StoredTensor
from worker.lora.peft_config import module_scaling, read_config
from worker.lora.safetensors_file import read_header
from worker.lora.targets import EXPERT_MODULES, ExpertShape, LoRATargets

PROJECTIONS = ("gate", "up", "down")
_NAMES = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
# the experts' module names an adapter_config.json's target_modules may give (PEFT matches them as suffixes)
EXPERT_MODULE_NAMES = tuple(_NAMES)
_BLOCK = r"layers\.(\d+)\.(mlp|block_sparse_moe)\."
_PEFT = re.compile(_BLOCK + r"experts\.((?:base_layer\.)*)lora_([AB])\.weight$")
_PER_EXPERT = re.compile(_BLOCK + r"experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.lora_([AB])\.weight$")
_STACKED = re.compile(_BLOCK + r"experts\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.lora_([AB])\.weight$")
_ROUTER = re.compile(_BLOCK + r"gate\.")
_EXPERTS = re.compile(_BLOCK + r"experts\.")
# a tensor about experts or a router, whatever its format: refused on a dense base model
_ABOUT_EXPERTS = re.compile(r"\.(?:mlp|block_sparse_moe)\.(?:experts|gate|shared_expert_gate)\.|\.block_sparse_moe\.")


def expert_tensors(header: dict, data_start: int, config: dict, targets: LoRATargets,
                   max_lora_rank: int) -> tuple[dict[int, ExpertLayerLoRA], list[str]]:
    """(layer -> its expert LoRA, the keys of every other tensor) of an adapter's tensor header (key -> (dtype,
    shape, begin, end)); raises AdapterError naming a tensor that cannot be served. On a dense base model (no
    experts in `targets`), a tensor about experts or a router is refused."""
    if targets.experts is None:
        for key in header:
            if _ABOUT_EXPERTS.search(key):
                raise AdapterError(f"adapter tensor {key!r} adapts the experts or router of a mixture-of-experts "
                                   f"model, but the base model ({targets.architecture}) is dense; load an adapter "
                                   "trained for this base model")
        return {}, list(header)
    tensors = {key: StoredTensor(key, dtype, shape, (data_start + begin, data_start + end))
               for key, (dtype, shape, begin, end) in header.items()}
    return detect_expert_formats(tensors, config, targets.experts, max_lora_rank)


def expert_coverage(layers: dict[int, ExpertLayerLoRA]) -> tuple[set[str], int]:
    """(the EXPERT_MODULES names the layers adapt, their largest rank; 0 when none)."""
    names, rank = set(), 0
    for found in layers.values():
        for name, proj in zip(EXPERT_MODULES, (found.gate, found.up, found.down)):
            if proj is not None:
                names.add(name)
                rank = max(rank, proj.rank)
    return names, rank


def read_expert_formats(path: str | Path, shape: ExpertShape,
                        max_lora_rank: int) -> tuple[dict[int, ExpertLayerLoRA], list[str]]:
    """Detect the expert LoRA of a PEFT directory from its config and tensor header, reading no weights.

    Returns layer -> its expert LoRA, and the keys of the tensors that are not about experts (attention,
    dense MLPs), which are the dense loader's business. Raises AdapterError naming the tensor at fault.
    """
    path = Path(path)
    config = read_config(path)
    header, data_start = read_header(path)
    tensors = {key: StoredTensor(key, dtype, shape_, (data_start + begin, data_start + end))
               for key, (dtype, shape_, begin, end) in header.items()}
    return detect_expert_formats(tensors, config, shape, max_lora_rank)


def detect_expert_formats(tensors: dict[str, StoredTensor], config: dict, shape: ExpertShape,
                          max_lora_rank: int) -> tuple[dict[int, ExpertLayerLoRA], list[str]]:
    """`read_expert_formats` on an already read header (key -> StoredTensor) and adapter config."""
    groups: dict[int, dict[str, dict[tuple, StoredTensor]]] = {}
    others = []
    for key, tensor in tensors.items():
        if _ROUTER.search(key):
            raise AdapterError(f"adapter tensor {key!r} is LoRA on the MoE router, which is not supported; "
                               "train the adapter without the router (`gate`) as a target")
        found = _classify(key)
        if found is None:
            if _EXPERTS.search(key):
                raise AdapterError(f"adapter tensor {key!r} is an expert LoRA weight in a format that is not "
                                   "understood (supported: PEFT target_parameters on mlp.experts, per-expert "
                                   "gate/up/down modules, stacked 3-D expert tensors)")
            others.append(key)
            continue
        layer, fmt, index = found
        if layer >= shape.num_layers:
            raise AdapterError(f"adapter tensor {key!r} is for layer {layer}, but the base model has "
                               f"{shape.num_layers} layers")
        if layer in shape.dense_layers:
            raise AdapterError(f"adapter tensor {key!r} adapts experts of layer {layer}, which has a dense MLP "
                               "in the base model")
        groups.setdefault(layer, {}).setdefault(fmt, {})[index] = tensor
    layers = {}
    for layer, by_format in sorted(groups.items()):
        if len(by_format) > 1:
            second = next(iter(by_format[sorted(by_format)[1]].values())).key
            raise AdapterError(f"adapter tensor {second!r} mixes expert LoRA formats in layer {layer} "
                               f"({', '.join(sorted(by_format))}); one layer must use one")
        (fmt, found), = by_format.items()
        build = {"target_parameters": _peft_layer, "per_expert": _per_expert_layer, "stacked": _stacked_layer}[fmt]
        layers[layer] = build(layer, found, config, shape, max_lora_rank)
    return layers, others


def _classify(key: str) -> tuple[int, str, tuple] | None:
    """(layer, format, index within the layer's format) of an expert tensor key, or None."""
    if m := _PEFT.search(key):
        return int(m.group(1)), "target_parameters", (m.group(3).count("base_layer."), m.group(4))
    if m := _PER_EXPERT.search(key):
        return int(m.group(1)), "per_expert", (_NAMES[m.group(4)], int(m.group(3)), m.group(5), m.group(2), m.group(4))
    if m := _STACKED.search(key):
        return int(m.group(1)), "stacked", (_NAMES[m.group(3)], m.group(4), m.group(2), m.group(3))
    return None


def _peft_layer(layer: int, found: dict, config: dict, shape: ExpertShape, max_rank: int) -> ExpertLayerLoRA:
    """Format (a): pairs of 2-D lora_A [r*E, in] / lora_B [out, r*E], told apart by shape."""
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    depths = {depth for depth, _ in found}
    projections: dict[str, ExpertProjection] = {}
    for depth in sorted(depths):
        a, b = found.get((depth, "A")), found.get((depth, "B"))
        if a is None or b is None:
            missing = (a or b).key.replace("lora_A" if a else "lora_B", "lora_B" if a else "lora_A")
            raise AdapterError(f"adapter tensor {missing!r} is missing (its lora_A/lora_B pair is incomplete)")
        if len(a.shape) != 2 or len(b.shape) != 2 or (a.shape[1], b.shape[0]) not in ((h, 2 * i), (i, h)):
            raise AdapterError(f"adapter tensor {a.key!r} {list(a.shape)} with {b.key!r} {list(b.shape)} fits neither "
                               f"the experts' gate_up ([r*{e}, {h}], [{2 * i}, r*{e}]) nor down ([r*{e}, {i}], [{h}, r*{e}])")
        param = "gate_up_proj" if (a.shape[1], b.shape[0]) == (h, 2 * i) else "down_proj"
        module_key = f"model.layers.{layer}.mlp.experts.{param}"
        rank = _pattern_rank(config, module_key)
        if a.shape[0] != rank * e or b.shape[1] != rank * e:
            raise AdapterError(f"adapter tensor {a.key!r} {list(a.shape)} does not hold rank {rank} for each of the "
                               f"{e} experts (expected {rank * e} rows, and as many columns in {b.key!r})")
        _check_rank(a.key, rank, max_rank)
        scaling = module_scaling(config, module_key, rank)
        a_matrix = ExpertMatrix((e, rank, a.shape[1]), "peft_a", (a,))
        if param == "down_proj":
            projections["down"] = ExpertProjection(a_matrix, ExpertMatrix((e, h, rank), "peft_b", (b,)), rank, scaling)
        else:
            for n, name in enumerate(("gate", "up")):
                b_matrix = ExpertMatrix((e, i, rank), "peft_b", (b,), row_offset=n * i)
                projections[name] = ExpertProjection(a_matrix, b_matrix, rank, scaling)
    return ExpertLayerLoRA(layer, "target_parameters", *(projections.get(p) for p in PROJECTIONS))


def _pattern_rank(config: dict, module_key: str) -> int:
    """PEFT's rank for a module: the first rank_pattern key matching it, else r."""
    for pattern, value in (config.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            return value
    return config.get("r", 8)


def _per_expert_layer(layer: int, found: dict, config: dict, shape: ExpertShape, max_rank: int) -> ExpertLayerLoRA:
    """Format (b): one 2-D A [r, in] and B [out, r] per (projection, expert)."""
    projections = {}
    for proj in PROJECTIONS:
        keys = {(e, ab): t for (p, e, ab, *_), t in found.items() if p == proj}
        if not keys:
            continue
        fan_in, fan_out = _fans(proj, shape)
        ranks, scalings, a_sources, b_sources = set(), set(), [None] * shape.num_experts, [None] * shape.num_experts
        for (e, ab), t in sorted(keys.items()):
            other = keys.get((e, "B" if ab == "A" else "A"))
            if other is None:
                raise AdapterError(f"adapter tensor {t.key!r} has no lora_{'B' if ab == 'A' else 'A'} beside it")
            if e >= shape.num_experts:
                raise AdapterError(f"adapter tensor {t.key!r} is for expert {e}, but the base model has "
                                   f"{shape.num_experts} experts")
            a, b = (t, other) if ab == "A" else (other, t)
            if len(a.shape) != 2 or a.shape[1] != fan_in or b.shape != (fan_out, a.shape[0]):
                raise AdapterError(f"adapter tensor {t.key!r}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not "
                                   f"fit the expert's {proj} projection (expected [r, {fan_in}] and [{fan_out}, r])")
            _check_rank(a.key, a.shape[0], max_rank)
            module_key = a.key[:a.key.index(".lora_A")].split("base_model.model.")[-1]
            ranks.add(a.shape[0])
            scalings.add(module_scaling(config, module_key, a.shape[0]))
            a_sources[e], b_sources[e] = a, b
        if len(ranks) > 1 or len(scalings) > 1:
            raise AdapterError(f"adapter layer {layer}: the experts' {proj} LoRA differ in rank or scaling "
                               f"(ranks {sorted(ranks)}), e.g. tensor {next(iter(keys.values())).key!r}; "
                               "all experts of one projection must share them")
        (rank,), (scaling,) = ranks, scalings
        n = shape.num_experts
        projections[proj] = ExpertProjection(ExpertMatrix((n, rank, fan_in), "per_expert", tuple(a_sources)),
                                             ExpertMatrix((n, fan_out, rank), "per_expert", tuple(b_sources)),
                                             rank, scaling)
    return ExpertLayerLoRA(layer, "per_expert", *(projections.get(p) for p in PROJECTIONS))


def _stacked_layer(layer: int, found: dict, config: dict, shape: ExpertShape, max_rank: int) -> ExpertLayerLoRA:
    """Format (c): 3-D A [n, r, in] and B [n, out, r] per projection, n = E or 1."""
    projections = {}
    for proj in PROJECTIONS:
        keys = {ab: t for (p, ab, *_), t in found.items() if p == proj}
        if not keys:
            continue
        if len(keys) < 2:
            (t,) = keys.values()
            raise AdapterError(f"adapter tensor {t.key!r} has no lora_A/lora_B partner beside it")
        a, b = keys["A"], keys["B"]
        fan_in, fan_out = _fans(proj, shape)
        n_ok = (1, shape.num_experts)
        if (len(a.shape) != 3 or len(b.shape) != 3 or a.shape[0] not in n_ok or b.shape[0] not in n_ok
                or a.shape[2] != fan_in or b.shape[1:] != (fan_out, a.shape[1])):
            raise AdapterError(f"adapter tensor {a.key!r} {list(a.shape)} with {b.key!r} {list(b.shape)} does not fit "
                               f"the experts' {proj} projection (expected [{shape.num_experts} or 1, r, {fan_in}] and "
                               f"[{shape.num_experts} or 1, {fan_out}, r])")
        rank = a.shape[1]
        _check_rank(a.key, rank, max_rank)
        module_key = a.key[:a.key.index(".lora_A")].split("base_model.model.")[-1]
        projections[proj] = ExpertProjection(ExpertMatrix(a.shape, "stacked", (a,)),
                                             ExpertMatrix(b.shape, "stacked", (b,)),
                                             rank, module_scaling(config, module_key, rank))
    return ExpertLayerLoRA(layer, "stacked", *(projections.get(p) for p in PROJECTIONS))


def _fans(proj: str, shape: ExpertShape) -> tuple[int, int]:
    """(in_features, out_features) of one expert's projection."""
    h, i = shape.hidden_size, shape.intermediate_size
    return (i, h) if proj == "down" else (h, i)


def _check_rank(key: str, rank: int, max_lora_rank: int) -> None:
    if rank > max_lora_rank:
        raise AdapterError(f"LoRA rank {rank} of adapter tensor {key!r} is greater than max_lora_rank "
                           f"{max_lora_rank}. Raise --max-lora-rank to serve it.")
