"""Host-cache entries at the adapter's own size: what an entry holds (its rank, the projections it adapts), that it
lands in a slot exactly as the whole slot would be packed (lora/expansion.py), and the page-locked buffers behind
entries coming back for reuse (lora/host_buffers.py)."""
from __future__ import annotations

import concurrent.futures
import gc
import json
import shutil
import threading
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.hf_fixtures import ADAPTERS, adapter_dir
from tests.worker.lora.engine_runs import make_engine
from tests.worker.lora.slot_refs import laid_out
from worker.lora.adapter import inspect_adapter, locate_adapter, read_adapter
from worker.lora.expansion import Expansion
from worker.lora.host_buffers import HostBuffers
from worker.lora.errors import AdapterError
from worker.lora import slot_layout
from worker.lora.slot_layout import PackedReader, SlotLayout


def _aligned(n: int) -> int:
    return -(-n // 256) * 256


def own_size(targets, spec, item: int) -> int:
    """An entry's bytes from first principles: every layer's fused projections that pack one of the adapter's
    modules, at the adapter's rank r: lora_A [slices * r, in], lora_B [out, r], float32 scalings per slice, each
    256-byte aligned."""
    total = 0
    for layer in range(targets.num_layers):
        for target in targets.at(layer):
            if set(target.modules) & set(spec.target_modules):
                n, out = len(target.modules), sum(target.out_features)
                total += (_aligned(n * spec.rank * target.in_features * item) + _aligned(out * spec.rank * item)
                          + _aligned(4 * n))
    return total


@pytest.mark.parametrize("adapter", ADAPTERS, ids=[a.name for a in ADAPTERS])
@pytest.mark.parametrize("max_rank", [16, 32], ids=["R16", "R32"])
def test_an_entry_holds_the_adapter_at_its_own_size_and_lands_in_its_slot_as_packed(llama, adapter, max_rank):
    engine = make_engine(llama, max_loras=2, max_lora_rank=max_rank)
    layout, path = engine.runner.lora_pool.layout, adapter_dir(llama, adapter.name)
    spec = inspect_adapter(adapter.name, path, layout.targets, max_rank)
    reader = PackedReader(layout, HostBuffers(pin=False))
    entry = reader(spec)
    assert entry.packed.numel() == reader.entry_bytes(spec) == own_size(layout.targets, spec, 4)
    assert entry.packed.numel() <= layout.num_bytes and entry.rank == spec.rank
    want = layout.pack(read_adapter(adapter.name, path, layout.targets, max_rank, torch.float32))
    assert torch.equal(laid_out(layout, entry), want)


def test_an_entry_lands_in_a_few_copies_whatever_the_number_of_layers(llama):
    """A dense model's layers lie at one stride in both layouts: one copy per field and kind of projection."""
    engine = make_engine(llama, max_loras=2)
    layout = engine.runner.lora_pool.layout
    spec = inspect_adapter("all", adapter_dir(llama, ADAPTERS[1].name), layout.targets, 16)
    expansion = Expansion(layout.entry_layout(spec), layout)
    kinds = {name for _, name in layout.regions}
    assert layout.targets.num_layers > 1 and len(expansion.copies) == 3 * len(kinds)
    assert all(c.shape[0] == layout.targets.num_layers for c in expansion.copies)
    assert Expansion(layout, layout).whole and not expansion.whole


def test_entries_of_one_layout_share_it_and_a_slot_is_rewritten_whole_between_adapters(llama):
    """A slot that held a larger adapter holds nothing of it once a smaller one is written over it."""
    engine = make_engine(llama, max_loras=1)
    pool, layout = engine.runner.lora_pool, engine.runner.lora_pool.layout
    reader = PackedReader(layout, HostBuffers(pin=False))
    big, small = (reader(inspect_adapter(a.name, adapter_dir(llama, a.name), layout.targets, 16))
                  for a in (ADAPTERS[1], ADAPTERS[0]))
    assert reader(inspect_adapter("again", adapter_dir(llama, ADAPTERS[0].name), layout.targets, 16)).layout \
        is small.layout
    pool.start_load(0, big.packed, big.rank, "big", big.layout)
    pool.start_load(0, small.packed, small.rank, "small", small.layout)
    assert torch.equal(pool.slots[0], laid_out(layout, small)) and pool.ranks_host == [small.rank]


def test_buffers_come_back_when_their_entry_is_gone_and_serve_the_next_entry_of_their_size(llama):
    engine = make_engine(llama, max_loras=1)
    layout = engine.runner.lora_pool.layout
    buffers = HostBuffers(pin=False)
    reader = PackedReader(layout, buffers)
    spec = inspect_adapter("a", adapter_dir(llama, ADAPTERS[0].name), layout.targets, 16)
    entry = reader(spec)
    address, size = entry.packed.data_ptr(), entry.packed.numel()
    held = entry.packed              # what an in-flight copy (SlotLoad.source) keeps
    del entry
    gc.collect()
    assert buffers.idle_bytes == 0   # the copy still reads it
    del held
    gc.collect()
    assert buffers.idle_bytes == size
    again = reader(spec)
    assert again.packed.data_ptr() == address and buffers.idle_bytes == 0


def test_a_failed_read_gives_its_buffer_back(llama, monkeypatch):
    engine = make_engine(llama, max_loras=1)
    layout = engine.runner.lora_pool.layout
    buffers = HostBuffers(pin=False)
    reader = PackedReader(layout, buffers)
    spec = inspect_adapter("a", adapter_dir(llama, ADAPTERS[0].name), layout.targets, 16)
    held = reader(spec)                      # holds its buffer: no idle one to take
    assert buffers.idle_bytes == 0

    def failing_read(*args, **kwargs):
        raise OSError("the disk went away")
    monkeypatch.setattr(slot_layout, "read_in_parts", failing_read)     # the file read itself fails
    with pytest.raises(AdapterError, match="unreadable.*the disk went away"):
        reader(spec)
    assert buffers.idle_bytes == held.packed.numel()      # the buffer the failed read took is back


def test_idle_buffers_beyond_the_bound_are_freed_largest_first():
    buffers = HostBuffers(pin=False, keep_bytes=10_000)
    a, b, c = buffers.get(6000), buffers.get(3000), buffers.get(3000)
    assert (a.numel(), b.numel()) == (6000, 3000)
    buffers.give_back(b)
    buffers.give_back(c)
    assert buffers.idle_bytes == 6000
    buffers.give_back(a)                     # 12,000 idle: the 6,000 one goes
    assert buffers.idle_bytes == 6000
    assert buffers.get(3000).numel() == 3000 and buffers.idle_bytes == 3000


def test_warm_adapters_take_their_memory_beside_each_other_and_settle_waits_for_it(llama, variants):
    """--lora-modules adapters: each read waits for memory made on the buffers' own threads (page-locked on CUDA
    before the server serves); `settle` returns once all of it is made, and the reads use it."""
    engine = make_engine(llama, threads=True)
    buffers = engine.adapters.buffers
    made: list[int] = []
    gate = threading.Event()
    make = buffers._new

    def slow_new(num_bytes):
        gate.wait(30)
        made.append(num_bytes)
        return make(num_bytes)
    buffers._new = slow_new
    names = sorted(variants)[:3]
    for name in names:
        engine.add_adapter(name, variants[name], warm=True)
    waiter = concurrent.futures.ThreadPoolExecutor(1).submit(engine.adapters.settle)
    time.sleep(0.2)
    assert not waiter.done() and made == []          # the memory is still being made
    gate.set()
    assert waiter.result(30) == 3
    specs = {name: engine.adapters.registry.versions[engine.adapters.registry.refs[name]].spec for name in names}
    assert sorted(made) == sorted(engine.adapters.packer.entry_bytes(s) for s in specs.values())
    deadline = time.monotonic() + 30
    while engine.adapters.reader.num_in_flight and time.monotonic() < deadline:
        engine.adapters.loads.collect()
        time.sleep(0.01)
    assert all(engine.adapters.host_cache.is_filled(engine.adapters.registry.refs[n]) for n in names)
    assert buffers.settle() == 0


def _copy_with_weights(source, out, scale: float):
    """A copy of the adapter directory `source` with every weight multiplied by `scale`: the same config and
    header bytes (names, dtypes, shapes, offsets), other weights."""
    shutil.copytree(source, out)
    file = out / "adapter_model.safetensors"
    tensors = load_file(file)
    with safe_open(file, "pt") as f:
        metadata = f.metadata()
    header = file.read_bytes()[:8 + int.from_bytes(file.read_bytes()[:8], "little")]
    save_file({k: v * scale for k, v in tensors.items()}, file, metadata=metadata)
    assert file.read_bytes()[:len(header)] == header
    return out


def test_directories_with_equal_config_and_header_share_a_plan_and_each_reads_its_own_weights(llama, tmp_path,
                                                                                              monkeypatch):
    engine = make_engine(llama, max_loras=1)
    layout = engine.runner.lora_pool.layout
    source = adapter_dir(llama, ADAPTERS[1].name)
    dirs = [_copy_with_weights(source, tmp_path / f"copy{i}", scale) for i, scale in enumerate((1.0, -2.0, 0.5))]
    located = []

    def spy(*args, **kwargs):
        located.append(str(args[1]))
        return locate_adapter(*args, **kwargs)
    monkeypatch.setattr(slot_layout, "locate_adapter", spy)
    reader = PackedReader(layout, HostBuffers(pin=False))
    for d in dirs:
        spec = inspect_adapter(d.name, d, layout.targets, 16)
        want = layout.pack(read_adapter(d.name, d, layout.targets, 16, torch.float32))
        assert torch.equal(laid_out(layout, reader(spec)), want), d.name
    assert located == [str(dirs[0])], "the first directory's checks and plan served the other two"


def test_a_directory_changed_after_it_was_planned_is_checked_and_planned_again(llama, tmp_path, monkeypatch):
    engine = make_engine(llama, max_loras=1)
    layout = engine.runner.lora_pool.layout
    d = _copy_with_weights(adapter_dir(llama, ADAPTERS[1].name), tmp_path / "a", 1.0)
    reader = PackedReader(layout, HostBuffers(pin=False))
    spec = inspect_adapter("a", d, layout.targets, 16)
    reader(spec)
    config = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps(config | {"lora_alpha": 3 * config["lora_alpha"]}))
    want = layout.pack(read_adapter("a", d, layout.targets, 16, torch.float32))     # the new scalings
    assert torch.equal(laid_out(layout, reader(spec)), want)
    (d / "adapter_config.json").write_text(json.dumps(config | {"use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora"):
        reader(spec)


def test_plans_beyond_the_bound_go_the_least_recently_used_first(llama, tmp_path, monkeypatch):
    engine = make_engine(llama, max_loras=1)
    layout = engine.runner.lora_pool.layout
    monkeypatch.setattr(slot_layout, "MAX_PLANS", 2)
    located = []

    def spy(*args, **kwargs):
        located.append(args[0])
        return locate_adapter(*args, **kwargs)
    monkeypatch.setattr(slot_layout, "locate_adapter", spy)
    reader = PackedReader(layout, HostBuffers(pin=False))
    specs = {a.name: inspect_adapter(a.name, adapter_dir(llama, a.name), layout.targets, 16) for a in ADAPTERS[:3]}
    names = list(specs)
    for name in [names[0], names[1], names[0], names[2], names[0], names[1]]:
        reader(specs[name])
    # names[2] pushed out names[1] (names[0] was used later), and names[1] coming back pushed out names[2]
    assert located == [names[0], names[1], names[2], names[1]]
