"""The adapter registry in the engine (lora/registry.py): runtime load / unload / load_inplace during
traffic, no name registered by a request, pinning. Every output is checked against the same request run alone."""
from __future__ import annotations

import logging
import re
import shutil
import time

import pytest

from tests.worker.lora.engine_runs import ManualExecutor, alone, greedy, make_engine, prompt, run, tokens
from worker.engine import Engine
from worker.lora.adapter import AdapterError
from worker.lora.host_cache_plan import HOST_CACHE_FRACTION, HostCachePlanError, available_host_bytes

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


# registration, pinning


def test_a_request_never_registers_its_adapter_only_a_load_does(llama, variants, tmp_path):
    """The gateway loads a --lora-dir adapter before its first request; a request naming one that is not
    loaded (its unload raced it) is 404 and leaves nothing registered, so both processes keep the same names."""
    shutil.copytree(variants["v2"], tmp_path / "found")
    engine = make_engine(llama, lora_dirs=[str(tmp_path)])
    for name in ("found", "missing", "../found", str(tmp_path / "found")):
        with pytest.raises(AdapterError, match="does not exist") as err:
            engine.add_request("y", [1, 2], greedy(1), name)
        assert err.value.status_code == 404
    assert engine.adapter_states() == []
    engine.add_adapter("found", str(tmp_path / "found"))
    outs = run(engine, {0: [("x", prompt(5, 14), greedy(4), "found")]})
    assert tokens(outs["x"]) == alone(llama, variants["v2"], prompt(5, 14), 4)
    assert [(s.name, s.path) for s in engine.adapter_states()] == [("found", str(tmp_path / "found"))]


def test_pinned_adapter_is_never_evicted(llama, variants):
    engine = make_engine(llama, max_loras=2, max_cpu_loras=2)
    engine.add_adapter("pin", variants["v0"], pinned=True)
    for name in ("v1", "v2", "v3"):
        engine.add_adapter(name, variants[name])
    run(engine, {0: [("p", prompt(3, 17), greedy(2), "pin")]})
    slot = engine.adapters.slots.slot_of(engine.adapters.registry.refs["pin"])
    for i, name in enumerate(["v1", "v2", "v3", "v1"]):
        run(engine, {0: [(f"r{i}", prompt(3, i), greedy(2), name)]})
        assert engine.adapters.slots.slot_of(engine.adapters.registry.refs["pin"]) == slot
        assert engine.adapters.host_cache.is_filled(engine.adapters.registry.refs["pin"])
    assert [s.pinned for s in engine.adapter_states()] == [True, False, False, False]
    with pytest.raises(AdapterError, match="Cannot pin LoRA adapter 'v1': 1 adapters are pinned already"):
        engine.add_adapter("v1", variants["v1"], load_inplace=True, pinned=True)


# warm static adapters (--lora-modules)

def test_warm_adapters_are_read_into_the_host_cache_before_any_request(llama, variants):
    engine = make_engine(llama, max_cpu_loras=2)
    for name in ("v0", "v1", "v4"):                         # the third finds the host cache full: not read
        engine.add_adapter(name, variants[name], warm=True)
    engine.add_adapter("cold", variants["v0"])              # not warm: read on first use
    engine.adapters.loads.collect()                         # file the reads (inline executor: done already)
    residency = {s.name: s.residency for s in engine.adapter_states()}
    assert residency == {"v0": "host", "v1": "host", "v4": "disk", "cold": "disk"}
    outs = run(engine, {0: [("r", prompt(5, 6), greedy(4), "v1")]})
    assert tokens(outs["r"]) == alone(llama, variants["v1"], prompt(5, 6), 4)
    host = engine.lora_stats().host
    assert (host.hits, host.misses, host.loads) == (1, 0, 2)   # its first request found it in host memory


def test_warm_reads_are_filed_while_the_engine_is_idle(llama, variants):
    engine = make_engine(llama, max_cpu_loras=4, threads=True)
    for name in ("v0", "v1"):
        engine.add_adapter(name, variants[name], warm=True)
    deadline = time.monotonic() + 30
    while engine.has_background_work() and time.monotonic() < deadline:     # what the idle worker loop does
        assert engine.idle_poll() == []
        time.sleep(0.005)
    assert not engine.has_background_work() and not engine.has_unfinished()
    assert {s.name: (s.residency, s.loading) for s in engine.adapter_states()} == {
        "v0": ("host", False), "v1": ("host", False)}


def test_warm_reads_are_counted_and_logged_until_the_last_is_filed(llama, variants, caplog):
    """num_adapters_loading (the /health header's count) while the reads are held back, each such adapter's state,
    and the log's first line once the registrations pause, its last once every read is filed."""
    caplog.set_level(logging.INFO, logger="worker.warm_read_log")
    engine = make_engine(llama, max_cpu_loras=4)
    engine.adapters.reader.executor = held = ManualExecutor()
    for name in ("v0", "v1", "v2"):
        engine.add_adapter(name, variants[name], warm=True)
    engine.add_adapter("cold", variants["v3"])              # not warm: no read until a request needs it
    assert engine.num_adapters_loading == 3
    assert {s.name: (s.residency, s.loading) for s in engine.adapter_states()} == {
        "v0": ("disk", True), "v1": ("disk", True), "v2": ("disk", True), "cold": ("disk", False)}
    deadline = time.monotonic() + 30
    while not caplog.records and time.monotonic() < deadline:  # the first line waits for the registrations to pause
        assert engine.idle_poll() == []
        time.sleep(0.01)
    assert [r.getMessage() for r in caplog.records] == ["reading 3 adapters into host memory"]
    assert engine.num_adapters_loading == 3
    held.run_all()
    while engine.has_background_work():
        assert engine.idle_poll() == []
    assert engine.num_adapters_loading == 0
    assert {s.name: s.residency for s in engine.adapter_states()} == {
        "v0": "host", "v1": "host", "v2": "host", "cold": "disk"}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and re.fullmatch(r"all 3 adapters read into host memory in \d+\.\d s", messages[1])


def test_the_host_cache_is_bounded_by_half_the_available_memory_and_refuses_a_host_too_small(llama, monkeypatch):
    available = available_host_bytes()
    if available is None:
        pytest.skip("no /proc/meminfo here")
    # MemAvailable read once: the engines plan against this figure, not one the machine's other work has moved
    monkeypatch.setattr("worker.lora.host_cache_plan.available_host_bytes", lambda: available)
    sized = make_engine(llama, max_cpu_loras=7)
    assert sized.adapters.host_cache.capacity == 7
    assert sized.adapters.host_cache.capacity_bytes == int(available * HOST_CACHE_FRACTION)
    slot = sized.runner.lora_pool.layout.num_bytes
    monkeypatch.setattr("worker.lora.host_cache_plan.available_host_bytes", lambda: slot)    # half a slot allowed
    with pytest.raises(HostCachePlanError, match="cannot hold 1 adapter"):
        make_engine(llama)