"""The expert regions of a slot (lora/expert_layout.py): each format packed into the slot equals the MoE-LoRA
reference's own packing (tests/moe_fixtures.reference_slots), the views are strided views of the slots, and an
adapter without expert LoRA leaves the regions zero whichever way it is read."""
from __future__ import annotations

import pytest
import torch

from tests.hf_fixtures import adapter_dir
from tests.moe_fixtures import (EXPERT_ADAPTERS, SHAPE, HandExpertAdapter, build_expert_adapters, reference_slots,
                                save_hand_expert_adapter)
from worker.config import KernelConfig
from worker.lora.adapter import inspect_adapter, locate_adapter, read_adapter
from worker.lora.expert_layout import ALIGN
from worker.lora.formats import read_expert_formats
from worker.lora.safetensors_file import tensor_file
from worker.lora.slot_layout import PackedReader, SlotLayout
from worker.models.hf_config import ArchConfig
from worker.models.registry import build_model

MAX_RANK = 8
HAND = (HandExpertAdapter("per-expert", "per_expert", (3, 5, 2), experts=(1, 3)),
        HandExpertAdapter("stacked", "stacked", (4, 2, 6)),
        HandExpertAdapter("shared-outer", "stacked", (6, 6, 4), shared_outer=True))


@pytest.fixture(scope="module")
def moe_model(hf_moe_models):
    """Our Qwen3-MoE on the tiny checkpoint (E=4, hidden 64, expert intermediate 32, 2 sparse layers: SHAPE)."""
    path = hf_moe_models["qwen3_moe"]
    return path, build_model(path, torch.float32, torch.device("cpu"), "auto", 256, KernelConfig())


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict:
    """name -> directory: the PEFT target_parameters adapters of moe_fixtures, and HAND."""
    root = tmp_path_factory.mktemp("expert-layout")
    _, paths = build_expert_adapters("qwen3_moe", root / "peft")
    for i, spec in enumerate(HAND):
        paths[spec.name] = root / spec.name
        save_hand_expert_adapter(spec, [0, 1], SHAPE, mixtral_names=i == 1, out=paths[spec.name], seed=i)
    return paths


def _pack(path, model_dir, layout: SlotLayout) -> torch.Tensor:
    arch = ArchConfig.from_dir(model_dir)
    spec = inspect_adapter("a", path, arch, MAX_RANK)
    entry = PackedReader(arch, layout, pin=False)(spec)
    assert entry.rank == spec.rank
    return entry.packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_format_packs_as_the_reference_packs_it(moe_model, adapters, dtype):
    """Slots hold [empty, each adapter in turn]; every sparse layer's views equal reference_slots (cast)."""
    model_dir, model = moe_model
    layout = SlotLayout(model, MAX_RANK, dtype)
    names = [a.name for a in EXPERT_ADAPTERS] + [a.name for a in HAND]
    slots = torch.stack([torch.zeros(layout.num_bytes, dtype=torch.uint8)]
                        + [_pack(adapters[n], model_dir, layout) for n in names])    # [S, num_bytes]
    found = {n: read_expert_formats(adapters[n], SHAPE, MAX_RANK)[0] for n in names}
    views = layout.expert_views(slots)
    assert sorted(views) == [0, 1]
    for layer, w in views.items():
        want = reference_slots([None] + [(found[n][layer], tensor_file(adapters[n])) for n in names], SHAPE, MAX_RANK)
        for field in ("gate_up_a", "gate_up_b", "down_a", "down_b"):
            assert torch.equal(getattr(w, field), getattr(want, field).to(dtype)), (layer, field)
        assert torch.equal(w.scalings, want.scalings)
        assert w.shared_outer.tolist() == [int(flag) for flag in want.shared_outer]
        assert want.shared_outer == [False, False, False, False, False, False, True]


def test_expert_views_are_aligned_strided_views_of_the_slots(moe_model):
    _, model = moe_model
    layout = SlotLayout(model, MAX_RANK, torch.bfloat16)
    slots = torch.zeros(3, layout.num_bytes, dtype=torch.uint8)
    e, h, i, r = SHAPE.num_experts, SHAPE.hidden_size, SHAPE.intermediate_size, MAX_RANK
    row = layout.num_bytes // 2                       # a slot's length in bf16 elements
    for w in layout.expert_views(slots).values():
        assert (w.gate_up_a.shape, w.gate_up_b.shape) == ((3, e, 2 * r, h), (3, e, 2 * i, r))
        assert (w.down_a.shape, w.down_b.shape) == ((3, e, r, i), (3, e, h, r))
        assert w.gate_up_a.stride() == (row, 2 * r * h, h, 1) and w.down_b.stride() == (row, h * r, r, 1)
        assert (w.scalings.shape, w.scalings.dtype, w.scalings.stride()) == ((3, 3), torch.float32,
                                                                              (layout.num_bytes // 4, 1))
        assert (w.shared_outer.shape, w.shared_outer.dtype) == ((3,), torch.int32)
        for t in (w.gate_up_a, w.gate_up_b, w.down_a, w.down_b, w.scalings, w.shared_outer):
            assert t.untyped_storage().data_ptr() == slots.untyped_storage().data_ptr()
            assert (t.data_ptr() - slots.data_ptr()) % ALIGN == 0
    first = min(region.offset for region in layout.expert_regions.values())
    assert first >= max(r.scalings_offset for r in layout.regions.values())    # after the dense regions


def test_expert_adapters_take_the_converting_read(moe_model, adapters):
    """read_packed leaves adapters with expert LoRA to read_adapter + pack (one contiguous buffer)."""
    model_dir, model = moe_model
    layout, arch = SlotLayout(model, MAX_RANK, torch.float32), ArchConfig.from_dir(model_dir)
    assert layout.read_packed(locate_adapter("a", adapters["stacked"], arch, MAX_RANK), pin=False) is None
    packed = _pack(adapters["stacked"], model_dir, layout)
    assert packed.is_contiguous() and packed.shape == (layout.num_bytes,)


def test_an_attention_adapter_on_a_moe_model_reads_straight_into_place(moe_model):
    """Dense LoRA keeps read_packed's fast path: the same bytes as pack, the expert regions zero."""
    model_dir, model = moe_model
    layout, arch = SlotLayout(model, MAX_RANK, torch.float32), ArchConfig.from_dir(model_dir)
    path = adapter_dir(model_dir, "r8-attn")
    stale = torch.full((layout.num_bytes,), 0xAB, dtype=torch.uint8)
    got = layout.read_packed(locate_adapter("a", path, arch, MAX_RANK), pin=False, out=stale)
    assert got is stale
    assert torch.equal(got, layout.pack(read_adapter("a", path, arch, MAX_RANK, torch.float32), pin=False))
    for region in layout.expert_regions.values():
        assert not got[region.offset:region.offset + region.num_bytes].any()
