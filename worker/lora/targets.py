"""What a model's adapters may adapt: the model's LoRA targets, one table computed from its architecture alone.

Each model class declares it (`LlamaForCausalLM.lora_targets(cfg)`, extended by the MoE classes;
`models/builder.lora_targets(cfg)` picks the class), so an adapter is validated without building the model. Adapter
validation (lora/adapter.py), the tensor formats (lora/formats/) and the slot layout (lora/slot_layout.py) read it.
Running example, a Qwen2-MoE layer l that is sparse, with a shared expert (hidden H, shared intermediate S):

    LoRATarget("qkv_proj", "self_attn", ("q_proj", "k_proj", "v_proj"), H, (Q, KV, KV))
        PEFT's base_model.model.model.layers.l.self_attn.k_proj.lora_A.weight is slice 1 of layer l's qkv_proj
    LoRATarget("o_proj", "self_attn", ("o_proj",), Q, (H,))
    LoRATarget("shared_expert.gate_up_proj", "mlp", ("shared_expert.gate_proj", "shared_expert.up_proj"), H, (S, S))
    LoRATarget("shared_expert.down_proj", "mlp", ("shared_expert.down_proj",), S, (H,))
    and its routed experts (ExpertShape), named experts.gate_proj, experts.up_proj, experts.down_proj

Shapes are the whole model's; a tensor-parallel rank's share of a projection is the built model's
(`model.projection(layer, name)`, lora/shards.py). Pure Python: the bookkeeping may import it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

# the names AdapterSpec.target_modules (GET /v1/adapters) gives the experts' projections, whatever the format
EXPERT_MODULES = ("experts.gate_proj", "experts.up_proj", "experts.down_proj")


@dataclass(frozen=True)
class LoRATarget:
    """A projection of a decoder layer that takes LoRA, and the checkpoint modules packed into it, one slice each."""
    projection: str                 # our fused projection, as model.projection(layer, name) finds it
    block: str                      # the layer's submodule the checkpoint modules sit in: "self_attn", "mlp"
    modules: tuple[str, ...]        # the checkpoint modules packed into it, in slice order, named under `block`
    in_features: int
    out_features: tuple[int, ...]   # each module's (slice's) output width

    def path(self, module: str) -> str:
        """A packed module's name under its decoder layer: "self_attn.q_proj", "mlp.shared_expert.down_proj"."""
        return f"{self.block}.{module}"


@dataclass(frozen=True)
class ExpertShape:
    """The routed experts of a model's sparse MoE layers, which expert LoRA must fit (lora/formats/experts.py)."""
    num_layers: int
    num_experts: int
    hidden_size: int
    intermediate_size: int               # per expert (moe_intermediate_size)
    dense_layers: tuple[int, ...] = ()   # layers with a dense MLP instead of experts
    block: str = "mlp"                   # the layer submodule holding the experts (and a shared expert)

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(layer for layer in range(self.num_layers) if layer not in self.dense_layers)


@dataclass(frozen=True)
class LoRATargets:
    """A model's LoRA targets: every projection that takes LoRA (in the order adapters list their modules), which
    of them each decoder layer has (in slot-layout order), and the routed experts of its sparse layers."""
    architecture: str
    projections: tuple[LoRATarget, ...]
    layers: tuple[tuple[str, ...], ...]      # [num_layers]: the projections each layer has, by name
    experts: ExpertShape | None = None       # None: a dense model
    # modules of the model that take no LoRA, refused with the reason: path under a layer -> why
    unsupported: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        names = {t.projection for t in self.projections}
        missing = sorted({name for layer in self.layers for name in layer} - names)
        assert not missing, f"layers name projections the table lacks: {missing}"

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @cached_property
    def _by_name(self) -> dict[str, LoRATarget]:
        return {t.projection: t for t in self.projections}

    @cached_property
    def _by_path(self) -> list[dict[str, tuple[LoRATarget, int]]]:
        return [{t.path(m): (t, s) for t in self.at(layer) for s, m in enumerate(t.modules)}
                for layer in range(self.num_layers)]

    def target(self, projection: str) -> LoRATarget:
        return self._by_name[projection]

    def at(self, layer: int) -> tuple[LoRATarget, ...]:
        """Layer `layer`'s projections that take LoRA, in slot-layout order."""
        return tuple(self._by_name[name] for name in self.layers[layer])

    def layer_projections(self) -> list[tuple[int, str]]:
        """Every (layer, projection) that takes LoRA, in slot-layout order."""
        return [(layer, name) for layer, names in enumerate(self.layers) for name in names]

    def find(self, layer: int, path: str) -> tuple[LoRATarget, int] | None:
        """(projection, slice) that the checkpoint module `path` of layer `layer` packs into; None where that layer
        lacks it (or there is no such layer)."""
        return self._by_path[layer].get(path) if 0 <= layer < self.num_layers else None

    def packing(self, layer: int, module: str) -> tuple[LoRATarget, int]:
        """(projection, slice) of a module of layer `layer` as AdapterSpec names it ("q_proj"); KeyError if none."""
        for target in self.at(layer):
            if module in target.modules:
                return target, target.modules.index(module)
        raise KeyError(f"layer {layer} has no LoRA target {module!r}")

    @cached_property
    def modules(self) -> tuple[str, ...]:
        """Every module an adapter may adapt, as AdapterSpec.target_modules names them, in the order it lists them."""
        dense = tuple(m for t in self.projections for m in t.modules)
        return dense + (EXPERT_MODULES if self.experts is not None else ())

    @cached_property
    def blocks(self) -> tuple[str, ...]:
        """The layer submodules that hold targets: ("self_attn", "mlp")."""
        experts = (self.experts.block,) if self.experts is not None else ()
        return tuple(dict.fromkeys(tuple(t.block for t in self.projections) + experts))

    @cached_property
    def short_names(self) -> tuple[str, ...]:
        """The modules' last names, once each (PEFT matches target_modules entries as name suffixes): q_proj ..."""
        return tuple(dict.fromkeys(m.rsplit(".", 1)[-1] for m in self.modules))
