"""Expert LoRA formats: PEFT target_parameters adapters read as PEFT itself reads them (expert e's rows of A,
columns of B, ranks and scalings), per-expert and stacked / shared-outer adapters computed as an independent
merged-weight MoE computes them, and every tensor not understood refused with its name."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.moe_fixtures import (
    EXPERT_ADAPTERS,
    HIDDEN,
    INTER,
    NUM_EXPERTS,
    SHAPE,
    TOP_K,
    build_expert_adapters,
    merged_moe,
    moe_block,
    reference_slots,
)
from worker.kernels.reference import moe_lora_experts
from worker.lora.adapter import AdapterError
from worker.lora.formats.expert_lora import materialise
from worker.lora.formats.experts import read_expert_formats
from worker.lora.safetensors_file import tensor_file

FAMILIES = ("qwen3_moe", "mixtral")
PREFIX = "base_model.model.model.layers.{l}."
NAMES = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
         "mixtral": ("block_sparse_moe", "w1", "w3", "w2")}


@pytest.fixture(scope="module", params=FAMILIES)
def peft_adapters(request, tmp_path_factory):
    model, paths = build_expert_adapters(request.param, tmp_path_factory.mktemp(request.param))
    return model, paths


def _write(path, tensors: dict[str, torch.Tensor], **config) -> None:
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16, **config}))


@pytest.mark.parametrize("spec", EXPERT_ADAPTERS, ids=lambda s: s.name)
def test_target_parameters_expert_blocks_equal_peft_deltas(peft_adapters, spec):
    model, paths = peft_adapters
    layers, others = read_expert_formats(paths[spec.name], SHAPE, max_lora_rank=16)
    file = tensor_file(paths[spec.name])
    assert others == [] and sorted(layers) == [0, 1]
    for layer, found in layers.items():
        down_wrapper = moe_block(model, layer).experts            # the outer ParamWrapper: down_proj
        gate_up_wrapper = down_wrapper.base_layer                  # the inner one: gate_up_proj
        assert (gate_up_wrapper.parameter_name, down_wrapper.parameter_name) == ("gate_up_proj", "down_proj")
        assert found.format == "target_parameters" and not found.shared_outer
        for proj, wrapper in ((found.gate, gate_up_wrapper), (found.up, gate_up_wrapper), (found.down, down_wrapper)):
            assert proj.rank == wrapper.r[spec.name] and proj.scaling == pytest.approx(wrapper.scaling[spec.name])
        deltas = [p.scaling * materialise(p.b, file) @ materialise(p.a, file) for p in (found.gate, found.up, found.down)]
        with torch.no_grad():
            want_gate_up = gate_up_wrapper.get_delta_weight(spec.name)   # [E, 2I, H]
            want_down = down_wrapper.get_delta_weight(spec.name)         # [E, H, I]
        torch.testing.assert_close(torch.cat(deltas[:2], dim=1), want_gate_up, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(deltas[2], want_down, rtol=1e-5, atol=1e-6)


def _per_expert_tensors(family: str, ranks: tuple[int, int, int], experts: range, gen: torch.Generator):
    """Hand-made per-expert LoRA on layer 0 and its merged deltas (gate_up [E, 2I, H], down [E, H, I])."""
    block, *names = NAMES[family]
    tensors, gate_up, down = {}, torch.zeros(NUM_EXPERTS, 2 * INTER, HIDDEN), torch.zeros(NUM_EXPERTS, HIDDEN, INTER)
    for e in experts:
        for s, (name, r) in enumerate(zip(names, ranks)):
            fan_in, fan_out = (INTER, HIDDEN) if s == 2 else (HIDDEN, INTER)
            a, b = 0.3 * torch.randn(r, fan_in, generator=gen), 0.3 * torch.randn(fan_out, r, generator=gen)
            key = PREFIX.format(l=0) + f"{block}.experts.{e}.{name}"
            tensors[f"{key}.lora_A.weight"], tensors[f"{key}.lora_B.weight"] = a, b
            scaling = 16 / r
            if s == 2:
                down[e] = scaling * b @ a
            else:
                gate_up[e, s * INTER:(s + 1) * INTER] = scaling * b @ a
    return tensors, (gate_up, down)


def _check_forward(path, deltas, gen: torch.Generator, layer: int = 0, num_tokens: int = 7) -> None:
    """The reference on the parsed adapter equals the merged-weight MoE, rows with and without it."""
    layers, _ = read_expert_formats(path, SHAPE, max_lora_rank=16)
    gate_up, down = 0.1 * torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen), \
        0.1 * torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    topk_weights = torch.rand(num_tokens, TOP_K, generator=gen)
    topk_ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    rows = [0, -1, 0, 0, -1, 0, 0][:num_tokens]
    slots = reference_slots([(layers[layer], tensor_file(path))], SHAPE, max_rank=8)
    got = moe_lora_experts(x, gate_up, down, topk_weights, topk_ids, rows, slots)
    want = merged_moe(x, gate_up, down, topk_weights, topk_ids, [deltas], rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ranks", [(4, 4, 4), (3, 5, 2)], ids=["same", "own-ranks"])
@pytest.mark.parametrize("experts", [range(NUM_EXPERTS), range(1, 3)], ids=["all", "some-experts"])
def test_per_expert_modules_compute_merged_experts(family, ranks, experts, tmp_path):
    gen = torch.Generator().manual_seed(sum(ranks) + len(experts))
    tensors, deltas = _per_expert_tensors(family, ranks, experts, gen)
    _write(tmp_path, tensors)
    layers, _ = read_expert_formats(tmp_path, SHAPE, max_lora_rank=16)
    found = layers[0]
    assert found.format == "per_expert" and (found.gate.rank, found.up.rank, found.down.rank) == ranks
    assert [found.gate.scaling, found.down.scaling] == [16 / ranks[0], 16 / ranks[2]]
    _check_forward(tmp_path, deltas, gen)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("shared", [True, False], ids=["shared-outer", "stacked"])
def test_stacked_and_shared_outer_compute_merged_experts(family, shared, tmp_path):
    gen, (block, *names), r = torch.Generator().manual_seed(7), NAMES[family], 4
    n_outer = 1 if shared else NUM_EXPERTS
    gate_a, gate_b = 0.3 * torch.randn(n_outer, r, HIDDEN, generator=gen), 0.3 * torch.randn(NUM_EXPERTS, INTER, r, generator=gen)
    up_a, up_b = 0.3 * torch.randn(n_outer, r, HIDDEN, generator=gen), 0.3 * torch.randn(NUM_EXPERTS, INTER, r, generator=gen)
    down_a, down_b = 0.3 * torch.randn(NUM_EXPERTS, r, INTER, generator=gen), 0.3 * torch.randn(n_outer, HIDDEN, r, generator=gen)
    key = PREFIX.format(l=1) + f"{block}.experts."
    tensors = {}
    for name, a, b in zip(names, (gate_a, up_a, down_a), (gate_b, up_b, down_b)):
        tensors[f"{key}{name}.lora_A.weight"], tensors[f"{key}{name}.lora_B.weight"] = a, b
    _write(tmp_path, tensors, alpha_pattern={"w2|down_proj": 4})
    layers, _ = read_expert_formats(tmp_path, SHAPE, max_lora_rank=16)
    assert sorted(layers) == [1] and layers[1].format == "stacked" and layers[1].shared_outer == shared
    assert (layers[1].gate.scaling, layers[1].down.scaling) == (4.0, 1.0)
    expand = lambda t: t.expand(NUM_EXPERTS, -1, -1)
    gate_up = torch.cat([4.0 * gate_b @ expand(gate_a), 4.0 * up_b @ expand(up_a)], dim=1)
    deltas = (gate_up, 1.0 * expand(down_b) @ down_a)
    _check_forward(tmp_path, deltas, gen, layer=1)


def test_non_expert_tensors_are_left_to_the_dense_loader(tmp_path):
    tensors, _ = _per_expert_tensors("qwen3_moe", (2, 2, 2), range(1), torch.Generator().manual_seed(0))
    dense = PREFIX.format(l=0) + "self_attn.q_proj.lora_A.weight"
    _write(tmp_path, {**tensors, dense: torch.zeros(2, HIDDEN)})
    layers, others = read_expert_formats(tmp_path, SHAPE, max_lora_rank=16)
    assert others == [dense] and sorted(layers) == [0]


def _refusal_cases() -> dict[str, tuple[dict[str, torch.Tensor], str]]:
    """name -> (tensors, the key the error must name)."""
    e, l0 = NUM_EXPERTS, PREFIX.format(l=0)
    good_a, good_b = l0 + "mlp.experts.base_layer.lora_A.weight", l0 + "mlp.experts.base_layer.lora_B.weight"
    router = l0 + "mlp.gate.lora_A.weight"
    mixtral_router = l0 + "block_sparse_moe.gate.lora_B.weight"
    fused = l0 + "mlp.experts.gate_up_proj.lora_A.weight"
    bias = l0 + "mlp.experts.0.gate_proj.lora_A.bias"
    per_a, per_b = l0 + "mlp.experts.0.up_proj.lora_A.weight", l0 + "mlp.experts.0.up_proj.lora_B.weight"
    st_a, st_b = l0 + "mlp.experts.down_proj.lora_A.weight", l0 + "mlp.experts.down_proj.lora_B.weight"
    far = PREFIX.format(l=5) + "mlp.experts.0.up_proj.lora_A.weight"
    return {
        "router": ({router: torch.zeros(2, HIDDEN)}, router),
        "mixtral-router": ({mixtral_router: torch.zeros(e, 2)}, mixtral_router),
        "fused-gate-up-name": ({fused: torch.zeros(e, 2, HIDDEN)}, fused),
        "bias": ({bias: torch.zeros(2)}, bias),
        "peft-rank-not-r-times-experts": ({good_a: torch.zeros(8 * e + 1, HIDDEN),
                                           good_b: torch.zeros(2 * INTER, 8 * e + 1)}, good_a),
        "peft-fits-no-projection": ({good_a: torch.zeros(8 * e, HIDDEN + 1), good_b: torch.zeros(2 * INTER, 8 * e)},
                                    good_a),
        "peft-missing-b": ({good_a: torch.zeros(8 * e, HIDDEN)}, good_b),
        "per-expert-wrong-in": ({per_a: torch.zeros(2, HIDDEN + 1), per_b: torch.zeros(INTER, 2)}, per_a),
        "per-expert-missing-b": ({per_a: torch.zeros(2, HIDDEN)}, per_a),
        "stacked-expert-dim": ({st_a: torch.zeros(2, 2, INTER), st_b: torch.zeros(2, HIDDEN, 2)}, st_a),
        "stacked-2d": ({st_a: torch.zeros(2, INTER), st_b: torch.zeros(HIDDEN, 2)}, st_a),
        "layer-past-model": ({far: torch.zeros(2, HIDDEN)}, far),
        "rank-over-max": ({per_a: torch.zeros(32, HIDDEN), per_b: torch.zeros(INTER, 32)}, per_a),
    }


@pytest.mark.parametrize("case", sorted(_refusal_cases()))
def test_unsupported_expert_tensors_are_refused_by_name(case, tmp_path):
    tensors, key = _refusal_cases()[case]
    _write(tmp_path, tensors)
    with pytest.raises(AdapterError) as raised:
        read_expert_formats(tmp_path, SHAPE, max_lora_rank=16)
    assert key in str(raised.value)


def test_expert_tensors_on_a_dense_layer_are_refused(tmp_path):
    tensors, _ = _per_expert_tensors("qwen3_moe", (2, 2, 2), range(1), torch.Generator().manual_seed(0))
    _write(tmp_path, tensors)
    with pytest.raises(AdapterError, match="dense MLP") as raised:
        read_expert_formats(tmp_path, replace(SHAPE, dense_layers=(0,)), max_lora_rank=16)
    assert "layers.0.mlp.experts.0" in str(raised.value)


def test_experts_of_one_projection_with_different_ranks_are_refused(tmp_path):
    l0 = PREFIX.format(l=0) + "mlp.experts."
    _write(tmp_path, {l0 + "0.gate_proj.lora_A.weight": torch.zeros(2, HIDDEN),
                      l0 + "0.gate_proj.lora_B.weight": torch.zeros(INTER, 2),
                      l0 + "1.gate_proj.lora_A.weight": torch.zeros(4, HIDDEN),
                      l0 + "1.gate_proj.lora_B.weight": torch.zeros(INTER, 4)})
    with pytest.raises(AdapterError, match="differ in rank"):
        read_expert_formats(tmp_path, SHAPE, max_lora_rank=16)


def test_one_layer_mixing_formats_is_refused(tmp_path):
    l0 = PREFIX.format(l=0) + "mlp.experts."
    _write(tmp_path, {l0 + "0.gate_proj.lora_A.weight": torch.zeros(2, HIDDEN),
                      l0 + "0.gate_proj.lora_B.weight": torch.zeros(INTER, 2),
                      l0 + "up_proj.lora_A.weight": torch.zeros(1, 2, HIDDEN),
                      l0 + "up_proj.lora_B.weight": torch.zeros(NUM_EXPERTS, INTER, 2)})
    with pytest.raises(AdapterError, match="mixes expert LoRA formats"):
        read_expert_formats(tmp_path, SHAPE, max_lora_rank=16)


def test_target_parameters_pairs_are_told_apart_by_shape_not_nesting(peft_adapters, tmp_path):
    """With the wrappers' names swapped (down as base_layer), each pair still lands on its projection."""
    _, paths = peft_adapters
    source = paths["r4-pattern"]
    tensors = load_file(str(source / "adapter_model.safetensors"))
    swap = {".experts.base_layer.lora_": ".experts.lora_", ".experts.lora_": ".experts.base_layer.lora_"}
    renamed = {}
    for key, value in tensors.items():
        old = next(s for s in swap if s in key)
        renamed[key.replace(old, swap[old])] = value
    shutil.copytree(source, tmp_path / "swapped")
    save_file(renamed, str(tmp_path / "swapped" / "adapter_model.safetensors"))
    want, _ = read_expert_formats(source, SHAPE, max_lora_rank=16)
    got, _ = read_expert_formats(tmp_path / "swapped", SHAPE, max_lora_rank=16)
    for layer in want:
        for proj in ("gate", "up", "down"):
            a, b = getattr(want[layer], proj), getattr(got[layer], proj)
            assert (a.rank, a.scaling) == (b.rank, b.scaling)
            assert torch.equal(materialise(a.b, tensor_file(source)), materialise(b.b, tensor_file(tmp_path / "swapped")))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_files_read_as_float32(dtype, tmp_path):
    gen = torch.Generator().manual_seed(5)
    tensors, _ = _per_expert_tensors("mixtral", (2, 3, 4), range(NUM_EXPERTS), gen)
    _write(tmp_path, {k: v.to(dtype) for k, v in tensors.items()})
    layers, _ = read_expert_formats(tmp_path, SHAPE, max_lora_rank=16)
    key = PREFIX.format(l=0) + "block_sparse_moe.experts.{e}.w3.lora_B.weight"
    up_b = materialise(layers[0].up.b, tensor_file(tmp_path))                  # [E, I, 3]
    assert up_b.dtype == torch.float32
    assert torch.equal(up_b, torch.stack([tensors[key.format(e=e)].to(dtype).float() for e in range(NUM_EXPERTS)]))
