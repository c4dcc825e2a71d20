"""The slot byte layout (lora/slot_layout.py): an adapter packed from its tensors or read from its file
straight into place gives the same bytes, and a packed slot computes the PEFT delta."""
from __future__ import annotations

import concurrent.futures
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_fixtures import ADAPTERS, adapter_dir, peft_lora
from tests.worker.lora.engine_runs import make_engine
from worker.kernels import reference
from worker.lora.adapter import locate_adapter, read_adapter
from tests.worker.lora.slot_refs import laid_out
from worker.lora.host_buffers import HostBuffers
from worker.lora.slot_layout import PackedReader
from worker.arch import ArchConfig
from worker.models.builder import lora_targets


def test_a_packed_adapter_loads_into_its_slot_with_one_copy(llama):
    """The slot's LoRA delta equals sum_modules scaling * x @ A^T @ B^T from the PEFT tensors."""
    engine = make_engine(llama, max_loras=3)
    pool, arch, targets = engine.runner.lora_pool, engine.arch, engine.runner.lora_pool.layout.targets
    spec = ADAPTERS[1]     # every target, two ranks, alpha_pattern
    peft = peft_lora(llama, spec)          # the reference: PEFT's tensors, PEFT's scalings
    adapter = read_adapter(spec.name, adapter_dir(llama, spec.name), targets, 16, torch.float32)
    packed = pool.layout.pack(adapter)
    assert packed.shape == (pool.layout.num_bytes,)
    rank = adapter.spec.rank
    assert rank == max(a.shape[0] for a, _, _ in peft.values())
    pool.start_load(1, packed, rank, "key")
    (load,) = pool.finished_loads()
    assert (load.slot, load.key) == (1, "key") and pool.finished_loads() == []
    assert torch.equal(pool.slots[1], packed) and not pool.slots[0].any() and not pool.slots[2].any()
    assert pool.ranks.tolist() == [0, rank, 0] and pool.ranks_host == [0, rank, 0]
    x = torch.randn(5, max(arch.hidden_size, arch.intermediate_size), generator=torch.Generator().manual_seed(0))
    for (layer, name), w in pool.weights.items():
        xin = x[:, :w.a.shape[2]]
        y = torch.zeros(5, w.b.shape[1])
        xa = reference.lora_shrink(xin, w.a, [0, 5], [1], pool.ranks_host, w.num_slices)
        reference.lora_expand(y, xa, w.b, [0, 5], [1], pool.ranks_host, w.scalings, w.slice_offsets)
        expected = torch.zeros_like(y)
        for (m_layer, module), (a, b, scaling) in peft.items():
            target, s = targets.packing(m_layer, module)
            if (m_layer, target.projection) == (layer, name):
                lo, hi = w.slice_offsets[s], w.slice_offsets[s + 1]
                expected[:, lo:hi] += scaling * (xin @ a.T @ b.T)
        torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("file_dtypes, dtype", [((torch.float32, torch.float32), torch.bfloat16),
                                                 ((torch.bfloat16, torch.bfloat16), torch.bfloat16),
                                                 ((torch.float32, torch.float16), torch.float32)],
                         ids=["converted", "as-is", "mixed"])
def test_read_adapter_gives_each_tensor_in_the_serving_dtype(llama, tmp_path, file_dtypes, dtype):
    """lora_A tensors stored in one dtype, lora_B in another; bytes read equal safetensors' own tensors cast."""
    path = tmp_path / "typed"
    shutil.copytree(adapter_dir(llama, ADAPTERS[1].name), path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    typed = {k: t.to(file_dtypes["lora_B" in k]) for k, t in tensors.items()}
    save_file(typed, str(path / "adapter_model.safetensors"))
    adapter = read_adapter("typed", path, lora_targets(ArchConfig.from_dir(llama)), 16, dtype)
    prefix = "base_model.model.model.layers"
    for (layer, target), m in adapter.modules.items():
        block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        key = f"{prefix}.{layer}.{block}.{target}.lora_%s.weight"
        assert torch.equal(m.a.view(dtype), typed[key % "A"].to(dtype).flatten())
        assert torch.equal(m.b.view(dtype), typed[key % "B"].to(dtype).flatten())
    assert len(adapter.modules) == len(tensors) // 2


@pytest.mark.parametrize("spec", ADAPTERS, ids=[a.name for a in ADAPTERS])
@pytest.mark.parametrize("max_rank", [16, 32], ids=["R16", "R32"])
@pytest.mark.parametrize("parts", [1, 3], ids=["one-read", "3-parts"])
def test_reading_straight_into_place_gives_the_packed_bytes(llama, spec, max_rank, parts, monkeypatch):
    """SlotLayout.read_packed (scattered reads into the slot layout) writes exactly what pack builds from
    read_adapter: ranks below and at R (B rows padded aside), adapters targeting a subset of the modules,
    rsLoRA and alpha_pattern scalings, in one read or split across threads; every byte of a buffer full
    of stale ones is written."""
    from worker.lora import file_reads
    monkeypatch.setattr(file_reads, "MIN_PART_BYTES", 1000)     # the fixtures' adapters are small
    engine = make_engine(llama, max_loras=2, max_lora_rank=max_rank)
    layout, path = engine.runner.lora_pool.layout, adapter_dir(llama, spec.name)
    expected = layout.pack(read_adapter(spec.name, path, layout.targets, max_rank, torch.float32))
    stale = torch.full((layout.num_bytes,), 0xAB, dtype=torch.uint8)
    with concurrent.futures.ThreadPoolExecutor(parts) as pool:
        got = layout.read_packed(locate_adapter(spec.name, path, layout.targets, max_rank), out=stale,
                                 pool=pool, parts=parts)
    assert got is stale and torch.equal(got, expected)


def test_overlap_loading_splits_reads_across_threads_and_blocking_loads_read_in_the_loop(llama):
    overlap = make_engine(llama, read_threads=3)
    blocking = make_engine(llama, read_threads=3, overlap=False)
    assert overlap.adapters.reader.read.read_threads == 3 and overlap.adapters.reader.read.pool is not None
    assert blocking.adapters.reader.read.read_threads == 1 and blocking.adapters.reader.read.pool is None


def test_reading_into_place_leaves_other_dtypes_to_the_converting_read(llama, tmp_path):
    path = tmp_path / "bf16"
    shutil.copytree(adapter_dir(llama, ADAPTERS[1].name), path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file({k: t.to(torch.bfloat16) for k, t in tensors.items()}, str(path / "adapter_model.safetensors"))
    engine = make_engine(llama, max_loras=2)
    layout = engine.runner.lora_pool.layout
    source = locate_adapter("bf16", path, layout.targets, 16)
    assert layout.read_packed(source) is None     # the slots are fp32
    entry = PackedReader(layout, HostBuffers(pin=False))(source.spec)     # the engine's reader converts instead
    assert torch.equal(laid_out(layout, entry), layout.pack(read_adapter("bf16", path, layout.targets, 16,
                                                                         torch.float32)))
    assert entry.rank == source.spec.rank
