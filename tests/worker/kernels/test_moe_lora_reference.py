"""reference.moe_lora_experts, the MoE LoRA math the Triton kernels are checked against: equal to PEFT's
MoE block for every adapter and for mixed batches (each row against its own adapter), equal to an independent
merged-weight MoE for random slots (mixed ranks, shared outer, projections left alone), and exactly
moe_experts on rows without an adapter."""
from __future__ import annotations

import random

import pytest
import torch

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
from worker.kernels.reference import MoELoRASlots, moe_experts, moe_lora_experts
from worker.lora.formats.experts import read_expert_formats
from worker.lora.safetensors_file import tensor_file

NAMES = [spec.name for spec in EXPERT_ADAPTERS]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def peft_moe(request, tmp_path_factory):
    """(PeftModel with every expert adapter, name -> (layer -> ExpertLayerLoRA, tensor file))."""
    model, paths = build_expert_adapters(request.param, tmp_path_factory.mktemp(request.param))
    parsed = {name: (read_expert_formats(path, SHAPE, max_lora_rank=16)[0], tensor_file(path))
              for name, path in paths.items()}
    return model, parsed


def _experts_base(block) -> tuple[torch.Tensor, torch.Tensor]:
    """The base expert weights under PEFT's two nested wrappers: gate_up [E, 2I, H], down [E, H, I]."""
    experts = block.experts.get_base_layer()
    return experts.gate_up_proj.detach(), experts.down_proj.detach()


def _peft_rows(model, block, x: torch.Tensor, adapter: str | None) -> torch.Tensor:
    """PEFT's MoE block output for x [T, H] under one adapter (None: adapters disabled)."""
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                return block(x[None])[0]
        model.set_adapter(adapter)
        return block(x[None])[0]


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("layer", [0, 1])
@pytest.mark.parametrize("adapter", NAMES)
def test_one_adapter_equals_peft_block(peft_moe, adapter, layer):
    model, parsed = peft_moe
    block = moe_block(model, layer)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(layer))
    with torch.no_grad():
        _, topk_weights, topk_ids = block.gate(x)
        layers, file = parsed[adapter]
        slots = reference_slots([(layers[layer], file)], SHAPE, max_rank=8)
        got = moe_lora_experts(x, *_experts_base(block), topk_weights, topk_ids, [0] * len(x), slots)
    want = _peft_rows(model, block, x, adapter)
    assert _relative_error(got, want) <= 1e-5
    assert _relative_error(got, _peft_rows(model, block, x, None)) > 1e-2     # the adapter matters


def _mix(popularity: str, num_tokens: int, rng: random.Random) -> list[int]:
    """Per-token adapter index into NAMES (-1: none)."""
    choices = list(range(-1, len(NAMES)))
    if popularity == "distinct":
        return [choices[t % len(choices)] for t in range(num_tokens)]
    if popularity == "uniform":
        return [rng.choice(choices) for _ in range(num_tokens)]
    if popularity == "zipf":
        return rng.choices(choices, weights=[1 / (k + 1) for k in range(len(choices))], k=num_tokens)
    if popularity == "identical":
        return [1] * num_tokens
    return [-1] * num_tokens


@pytest.mark.parametrize("popularity", ["distinct", "uniform", "zipf", "identical", "base-only"])
@pytest.mark.parametrize("num_tokens", [1, 2, 17])
def test_mixed_batch_rows_equal_their_own_peft_adapter(peft_moe, popularity, num_tokens):
    model, parsed = peft_moe
    rng = random.Random(num_tokens)
    rows = _mix(popularity, num_tokens, rng)
    order = [2, 0, 1]                                     # slot w holds adapter order[w]: slots != adapter ids
    token_lora_slots = [order.index(k) if k >= 0 else -1 for k in rows]
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    for layer in (0, 1):
        block = moe_block(model, layer)
        with torch.no_grad():
            _, topk_weights, topk_ids = block.gate(x)
            slots = reference_slots([(parsed[NAMES[k]][0][layer], parsed[NAMES[k]][1]) for k in order], SHAPE, 8)
            got = moe_lora_experts(x, *_experts_base(block), topk_weights, topk_ids, token_lora_slots, slots)
        want = torch.stack([_peft_rows(model, block, x, NAMES[k] if k >= 0 else None)[t]
                            for t, k in enumerate(rows)])
        assert _relative_error(got, want) <= 1e-5


def _random_slots(gen: torch.Generator, ranks: list[list[int]], shared: list[bool], max_rank: int = 8):
    """Random MoELoRASlots, each slot at its own ranks (zeros past them), with its merged deltas."""
    n, e, h, i, r = len(ranks), NUM_EXPERTS, HIDDEN, INTER, max_rank
    slots = MoELoRASlots(torch.zeros(n, e, 2 * r, h), torch.zeros(n, e, 2 * i, r), torch.zeros(n, e, r, i),
                         torch.zeros(n, e, h, r), ranks, 0.5 + torch.rand(n, 3, generator=gen), shared)
    deltas = []
    for w in range(n):
        gate_up = torch.zeros(e, 2 * i, h)
        for s in range(2):
            k = ranks[w][s]
            a = 0.3 * torch.randn(1 if shared[w] else e, k, h, generator=gen)
            b = 0.3 * torch.randn(e, i, k, generator=gen)
            slots.gate_up_a[w, :a.shape[0], s * r:s * r + k] = a
            slots.gate_up_b[w, :, s * i:(s + 1) * i, :k] = b
            gate_up[:, s * i:(s + 1) * i] = slots.scalings[w, s] * b @ a.expand(e, -1, -1)
        k = ranks[w][2]
        a, b = 0.3 * torch.randn(e, k, i, generator=gen), 0.3 * torch.randn(1 if shared[w] else e, h, k, generator=gen)
        slots.down_a[w, :, :k], slots.down_b[w, :b.shape[0], :, :k] = a, b
        deltas.append((gate_up, slots.scalings[w, 2] * b.expand(e, -1, -1) @ a))
    return slots, deltas


@pytest.mark.parametrize("shared", ["none", "all", "some"])
@pytest.mark.parametrize("ranks", [[[8, 8, 8]], [[1, 1, 1], [8, 4, 2], [3, 0, 5], [0, 0, 6]]],
                         ids=["one-r8", "mixed-ranks"])
@pytest.mark.parametrize("popularity", ["distinct", "uniform", "identical"])
def test_random_slots_equal_merged_weights(shared, ranks, popularity):
    gen = torch.Generator().manual_seed(len(ranks) + len(popularity))
    flags = [shared == "all" or (shared == "some" and w % 2 == 0) for w in range(len(ranks))]
    slots, deltas = _random_slots(gen, ranks, flags)
    num_tokens = 23
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    gate_up, down = 0.1 * torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen), \
        0.1 * torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen)
    topk_weights, topk_ids = torch.rand(num_tokens, NUM_EXPERTS, generator=gen).softmax(-1).topk(TOP_K, dim=-1)
    rng = random.Random(len(ranks))
    choices = list(range(-1, len(ranks)))
    token_lora_slots = {"distinct": [choices[t % len(choices)] for t in range(num_tokens)],
                   "uniform": [rng.choice(choices) for _ in range(num_tokens)],
                   "identical": [len(ranks) - 1] * num_tokens}[popularity]
    got = moe_lora_experts(x, gate_up, down, topk_weights, topk_ids, token_lora_slots, slots)
    want = merged_moe(x, gate_up, down, topk_weights, topk_ids, deltas, token_lora_slots)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_without_adapter_are_exactly_moe_experts(dtype):
    gen = torch.Generator().manual_seed(3)
    slots, _ = _random_slots(gen, [[4, 4, 4], [2, 8, 1]], [False, True])
    x = torch.randn(11, HIDDEN, generator=gen).to(dtype)
    gate_up = (0.1 * torch.randn(NUM_EXPERTS, 2 * INTER, HIDDEN, generator=gen)).to(dtype)
    down = (0.1 * torch.randn(NUM_EXPERTS, HIDDEN, INTER, generator=gen)).to(dtype)
    topk_weights, topk_ids = torch.rand(11, NUM_EXPERTS, generator=gen).softmax(-1).topk(TOP_K, dim=-1)
    token_lora_slots = [0, -1, 1, -1, -1, 0, 1, -1, 0, -1, 1]
    got = moe_lora_experts(x, gate_up, down, topk_weights, topk_ids, token_lora_slots, slots)
    base_rows = torch.tensor([w < 0 for w in token_lora_slots])
    assert torch.equal(got[base_rows], moe_experts(x, gate_up, down, topk_weights, topk_ids)[base_rows])
    assert torch.equal(moe_lora_experts(x, gate_up, down, topk_weights, topk_ids, [-1] * 11, slots),
                       moe_experts(x, gate_up, down, topk_weights, topk_ids))
