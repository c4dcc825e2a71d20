"""Adapter loads in the engine (lora/loads.py): disk -> host -> GPU transitions and their counters, overlap
loading (a request waits for its adapter while others run), eviction safety, fairness between a hot and a
cold adapter, and reads that fail. Every output is checked against the same request run alone."""
from __future__ import annotations

import random
import shutil
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.worker.lora.engine_runs import alone, greedy, make_engine, prompt, residency, run, tokens
from worker.engine import Engine

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
    # each copy moves the adapter's own entry (its rank and projections), less than a slot
    specs = [v.spec for v in engine.adapters.registry.versions.values()]
    entry_bytes = [engine.adapters.packer.entry_bytes(spec) for spec in specs]
    assert stats.gpu.loaded_bytes == sum(entry_bytes) and min(entry_bytes) < engine.runner.lora_pool.layout.num_bytes
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
    gate, read = threading.Event(), engine.adapters.reader.read
    engine.adapters.reader.read = lambda spec, out=None: (gate.wait(30), read(spec, out))[1]
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
    finished, released = engine.adapters.pool.finished_loads, threading.Event()
    engine.adapters.pool.finished_loads = lambda: finished() if released.is_set() else []
    schedules, issued_at, admitted_at = [], [], []
    schedule, load = engine.scheduler.schedule, engine.adapters.pool.start_load

    def counting_schedule():
        batch = schedule()
        schedules.append(batch)
        if any(s.request.request_id == "x" for s in batch.seqs) and not admitted_at:
            admitted_at.append(len(schedules))
        return batch
    engine.scheduler.schedule = counting_schedule
    engine.adapters.pool.start_load = lambda *args: (issued_at.append(len(schedules)), load(*args))
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
    pool = engine.adapters.pool
    schedule, load, finished = engine.scheduler.schedule, pool.start_load, pool.finished_loads
    engine.scheduler.schedule = lambda: (b := schedule(), order.append(("schedule", bool(b.seqs))))[0]
    pool.start_load = lambda *args: (order.append(("copy", None)), load(*args))
    pool.finished_loads = lambda: (done := finished(), order.extend(("done", None) for _ in done))[0]
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
    with a finished copy or one the step waits for on the device (`AdapterLoads.join` since the copy)."""

    def __init__(self, engine: Engine):
        self.engine, self.content, self.done, self.joined = engine, {}, set(), set()
        pool = engine.adapters.pool
        load, finished, execute, wait = pool.start_load, pool.finished_loads, engine.runner.execute, pool.wait_for

        def watch_load(slot, packed, rank, key, layout=None):
            users = [r for r in engine.scheduler.running if slot in self.content and r.adapter == self.content[slot]]
            assert not users, f"slot {slot} overwritten while {len(users)} running requests use it"
            self.content[slot] = key
            self.done.discard(slot)
            self.joined.discard(slot)
            load(slot, packed, rank, key, layout)

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
        pool.start_load, pool.finished_loads = watch_load, watch_finished
        pool.wait_for, engine.runner.execute = watch_wait, watch_execute


@pytest.mark.parametrize("overlap, policy, threads", [(True, "lru", False), (True, "fifo", False),
                                                     (False, "lru", False), (True, "lru", True)])
@pytest.mark.parametrize("seed", [0, 1])
def test_many_adapters_few_slots_every_output_equals_the_request_alone(llama, variants, overlap, policy, threads,
                                                                      seed, monkeypatch):
    """threads: reads on the reader's threads, each split in parts read side by side (inline otherwise)."""
    if threads:
        from worker.lora import file_reads
        monkeypatch.setattr(file_reads, "MIN_PART_BYTES", 1000)
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


# reads that fail


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


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_adapter_with_nan_weights_ends_its_requests_with_an_error_and_the_rest_run_on(llama, variants, tmp_path,
                                                                                     async_scheduling):
    path = tmp_path / "nan"
    shutil.copytree(variants["v1"], path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save_file({k: torch.full_like(t, float("nan")) if "lora_B" in k else t for k, t in tensors.items()},
              str(path / "adapter_model.safetensors"))
    engine = make_engine(llama, {"nan": str(path), "v2": variants["v2"]}, async_scheduling=async_scheduling)
    outs = run(engine, {0: [("x", prompt(5, 20), greedy(6), "nan"), ("y", prompt(4, 21), greedy(6), "v2"),
                            ("base", prompt(6, 22), greedy(6), None)]})
    assert tokens(outs["x"]) == [] and outs["x"][-1].finish_reason == "error"
    assert outs["x"][-1].error == ("The model's output for this request with LoRA adapter 'nan' was not finite "
                                   "(nan or inf).")
    assert tokens(outs["y"]) == alone(llama, variants["v2"], prompt(4, 21), 6)
    assert tokens(outs["base"]) == alone(llama, None, prompt(6, 22), 6)
    assert not engine.has_unfinished() and engine.num_running == 0
