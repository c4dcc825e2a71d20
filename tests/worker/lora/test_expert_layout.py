"""The expert regions of a slot (lora/expert_layout.py): each format packed into the slot equals the MoE-LoRA
reference's own packing (tests/moe_fixtures.reference_slots), read straight into place it gives the same bytes
as read + pack, the views are strided views of the slots, and an adapter without expert LoRA leaves the regions
zero whichever way it is read."""
from __future__ import annotations

import concurrent.futures
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_fixtures import adapter_dir
from tests.moe_fixtures import (EXPERT_ADAPTERS, SHAPE, HandExpertAdapter, PeftExpertAdapter, build_expert_adapters,
                                reference_slots, save_hand_expert_adapter, save_peft_expert_adapter)
from worker.config import KernelConfig
from worker.lora.adapter import inspect_adapter, locate_adapter, read_adapter
from worker.lora.expert_layout import ALIGN
from worker.lora.formats.experts import read_expert_formats
from worker.lora.safetensors_file import tensor_file
from tests.worker.lora.slot_refs import laid_out
from worker.lora.host_buffers import HostBuffers
from worker.lora.slot_layout import PackedReader, SlotLayout
from worker.models.builder import build_model

MAX_RANK = 8
HAND = (HandExpertAdapter("per-expert", "per_expert", (3, 5, 2), experts=(1, 3)),
        HandExpertAdapter("stacked", "stacked", (4, 2, 6)),
        HandExpertAdapter("shared-outer", "stacked", (6, 6, 4), shared_outer=True))
FULL_RANK = (HandExpertAdapter("per-expert-full", "per_expert", (MAX_RANK,) * 3, experts=(0, 2)),
             HandExpertAdapter("stacked-full", "stacked", (MAX_RANK, 5, MAX_RANK)),
             HandExpertAdapter("shared-outer-full", "stacked", (MAX_RANK,) * 3, shared_outer=True))


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
    spec = inspect_adapter("a", path, layout.targets, MAX_RANK)
    entry = PackedReader(layout, HostBuffers(pin=False))(spec)
    assert entry.rank == spec.rank
    return laid_out(layout, entry)


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


@pytest.fixture(scope="module")
def read_cases(moe_model, adapters, tmp_path_factory) -> dict[str, Path]:
    """name -> directory of adapters covering the read paths: every format below and at R = MAX_RANK,
    shared-outer, per-expert with experts left out, stacked matrices stored once for all experts."""
    model_dir, _ = moe_model
    root = tmp_path_factory.mktemp("expert-reads")
    paths = dict(adapters)
    save_peft_expert_adapter(model_dir, PeftExpertAdapter("peft-r8", MAX_RANK, alpha=16, modules=("q_proj",)),
                             root / "peft-r8", seed=7)
    paths["peft-r8"] = root / "peft-r8"
    for i, spec in enumerate(FULL_RANK):
        paths[spec.name] = root / spec.name
        save_hand_expert_adapter(spec, [0, 1], SHAPE, mixtral_names=i == 0, out=paths[spec.name], seed=10 + i)
    paths["stacked-repeated"] = _save_repeated_stacked(root / "stacked-repeated")
    return paths


def _save_repeated_stacked(out: Path) -> Path:
    """A stacked adapter (layer 1 only) whose gate A, up B and down A are stored once for all experts (n = 1)
    while the other matrices are per expert, so it is not shared-outer: each single matrix is repeated."""
    gen = torch.Generator().manual_seed(3)
    e, h, i = SHAPE.num_experts, SHAPE.hidden_size, SHAPE.intermediate_size
    prefix = "base_model.model.model.layers.1.mlp.experts."
    shapes = {"gate_proj": ((1, 3, h), (e, i, 3)), "up_proj": ((e, MAX_RANK, h), (1, i, MAX_RANK)),
              "down_proj": ((1, 5, i), (e, h, 5))}
    tensors = {f"{prefix}{name}.lora_{ab}.weight": torch.randn(*shape, generator=gen)
               for name, pair in shapes.items() for ab, shape in zip("AB", pair)}
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": MAX_RANK, "lora_alpha": 16,
                                                         "target_modules": list(shapes)}))
    return out


def _stored_as(path: Path, dtype: torch.dtype, out: Path) -> Path:
    """A copy of the adapter directory with its tensors stored in `dtype`."""
    if not out.exists():
        shutil.copytree(path, out)
        tensors = load_file(str(path / "adapter_model.safetensors"))
        save_file({k: t.to(dtype) for k, t in tensors.items()}, str(out / "adapter_model.safetensors"))
    return out


READ_CASES = ("r2", "r4-pattern", "r3-rs", "peft-r8", "per-expert", "per-expert-full", "stacked", "stacked-full",
              "shared-outer", "shared-outer-full", "stacked-repeated")


@pytest.mark.parametrize("parts", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", READ_CASES)
def test_expert_adapters_read_into_place_give_the_bytes_pack_gives(moe_model, read_cases, tmp_path_factory,
                                                                   name, dtype, parts):
    """read_packed on a file storing the slots' dtype writes every byte of the buffer (stale bytes before)
    exactly as read_adapter + pack, whatever the format, rank, sharing and experts left out."""
    model_dir, model = moe_model
    layout = SlotLayout(model, MAX_RANK, dtype)
    path = read_cases[name]
    if dtype != torch.float32:
        path = _stored_as(path, dtype, tmp_path_factory.getbasetemp() / f"{name}-{dtype}")
    stale = torch.full((layout.num_bytes,), 0xAB, dtype=torch.uint8)
    with concurrent.futures.ThreadPoolExecutor(parts) as pool:
        got = layout.read_packed(locate_adapter("a", path, layout.targets, MAX_RANK), out=stale, pool=pool,
                                 parts=parts)
    assert got is stale
    want = layout.pack(read_adapter("a", path, layout.targets, MAX_RANK, dtype))
    for layer, region in layout.expert_regions.items():
        span = slice(region.offset, region.offset + region.num_bytes)
        assert torch.equal(got[span], want[span]), layer
    assert torch.equal(got, want)


def test_expert_adapters_stored_in_another_dtype_take_the_converting_read(moe_model, adapters):
    """A float32 file under bfloat16 slots: read_packed leaves it to read_adapter + pack (one contiguous buffer)."""
    model_dir, model = moe_model
    layout = SlotLayout(model, MAX_RANK, torch.bfloat16)
    assert layout.read_packed(locate_adapter("a", adapters["stacked"], layout.targets, MAX_RANK)) is None
    packed = _pack(adapters["stacked"], model_dir, layout)
    assert packed.is_contiguous() and packed.shape == (layout.num_bytes,)


def test_an_attention_adapter_on_a_moe_model_reads_straight_into_place(moe_model):
    """Dense LoRA keeps read_packed's fast path: the same bytes as pack, the expert regions zero."""
    model_dir, model = moe_model
    layout = SlotLayout(model, MAX_RANK, torch.float32)
    path = adapter_dir(model_dir, "r8-attn")
    stale = torch.full((layout.num_bytes,), 0xAB, dtype=torch.uint8)
    got = layout.read_packed(locate_adapter("a", path, layout.targets, MAX_RANK), out=stale)
    assert got is stale
    assert torch.equal(got, layout.pack(read_adapter("a", path, layout.targets, MAX_RANK, torch.float32)))
    for region in layout.expert_regions.values():
        assert not got[region.offset:region.offset + region.num_bytes].any()
