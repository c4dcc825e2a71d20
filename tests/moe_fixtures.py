"""Tiny MoE models with expert-LoRA adapters (PEFT target_parameters), and slot packing for the MoE LoRA
reference: what the expert-format and reference tests share."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from worker.kernels.reference import MoELoRASlots
from worker.lora.formats.expert_lora import ExpertLayerLoRA, materialise
from worker.lora.targets import ExpertShape

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NUM_EXPERTS, TOP_K, HIDDEN, INTER, NUM_LAYERS = 4, 2, 64, 32, 2
SHAPE = ExpertShape(NUM_LAYERS, NUM_EXPERTS, HIDDEN, INTER)
TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@dataclass(frozen=True)
class ExpertAdapter:
    """A PEFT target_parameters adapter on the experts (random weights, init_lora_weights=False)."""
    name: str
    r: int
    alpha: float
    use_rslora: bool = False
    rank_pattern: dict | None = None
    alpha_pattern: dict | None = None


EXPERT_ADAPTERS = (
    ExpertAdapter("r2", 2, alpha=4),
    ExpertAdapter("r4-pattern", 4, alpha=8, rank_pattern={"down_proj": 2},
                  alpha_pattern={"gate_up_proj": 12, "layers.1.mlp.experts.down_proj": 20}),
    ExpertAdapter("r3-rs", 3, alpha=6, use_rslora=True, rank_pattern={"gate_up_proj": 5}),
)


def moe_config(family: str):
    """A tiny HF config: E=4, top-2, hidden 64, expert intermediate 32, 2 layers."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    common = {"vocab_size": 128, "hidden_size": HIDDEN, "num_hidden_layers": NUM_LAYERS, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_experts_per_tok": TOP_K, "initializer_range": 0.1}
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**common, moe_intermediate_size=INTER, intermediate_size=96, num_experts=NUM_EXPERTS,
                              head_dim=16, norm_topk_prob=True)
    return MixtralConfig(**common, intermediate_size=INTER, num_local_experts=NUM_EXPERTS)


def build_expert_adapters(family: str, root: Path):
    """A seeded float32 model of `family` wrapped by PEFT with every EXPERT_ADAPTERS entry, each saved under
    root/<name>. Returns the PeftModel (in eval mode) and name -> adapter directory."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(moe_config(family), dtype=torch.float32).eval()
    peft_model, paths = None, {}
    for i, spec in enumerate(EXPERT_ADAPTERS):
        torch.manual_seed(100 + i)
        cfg = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=[], target_parameters=TARGETS,
                         use_rslora=spec.use_rslora, rank_pattern=spec.rank_pattern or {},
                         alpha_pattern=spec.alpha_pattern or {}, init_lora_weights=False, lora_dropout=0.0)
        if peft_model is None:
            peft_model = get_peft_model(model, cfg, adapter_name=spec.name)
        else:
            peft_model.add_adapter(spec.name, cfg)
    with torch.no_grad():      # make each adapter's delta matter beside the base weights
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
    for spec in EXPERT_ADAPTERS:
        peft_model.save_pretrained(root / spec.name, selected_adapters=[spec.name])
        saved = root / spec.name / spec.name        # PEFT keeps a non-default adapter in a sub-folder
        paths[spec.name] = saved if saved.is_dir() else root / spec.name
    return peft_model.eval(), paths


def moe_block(peft_model, layer: int) -> torch.nn.Module:
    """Layer `layer`'s sparse MoE block (router + PEFT-wrapped experts) of a PeftModel."""
    return peft_model.base_model.model.model.layers[layer].mlp


def reference_slots(layers: list[tuple[ExpertLayerLoRA, Path] | None], shape: ExpertShape,
                    max_rank: int) -> MoELoRASlots:
    """Pack one layer of each adapter into MoELoRASlots (slot w = layers[w]; None = an empty slot).

    A shared-outer layer keeps its gate/up A's and down B in expert 0; any other matrix stored once for
    all experts (n = 1) is repeated over the experts."""
    n, e, h, i, r = len(layers), shape.num_experts, shape.hidden_size, shape.intermediate_size, max_rank
    gate_up_a, gate_up_b = torch.zeros(n, e, 2 * r, h), torch.zeros(n, e, 2 * i, r)
    down_a, down_b = torch.zeros(n, e, r, i), torch.zeros(n, e, h, r)
    ranks, scalings, shared = [[0, 0, 0] for _ in range(n)], torch.zeros(n, 3), [False] * n
    for w, entry in enumerate(layers):
        if entry is None:
            continue
        layer, file = entry
        shared[w] = layer.shared_outer
        for s, proj in enumerate((layer.gate, layer.up, layer.down)):
            if proj is None:
                continue
            a, b = materialise(proj.a, file), materialise(proj.b, file)   # [n_a, rank, in], [n_b, out, rank]
            if not (shared[w] and s < 2):
                a = a.expand(e, -1, -1)
            if not (shared[w] and s == 2):
                b = b.expand(e, -1, -1)
            k = proj.rank
            if s < 2:
                gate_up_a[w, :a.shape[0], s * r:s * r + k] = a
                gate_up_b[w, :, s * i:(s + 1) * i, :k] = b
            else:
                down_a[w, :, :k] = a
                down_b[w, :b.shape[0], :, :k] = b
            ranks[w][s], scalings[w, s] = k, proj.scaling
    return MoELoRASlots(gate_up_a, gate_up_b, down_a, down_b, ranks, scalings, shared)


def merged_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor, deltas: list[tuple[torch.Tensor, torch.Tensor] | None],
               token_adapters: list[int]) -> torch.Tensor:
    """An independent float32 MoE: token by token, each expert's weights merged with its adapter's delta.
    deltas[k] = (gate_up delta [E, 2I, H], down delta [E, H, I]) of adapter k; token_adapters[t] = k or -1."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e, k = int(topk_ids[t, j]), token_adapters[t]
            w13, w2 = gate_up[e].double(), down[e].double()
            if k >= 0 and deltas[k] is not None:
                w13, w2 = w13 + deltas[k][0][e].double(), w2 + deltas[k][1][e].double()
            g, u = (w13 @ x[t].double()).chunk(2)
            out[t] += float(topk_weights[t, j]) * (w2 @ (torch.nn.functional.silu(g) * u))
    return out.float()


# --- expert adapters on the engine's tiny MoE checkpoints (tests/hf_fixtures.build_hf_moe_model) ----------------

@dataclass(frozen=True)
class PeftExpertAdapter:
    """Format (a): PEFT target_parameters on the experts, with `modules` as target_modules beside them."""
    name: str
    r: int
    alpha: float
    modules: tuple[str, ...] = ()
    use_rslora: bool = False
    rank_pattern: dict | None = None


@dataclass(frozen=True)
class HandExpertAdapter:
    """Format (b) "per_expert" or (c) "stacked", written by hand: gate/up/down ranks, the layers adapted, the
    experts adapted (per_expert; None: all), shared-outer (stacked: gate/up A's and down B stored once)."""
    name: str
    format: str
    ranks: tuple[int, int, int]
    experts: tuple[int, ...] | None = None
    shared_outer: bool = False
    alpha: float = 16.0


def save_peft_expert_adapter(model_dir: Path, spec: PeftExpertAdapter, out: Path, seed: int) -> None:
    """A PEFT (a) adapter on the checkpoint in `model_dir`, random (init_lora_weights=False, lora_B scaled up)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cfg = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.modules), target_parameters=TARGETS,
                     use_rslora=spec.use_rslora, rank_pattern=spec.rank_pattern or {}, init_lora_weights=False,
                     lora_dropout=0.0)
    peft_model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0 if ".experts." in name else 20.0)
    peft_model.save_pretrained(out)


def save_hand_expert_adapter(spec: HandExpertAdapter, layers: list[int], shape: ExpertShape, mixtral_names: bool,
                             out: Path, seed: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Write a per-expert or stacked adapter on `layers`; returns layer -> its merged deltas (gate_up [E, 2I, H],
    down [E, H, I]), what PEFT would add to the experts' weights."""
    import json

    from safetensors.torch import save_file
    gen = torch.Generator().manual_seed(seed)
    e, h, i = shape.num_experts, shape.hidden_size, shape.intermediate_size
    block, names = ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral_names else ("mlp", ("gate_proj", "up_proj",
                                                                                          "down_proj"))
    tensors, deltas = {}, {}
    for layer in layers:
        gate_up, down = torch.zeros(e, 2 * i, h), torch.zeros(e, h, i)
        for s, (name, r) in enumerate(zip(names, spec.ranks)):
            fan_in, fan_out, scaling = (i, h, spec.alpha / r) if s == 2 else (h, i, spec.alpha / r)
            n_a = 1 if spec.shared_outer and s < 2 else e
            n_b = 1 if spec.shared_outer and s == 2 else e
            a = 0.25 * torch.randn(n_a, r, fan_in, generator=gen)            # [n_a, r, in]
            b = 0.25 * torch.randn(n_b, fan_out, r, generator=gen)           # [n_b, out, r]
            experts = range(e) if spec.experts is None or spec.format == "stacked" else spec.experts
            prefix = f"base_model.model.model.layers.{layer}.{block}.experts."
            if spec.format == "stacked":
                tensors[f"{prefix}{name}.lora_A.weight"], tensors[f"{prefix}{name}.lora_B.weight"] = a, b
            for x in experts:
                if spec.format == "per_expert":
                    tensors[f"{prefix}{x}.{name}.lora_A.weight"] = a[x]
                    tensors[f"{prefix}{x}.{name}.lora_B.weight"] = b[x]
                delta = scaling * b[min(x, n_b - 1)] @ a[min(x, n_a - 1)]      # [out, in]
                if s == 2:
                    down[x] = delta
                else:
                    gate_up[x, s * i:(s + 1) * i] = delta
        deltas[layer] = (gate_up, down)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": max(spec.ranks),
                                                         "lora_alpha": spec.alpha, "target_modules": list(names)}))
    return deltas


def merged_hf_model(model_dir: Path, deltas: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> torch.nn.Module:
    """The HF model with each layer's expert deltas added to its fused expert weights (the reference of (b), (c))."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        for layer, (gate_up, down) in deltas.items():
            experts = model.model.layers[layer].mlp.experts
            experts.gate_up_proj += gate_up
            experts.down_proj += down
    return model.eval()
