"""Adapter tiers in the engine: packed slots, disk -> host -> GPU transitions, overlap loading (a request
waits for its adapter while others run), eviction safety, runtime load / unload / load_inplace, fairness,
auto-load from --lora-dir, read failures, pinning and the counters behind the metrics.

Every output is checked against the same request run alone in a fresh engine. Disk reads run inline
(at submit) unless a test needs the thread pool, so what happens in which step is deterministic.
"""
from __future__ import annotations

import concurrent.futures
import random
import shutil
import threading
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_fixtures import ADAPTERS, adapter_dir
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams
from worker.kernels import reference
from worker.models.hf_config import ArchConfig
from worker.lora.adapter import AdapterError, load_adapter, locate_adapter, read_adapter
from worker.lora.loader import PackedReader

NUM_VARIANTS = 7


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def llama(hf_models):
    return hf_models["llama"]


@pytest.fixture(scope="module")
def variants(llama, tmp_path_factory) -> dict[str, str]:
    """NUM_VARIANTS adapters with distinct weights: the fixtures' adapters with lora_B scaled."""
    root = tmp_path_factory.mktemp("variants")
    paths = {}
    for i in range(NUM_VARIANTS):
        source = adapter_dir(llama, ADAPTERS[i % len(ADAPTERS)].name)
        path = root / f"v{i}"
        shutil.copytree(source, path)
        tensors = load_file(str(path / "adapter_model.safetensors"))
        scaled = {k: t * (1.0 + 0.4 * (i // len(ADAPTERS) + 1)) if "lora_B" in k else t for k, t in tensors.items()}
        save_file(scaled, str(path / "adapter_model.safetensors"))
        paths[f"v{i}"] = str(path)
    return paths


class InlineExecutor(concurrent.futures.Executor):
    """Runs each disk read when it is submitted; the engine still files it at its next poll."""

    def submit(self, fn, /, *args, **kwargs):
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as e:
            future.set_exception(e)
        return future


def make_engine(model_dir, adapters: dict[str, str] | None = None, *, overlap: bool = True, max_loras: int = 2,
                max_cpu_loras: int | None = None, policy: str = "lru", lora_dirs=(), threads: bool = False,
                max_lora_rank: int = 16, read_threads: int = 4, **sched) -> Engine:
    lora = LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                      enable_lora_overlap_loading=overlap, lora_eviction_policy=policy, lora_dirs=tuple(lora_dirs),
                      lora_read_threads=read_threads)
    engine = Engine(WorkerConfig(ModelConfig(str(model_dir)), cache=CacheConfig(block_size=4, num_blocks_override=256),
                                 lora=lora, scheduler=SchedulerConfig(**sched), device="cpu"))
    if not threads:
        engine.loader.executor = InlineExecutor()
    for name, path in (adapters or {}).items():
        engine.add_adapter(name, path)
    return engine


def run(engine: Engine, arrivals: dict[int, list[tuple]] | None = None, max_steps: int = 500) -> dict[str, list]:
    """Step until done; `arrivals`: step -> [(request id, prompt, params, adapter)] added before that step."""
    arrivals = arrivals or {}
    outputs: dict[str, list] = {}
    for step in range(max_steps):
        for request_id, ids, params, adapter in arrivals.get(step, []):
            engine.add_request(request_id, ids, params, adapter)
        if step > max(arrivals, default=0) and not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("requests did not finish")


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


_ALONE: dict = {}


def alone(model_dir, path: str | None, ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of one request run alone in a fresh engine."""
    key = (path, tuple(ids), max_tokens)
    if key not in _ALONE:
        engine = make_engine(model_dir, {"x": path} if path else None)
        engine.add_request("alone", ids, greedy(max_tokens), "x" if path else None)
        _ALONE[key] = tokens(run(engine)["alone"])
    return _ALONE[key]


def residency(engine: Engine) -> dict[str, str]:
    return {s.name: s.residency for s in engine.adapter_states()}


# the slot format


def test_a_packed_adapter_loads_into_its_slot_with_one_copy(llama):
    """The slot's LoRA delta equals sum_modules scaling * x @ A^T @ B^T from the PEFT tensors."""
    engine = make_engine(llama, max_loras=3)
    pool, arch = engine.runner.lora_pool, engine.arch
    spec = ADAPTERS[1]     # every target, two ranks, alpha_pattern
    adapter = load_adapter(spec.name, adapter_dir(llama, spec.name), arch, 16, torch.float32)
    packed = pool.layout.pack(read_adapter(spec.name, adapter_dir(llama, spec.name), arch, 16, torch.float32),
                              pin=False)
    assert packed.shape == (pool.layout.num_bytes,)
    pool.start_load(1, packed, adapter.rank, "key")
    (load,) = pool.finished_loads()
    assert (load.slot, load.key) == (1, "key") and pool.finished_loads() == []
    assert torch.equal(pool.slots[1], packed) and not pool.slots[0].any() and not pool.slots[2].any()
    assert pool.ranks.tolist() == [0, adapter.rank, 0] and pool.ranks_host == [0, adapter.rank, 0]
    x = torch.randn(5, max(arch.hidden_size, arch.intermediate_size), generator=torch.Generator().manual_seed(0))
    targets = engine.runner.model.lora_targets
    for (layer, name), w in pool.weights.items():
        xin = x[:, :w.a.shape[2]]
        y = torch.zeros(5, w.b.shape[1])
        xa = reference.lora_shrink(xin, w.a, [0, 5], [1], pool.ranks_host, w.num_slices)
        reference.lora_expand(y, xa, w.b, [0, 5], [1], pool.ranks_host, w.scalings, w.slice_offsets)
        expected = torch.zeros_like(y)
        for (m_layer, target), m in adapter.modules.items():
            proj, s = targets[target]
            if (m_layer, proj) == (layer, name):
                lo, hi = w.slice_offsets[s], w.slice_offsets[s + 1]
                expected[:, lo:hi] += m.scaling * (xin @ m.a.T @ m.b.T)
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
    arch = ArchConfig.from_dir(llama)
    adapter = read_adapter("typed", path, arch, 16, dtype)
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
    from worker.lora import gpu_pool
    monkeypatch.setattr(gpu_pool, "MIN_PART_BYTES", 1000)     # the fixtures' adapters are small
    engine = make_engine(llama, max_loras=2, max_lora_rank=max_rank)
    layout, arch, path = engine.runner.lora_pool.layout, engine.arch, adapter_dir(llama, spec.name)
    expected = layout.pack(read_adapter(spec.name, path, arch, max_rank, torch.float32), pin=False)
    stale = torch.full((layout.num_bytes,), 0xAB, dtype=torch.uint8)
    with concurrent.futures.ThreadPoolExecutor(parts) as pool:
        got = layout.read_packed(locate_adapter(spec.name, path, arch, max_rank), pin=False, out=stale,
                                 pool=pool, parts=parts)
    assert got is stale and torch.equal(got, expected)


def test_overlap_loading_splits_reads_across_threads_and_blocking_loads_read_in_the_loop(llama):
    overlap = make_engine(llama, read_threads=3)
    blocking = make_engine(llama, read_threads=3, overlap=False)
    assert overlap.loader.read.read_threads == 3 and overlap.loader.read.pool is not None
    assert blocking.loader.read.read_threads == 1 and blocking.loader.read.pool is None


def test_reading_into_place_leaves_other_dtypes_to_the_converting_read(llama, tmp_path):
    path = tmp_path / "bf16"
    shutil.copytree(adapter_dir(llama, ADAPTERS[1].name), path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file({k: t.to(torch.bfloat16) for k, t in tensors.items()}, str(path / "adapter_model.safetensors"))
    engine = make_engine(llama, max_loras=2)
    layout, arch = engine.runner.lora_pool.layout, engine.arch
    source = locate_adapter("bf16", path, arch, 16)
    assert layout.read_packed(source, pin=False) is None     # the slots are fp32
    entry = PackedReader(arch, layout, pin=False)(source.spec)     # the engine's reader converts instead
    assert torch.equal(entry.packed, layout.pack(read_adapter("bf16", path, arch, 16, torch.float32), pin=False))
    assert entry.rank == source.spec.rank


@pytest.mark.parametrize("iov_max", [1024, 3])
def test_scattered_reads_go_on_after_short_reads(tmp_path, monkeypatch, iov_max):
    """read_scattered: buffers in any order, gaps between file ranges, runs longer than IOV_MAX buffers,
    and a preadv that returns fewer bytes than asked (here at most 7 per call)."""
    import os

    from worker.lora import gpu_pool
    data = bytes(random.Random(0).randrange(256) for _ in range(500))
    (tmp_path / "f").write_bytes(data)
    ranges = [(0, 10), (10, 33), (33, 34), (40, 100), (100, 250), (251, 500)]
    buffers = {begin: bytearray(end - begin) for begin, end in ranges}
    reads = [(begin, memoryview(buffers[begin])) for begin, _ in reversed(ranges)]
    real = os.preadv
    monkeypatch.setattr(gpu_pool, "_IOV_MAX", iov_max)
    monkeypatch.setattr(gpu_pool.os, "preadv", lambda fd, bufs, offset: real(fd, bufs, offset) if sum(
        len(b) for b in bufs) <= 7 else real(fd, _first_bytes(bufs, 7), offset))
    with open(tmp_path / "f", "rb") as f:
        gpu_pool.read_scattered(f.fileno(), reads)
        assert all(bytes(buffers[begin]) == data[begin:end] for begin, end in ranges)
        with pytest.raises(OSError, match="ended"):
            gpu_pool.read_scattered(f.fileno(), [(495, memoryview(bytearray(10)))])


@pytest.mark.parametrize("parts, min_bytes", [(1, 1), (2, 1), (3, 1), (4, 100), (7, 1), (64, 1), (4, 10_000)])
def test_split_reads_cut_the_bytes_into_even_file_ordered_groups(parts, min_bytes):
    """Every byte of every buffer lands in exactly one group, at its own file offset; groups follow each
    other in file order, hold within one byte of total / groups, and none is under min_bytes unless alone."""
    from worker.lora.gpu_pool import split_reads
    rng = random.Random(parts)
    sizes = [rng.choice([0, 1, 5, 64, 300]) for _ in range(40)]
    buffers, reads, offset = [], [], 0
    for size in sizes:
        offset += rng.choice([0, 0, 3])                       # gaps between some file ranges
        buffers.append(bytearray(size))
        reads.append((offset, memoryview(buffers[-1])))
        offset += size
    total = sum(sizes)
    groups = split_reads(list(reversed(reads)), parts, min_bytes)
    expected_groups = max(1, min(parts, total // min_bytes))
    assert len(groups) == expected_groups
    sizes_per_group = [sum(len(b) for _, b in group) for group in groups]
    assert sum(sizes_per_group) == total and max(sizes_per_group) - min(sizes_per_group) <= 1
    pieces = [(offset, b) for group in groups for offset, b in group]
    assert [o for o, _ in pieces] == sorted(o for o, _ in pieces)
    for offset, b in pieces:                 # write each piece's file offsets into the buffers it views
        b[:] = bytes((offset + k) % 251 for k in range(len(b)))
    for (offset, _), buffer in zip(reads, buffers):
        assert bytes(buffer) == bytes((offset + k) % 251 for k in range(len(buffer)))


def test_reads_in_parts_fill_the_buffers_and_wait_for_every_part_before_raising(tmp_path, monkeypatch):
    from worker.lora import gpu_pool
    data = bytes(random.Random(1).randrange(256) for _ in range(10_000))
    (tmp_path / "f").write_bytes(data)
    monkeypatch.setattr(gpu_pool, "MIN_PART_BYTES", 100)
    buffers = [bytearray(n) for n in (3000, 1, 4999, 2000)]
    offsets = [0, 3000, 3001, 8000]
    reads = [(o, memoryview(b)) for o, b in zip(offsets, buffers)]
    assert len(gpu_pool.split_reads(reads, 4)) == 4
    real, slow_part_done = gpu_pool.read_scattered, threading.Event()

    def read_scattered(fd, group):          # the part at offset 0 ends last
        if group[0][0] == 0:
            time.sleep(0.2)
            real(fd, group)
            slow_part_done.set()
        else:
            real(fd, group)
    monkeypatch.setattr(gpu_pool, "read_scattered", read_scattered)
    with concurrent.futures.ThreadPoolExecutor(4) as pool, open(tmp_path / "f", "rb") as f:
        gpu_pool.read_in_parts(f.fileno(), reads, pool, 4)
        assert b"".join(buffers) == data
        # the last part runs past the end of the file: the error comes once the slow part has ended too
        past_end = [(2600 * i, memoryview(bytearray(2600))) for i in range(4)]
        slow_part_done.clear()
        with pytest.raises(OSError, match="ended"):
            gpu_pool.read_in_parts(f.fileno(), past_end, pool, 4)
        assert slow_part_done.is_set() and bytes(past_end[0][1]) == data[:2600]


def _first_bytes(buffers, n: int) -> list[memoryview]:
    out = []
    for b in buffers:
        b = memoryview(b)[:n]
        out.append(b)
        n -= len(b)
        if n == 0:
            break
    return out


# tiers


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "blocking"])
def test_adapters_move_disk_host_gpu_and_back_as_others_need_room(llama, variants, overlap):
    names = ["v0", "v1", "v2"]
    engine = make_engine(llama, {n: variants[n] for n in names}, overlap=overlap, max_loras=1, max_cpu_loras=2)
    assert residency(engine) == {"v0": "disk", "v1": "disk", "v2": "disk"}
    expected = [{"v0": "gpu", "v1": "disk", "v2": "disk"},
                {"v0": "host", "v1": "gpu", "v2": "disk"},
                {"v0": "disk", "v1": "host", "v2": "gpu"}]    # the host cache holds two: v0 was used least recently
    for i, name in enumerate(names):
        outs = run(engine, {0: [(name, prompt(6, i), greedy(3), name)]})
        assert tokens(outs[name]) == alone(llama, variants[name], prompt(6, i), 3)
        assert residency(engine) == expected[i]
    stats = engine.lora_stats()
    assert (stats.gpu_slots_used, stats.gpu_slots_total, stats.host_entries) == (1, 1, 2)
    assert (stats.host.misses, stats.host.loads, stats.host.evictions) == (3, 3, 1)
    assert (stats.gpu.misses, stats.gpu.loads, stats.gpu.evictions) == (3, 3, 2)
    assert stats.gpu.loaded_bytes == 3 * engine.runner.lora_pool.layout.num_bytes
    assert sum(stats.gpu.load_seconds_counts) == 3 and sum(stats.host.load_seconds_counts) == 3


def test_hits_and_misses_are_counted_when_requests_arrive(llama, variants):
    engine = make_engine(llama, {n: variants[n] for n in ("v0", "v1")}, max_loras=1)
    for i, name in enumerate(["v0", "v0", "v1", "v0"]):
        run(engine, {0: [(f"r{i}", prompt(4, i), greedy(2), name)]})
    stats = engine.lora_stats()
    assert (stats.gpu.hits, stats.gpu.misses) == (1, 3)       # the second v0 found it in its slot
    assert (stats.host.hits, stats.host.misses) == (1, 2)     # the last v0 was evicted from the GPU only
    assert stats.gpu.evictions == 2


# overlap loading


def test_request_waits_for_its_adapter_read_while_others_run(llama, variants):
    engine = make_engine(llama, {"v1": variants["v1"]}, threads=True)
    gate, read = threading.Event(), engine.loader.read
    engine.loader.read = lambda spec: (gate.wait(30), read(spec))[1]
    engine.add_request("base", prompt(5, 0), greedy(12), None)
    engine.add_request("x", prompt(7, 1), greedy(5), "v1")
    assert engine.step() == []      # launches base's prefill; its token comes back with the next step
    for _ in range(6):
        outs = {o.request_id: o for o in engine.step()}
        assert "base" in outs and "x" not in outs
        assert engine.num_waiting == 1
    state = engine.adapter_states()[0]
    assert (state.residency, state.loading) == ("disk", True)
    gate.set()
    outs = run(engine)
    assert tokens(outs["x"]) == alone(llama, variants["v1"], prompt(7, 1), 5)
    assert len(tokens(outs["base"])) == 6


def test_request_is_admitted_with_its_copy_while_the_copy_is_in_flight(llama, variants):
    """Once its adapter is in host memory, a request is admitted by the schedule() whose step issues the
    copy into its slot (its step waits for the copy on the device, tests/gpu), while the device has not
    reported the copy done; the adapter counts as loading, not resident, until it does."""
    engine = make_engine(llama, {"v2": variants["v2"]})
    finished, released = engine.runner.finished_adapter_loads, threading.Event()
    engine.runner.finished_adapter_loads = lambda: finished() if released.is_set() else []
    schedules, issued_at, admitted_at = [], [], []
    schedule, load = engine.scheduler.schedule, engine.runner.load_adapter

    def counting_schedule():
        batch = schedule()
        schedules.append(batch)
        if any(s.request.request_id == "x" for s in batch.seqs) and not admitted_at:
            admitted_at.append(len(schedules))
        return batch
    engine.scheduler.schedule = counting_schedule
    engine.runner.load_adapter = lambda *args: (issued_at.append(len(schedules)), load(*args))
    engine.add_request("base", prompt(5, 2), greedy(20), None)
    engine.add_request("x", prompt(3, 3), greedy(4), "v2")
    assert engine.step() == []      # launches base's prefill (x's read starts); tokens come with the next step
    outs: dict[str, list] = {}
    for _ in range(8):
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert issued_at and issued_at == admitted_at and len(tokens(outs["x"])) == 4 and "base" in outs
    state = engine.adapter_states()[0]
    assert (state.residency, state.loading) == ("host", True)
    released.set()
    outs = run(engine)
    assert engine.adapter_states()[0].residency == "gpu"
    assert tokens(outs["base"])


def test_idle_engine_admits_a_request_in_the_step_that_issues_its_copy(llama, variants):
    engine = make_engine(llama, {"v0": variants["v0"]})
    order = []
    schedule, load, finished = engine.scheduler.schedule, engine.runner.load_adapter, engine.runner.finished_adapter_loads
    engine.scheduler.schedule = lambda: (b := schedule(), order.append(("schedule", bool(b.seqs))))[0]
    engine.runner.load_adapter = lambda *args: (order.append(("copy", None)), load(*args))
    engine.runner.finished_adapter_loads = lambda: (done := finished(), order.extend(("done", None) for _ in done))[0]
    engine.add_request("x", prompt(4, 4), greedy(3), "v0")
    outs = run(engine)
    first_run = order.index(("schedule", True))
    assert order.index(("copy", None)) == first_run + 1 < order.index(("done", None))
    assert tokens(outs["x"]) == alone(llama, variants["v0"], prompt(4, 4), 3)


def test_blocking_loads_admit_and_load_in_the_same_step(llama, variants):
    engine = make_engine(llama, {"v3": variants["v3"]}, overlap=False)
    engine.add_request("x", prompt(4, 5), greedy(3), "v3")
    assert engine.step() == []      # the first launch: x's token is read back by the next step
    first = engine.step()
    assert [o.request_id for o in first] == ["x"] and first[0].new_token_ids == alone(llama, variants["v3"], prompt(4, 5), 3)[:1]
    assert tokens(run(engine)["x"]) == alone(llama, variants["v3"], prompt(4, 5), 3)[1:]


def mixed_traffic(seed: int, names: list[str], num_requests: int = 16) -> dict[int, list[tuple]]:
    rng = random.Random(seed)
    arrivals: dict[int, list[tuple]] = {}
    for i in range(num_requests):
        adapter = rng.choice(names + [None])
        request = (f"r{i}", prompt(rng.randint(2, 12), 100 + i), greedy(rng.randint(1, 6)), adapter)
        arrivals.setdefault(rng.randint(0, 12), []).append(request)
    return arrivals


class SlotWatcher:
    """An independent model of the GPU slots: what each copy put where, when the device said it was done,
    and which copies a step was ordered after. Every batch must read, in each slot it uses, its own adapter,
    with a finished copy or one the step waits for on the device (`wait_for_adapters` since the copy)."""

    def __init__(self, engine: Engine):
        self.engine, self.content, self.done, self.joined = engine, {}, set(), set()
        load, finished, execute = engine.runner.load_adapter, engine.runner.finished_adapter_loads, engine.runner.execute
        wait = engine.runner.wait_for_adapters

        def watch_load(slot, packed, rank, key):
            users = [r for r in engine.scheduler.running if slot in self.content and r.adapter == self.content[slot]]
            assert not users, f"slot {slot} overwritten while {len(users)} running requests use it"
            self.content[slot] = key
            self.done.discard(slot)
            self.joined.discard(slot)
            load(slot, packed, rank, key)

        def watch_finished():
            loads = finished()
            self.done.update(l.slot for l in loads if self.content.get(l.slot) == l.key)
            return loads

        def watch_wait(slots):
            self.joined.update(slots)
            wait(slots)

        def watch_execute(batch, prev=None):
            for seq in batch.seqs:
                if seq.request.adapter is not None:
                    assert self.content[seq.lora_slot] == seq.request.adapter
                    assert seq.lora_slot in self.done or seq.lora_slot in self.joined
            return execute(batch, prev)
        engine.runner.load_adapter, engine.runner.finished_adapter_loads = watch_load, watch_finished
        engine.runner.wait_for_adapters, engine.runner.execute = watch_wait, watch_execute


@pytest.mark.parametrize("overlap, policy, threads", [(True, "lru", False), (True, "fifo", False),
                                                     (False, "lru", False), (True, "lru", True)])
@pytest.mark.parametrize("seed", [0, 1])
def test_many_adapters_few_slots_every_output_equals_the_request_alone(llama, variants, overlap, policy, threads,
                                                                      seed, monkeypatch):
    """threads: reads on the loader's threads, each split in parts read side by side (inline otherwise)."""
    if threads:
        from worker.lora import gpu_pool
        monkeypatch.setattr(gpu_pool, "MIN_PART_BYTES", 1000)
    engine = make_engine(llama, variants, overlap=overlap, policy=policy, max_loras=2, max_cpu_loras=3,
                         threads=threads, max_num_seqs=4, max_num_batched_tokens=24)
    SlotWatcher(engine)
    arrivals = mixed_traffic(seed, list(variants))
    outs = run(engine, arrivals)
    for requests in arrivals.values():
        for request_id, ids, params, adapter in requests:
            path = variants[adapter] if adapter else None
            assert tokens(outs[request_id]) == alone(llama, path, ids, params.max_tokens), request_id
    stats = engine.lora_stats()
    assert stats.gpu.evictions > 0 and stats.host.evictions > 0


def test_overlap_and_blocking_loads_give_identical_tokens(llama, variants):
    results = []
    for overlap in (True, False):
        engine = make_engine(llama, variants, overlap=overlap, max_loras=3, max_num_batched_tokens=16)
        results.append({k: tokens(v) for k, v in run(engine, mixed_traffic(7, list(variants))).items()})
    assert results[0] == results[1]


# runtime changes during traffic


def step_collecting(engine: Engine, steps: int) -> dict[str, list]:
    """Outputs of `steps` engine steps, per request id."""
    outs: dict[str, list] = {}
    for _ in range(steps):
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_unload_lets_in_flight_requests_finish_then_frees_the_adapter(llama, variants):
    engine = make_engine(llama, {"v4": variants["v4"]}, max_num_seqs=1)
    engine.add_request("running", prompt(5, 6), greedy(6), "v4")
    engine.add_request("queued", prompt(6, 7), greedy(4), "v4")
    outs = step_collecting(engine, 2)
    engine.remove_adapter("v4")
    with pytest.raises(AdapterError, match="The model `v4` does not exist.") as err:
        engine.add_request("late", prompt(3, 8), greedy(2), "v4")
    assert err.value.status_code == 404
    assert engine.adapter_states() == [] and engine.lora_stats().gpu_slots_used == 1
    for request_id, more in run(engine).items():
        outs.setdefault(request_id, []).extend(more)
    assert tokens(outs["running"]) == alone(llama, variants["v4"], prompt(5, 6), 6)
    assert tokens(outs["queued"]) == alone(llama, variants["v4"], prompt(6, 7), 4)
    stats = engine.lora_stats()
    assert (stats.gpu_slots_used, stats.host_entries, stats.host_bytes) == (0, 0, 0)


def test_load_inplace_keeps_old_requests_on_old_weights_and_new_on_new(llama, variants):
    engine = make_engine(llama, {"live": variants["v0"]}, max_num_seqs=1)
    engine.add_request("old-running", prompt(5, 9), greedy(5), "live")
    engine.add_request("old-queued", prompt(4, 10), greedy(3), "live")
    outs = step_collecting(engine, 2)
    engine.add_adapter("live", variants["v1"], load_inplace=True)
    (state,) = engine.adapter_states()
    assert (state.version, state.path) == (2, variants["v1"])
    engine.add_request("new", prompt(5, 9), greedy(5), "live")
    for request_id, more in run(engine).items():
        outs.setdefault(request_id, []).extend(more)
    assert tokens(outs["old-running"]) == alone(llama, variants["v0"], prompt(5, 9), 5)
    assert tokens(outs["old-queued"]) == alone(llama, variants["v0"], prompt(4, 10), 3)
    assert tokens(outs["new"]) == alone(llama, variants["v1"], prompt(5, 9), 5)
    assert engine.lora_stats().gpu_slots_used == 1           # the old version is gone


def test_adapter_loaded_during_traffic_serves_new_requests(llama, variants):
    engine = make_engine(llama, {"v0": variants["v0"]})
    arrivals = {0: [("a", prompt(6, 11), greedy(8), "v0")], 3: [("b", prompt(4, 12), greedy(3), None)]}
    outs = {}
    for step in range(4):
        for args in arrivals.get(step, []):
            engine.add_request(*args)
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    engine.add_adapter("v5", variants["v5"])
    engine.add_request("c", prompt(5, 13), greedy(4), "v5")
    for request_id, more in run(engine).items():
        outs.setdefault(request_id, []).extend(more)
    assert tokens(outs["a"]) == alone(llama, variants["v0"], prompt(6, 11), 8)
    assert tokens(outs["c"]) == alone(llama, variants["v5"], prompt(5, 13), 4)


# fairness


@pytest.mark.parametrize("max_bypasses, cold_finishes", [(4, True), (10_000, False)])
def test_hot_adapter_cannot_starve_a_cold_one(llama, variants, max_bypasses, cold_finishes):
    """One slot, a hot adapter with a new request every step; the bypass cap lets slots drain for the cold one."""
    engine = make_engine(llama, {"hot": variants["v0"], "cold": variants["v1"]}, max_loras=1,
                         max_adapter_bypasses=max_bypasses, max_num_seqs=8)
    arrivals = {step: [(f"h{step}", prompt(3, step), greedy(4), "hot")] for step in range(60)}
    arrivals[2].append(("cold", prompt(4, 99), greedy(3), "cold"))
    outs: dict[str, list] = {}
    for step in range(60):
        for args in arrivals[step]:
            engine.add_request(*args)
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    cold_done = "cold" in outs and outs["cold"][-1].finish_reason is not None
    assert cold_done == cold_finishes
    if cold_finishes:
        assert tokens(outs["cold"]) == alone(llama, variants["v1"], prompt(4, 99), 3)
        hot_done = sum(1 for k, v in outs.items() if k.startswith("h") and v[-1].finish_reason)
        assert hot_done >= 40            # the hot stream kept going around it


# auto-load, failures, pinning


def test_unknown_name_under_a_lora_dir_loads_on_first_use(llama, variants, tmp_path):
    shutil.copytree(variants["v2"], tmp_path / "found")
    engine = make_engine(llama, lora_dirs=[str(tmp_path)])
    outs = run(engine, {0: [("x", prompt(5, 14), greedy(4), "found")]})
    assert tokens(outs["x"]) == alone(llama, variants["v2"], prompt(5, 14), 4)
    assert [(s.name, s.path) for s in engine.adapter_states()] == [("found", str(tmp_path / "found"))]
    for name in ("missing", "../found", str(tmp_path / "found")):
        with pytest.raises(AdapterError, match="does not exist") as err:
            engine.add_request("y", [1, 2], greedy(1), name)
        assert err.value.status_code == 404


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "blocking"])
def test_adapter_that_cannot_be_read_ends_its_requests_with_an_error(llama, variants, tmp_path, overlap):
    path = tmp_path / "doomed"
    shutil.copytree(variants["v3"], path)
    engine = make_engine(llama, {"doomed": str(path)}, overlap=overlap)
    (path / "adapter_model.safetensors").write_bytes(b"gone bad after registration")
    outs = run(engine, {0: [("x", prompt(4, 15), greedy(3), "doomed"), ("base", prompt(4, 16), greedy(3), None)]})
    assert outs["x"][-1].finish_reason == "error" and tokens(outs["x"]) == []
    assert "Loading LoRA adapter 'doomed' failed" in outs["x"][-1].error
    assert tokens(outs["base"]) == alone(llama, None, prompt(4, 16), 3)
    assert engine.lora_stats().gpu_slots_used == 0 and not engine.has_unfinished()


def test_pinned_adapter_is_never_evicted(llama, variants):
    engine = make_engine(llama, max_loras=2, max_cpu_loras=2)
    engine.add_adapter("pin", variants["v0"], pinned=True)
    for name in ("v1", "v2", "v3"):
        engine.add_adapter(name, variants[name])
    run(engine, {0: [("p", prompt(3, 17), greedy(2), "pin")]})
    slot = engine.scheduler.slots.slot_of(engine.adapters.refs["pin"])
    for i, name in enumerate(["v1", "v2", "v3", "v1"]):
        run(engine, {0: [(f"r{i}", prompt(3, i), greedy(2), name)]})
        assert engine.scheduler.slots.slot_of(engine.adapters.refs["pin"]) == slot
        assert engine.host_cache.is_filled(engine.adapters.refs["pin"])
    assert [s.pinned for s in engine.adapter_states()] == [True, False, False, False]
    with pytest.raises(AdapterError, match="Cannot pin LoRA adapter 'v1': 1 adapters are pinned already"):
        engine.add_adapter("v1", variants["v1"], load_inplace=True, pinned=True)
