"""Adapter observability and runtime loading on the gateway side: GET /v1/adapters, auto-load from
--lora-dir, adapter-tier metrics, the new flags; then the worker's side of it through a real worker."""
from __future__ import annotations

import json
from contextlib import asynccontextmanager

import httpx
import pytest

from fake_worker_client import FakeWorkerClient, build_tokenizer
from gateway.__main__ import build_parser
from gateway.app import build_app
from gateway.config import GatewayConfig, LoRAModulePath
from gateway.worker_client import WorkerClient
from tests.hf_fixtures import ADAPTERS, adapter_dir
from worker.config import CacheConfig, LoRAConfig, ModelConfig, WorkerConfig
from worker.ipc.messages import (AdapterCommandResult, AdapterState, AddRequest, LoRAStats, LoRATierStats,
                                 SamplingParams, Stats)

TOKENIZER = build_tokenizer()
BASE, MODEL_DIR = "base", "/models/base"
SQL = AdapterState(name="sql", path="/adapters/sql", version=2, residency="gpu", slot=1, rank=16,
                   target_modules=["q_proj", "v_proj"], pinned=True, last_used=1700000000.5, disk_load_ms=12.5,
                   gpu_load_ms=1.75, num_running=3, num_waiting=1)


@asynccontextmanager
async def serve(lora_dirs=(),
                modules=(LoRAModulePath("sql", "/adapters/sql", pinned=True), LoRAModulePath("poet", "/p"))):
    client = FakeWorkerClient(lambda request: TOKENIZER.encode("hello"))
    worker = WorkerConfig(ModelConfig(MODEL_DIR), lora=LoRAConfig(lora_dirs=lora_dirs))
    config = GatewayConfig(worker, served_model_names=(BASE,), lora_modules=modules, allow_runtime_lora_updating=True)
    app = build_app(config, client, TOKENIZER)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
            yield http, client


async def test_adapters_list_the_worker_state_of_each_served_adapter():
    async with serve() as (http, client):
        client.adapter_results[""] = AdapterCommandResult(0, ok=True, adapters=[SQL])
        listed = (await http.get("/v1/adapters")).json()
        one = (await http.get("/v1/adapters/sql")).json()
        missing = await http.get("/v1/adapters/nope")
    sql = {"id": "sql", "object": "lora_adapter", "path": "/adapters/sql", "base_model": BASE,
           "created": listed["data"][0]["created"], "pinned": True, "residency": "gpu", "loading": False,
           "slot": 1, "rank": 16, "target_modules": ["q_proj", "v_proj"], "version": 2,
           "last_used": 1700000000.5, "load_time_ms": {"disk": 12.5, "gpu": 1.75}, "num_running": 3,
           "num_waiting": 1}
    poet = {"id": "poet", "object": "lora_adapter", "path": "/p", "base_model": BASE,
            "created": listed["data"][1]["created"], "pinned": False, "residency": "disk", "loading": False,
            "slot": None, "rank": None, "target_modules": None, "version": None, "last_used": None,
            "load_time_ms": {"disk": None, "gpu": None}, "num_running": 0, "num_waiting": 0}
    assert listed == {"object": "list", "data": [sql, poet], "adapters_loading": 0}
    assert one == sql
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "The lora adapter 'nope' cannot be found."
    assert client.adapter_commands[-1] == ("list", "", None, False, False)


async def test_adapters_being_read_into_host_memory_are_counted_and_shown_loading():
    poet = AdapterState(name="poet", path="/p", version=1, residency="disk", loading=True, rank=8,
                        target_modules=["q_proj"])
    async with serve() as (http, client):
        client.adapter_results[""] = AdapterCommandResult(0, ok=True, adapters=[SQL, poet])
        client.stats = Stats(num_running=0, num_waiting=0, num_adapters_loading=1)
        listed = (await http.get("/v1/adapters")).json()
    assert listed["adapters_loading"] == 1
    assert [(c["id"], c["residency"], c["loading"]) for c in listed["data"]] == [
        ("sql", "gpu", False), ("poet", "disk", True)]


async def test_adapters_answer_the_worker_error():
    async with serve() as (http, client):
        client.adapter_results[""] = AdapterCommandResult(0, ok=False, status_code=503, message="worker died")
        response = await http.get("/v1/adapters")
    assert response.status_code == 503 and response.json()["error"]["message"] == "worker died"


async def test_unknown_model_found_under_a_lora_dir_is_served_on_first_use(tmp_path):
    (tmp_path / "found").mkdir()
    (tmp_path / "found" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (tmp_path / "empty").mkdir()
    async with serve(lora_dirs=(str(tmp_path),)) as (http, client):
        before = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
        found = await http.post("/v1/completions", json={"model": "found", "prompt": "hi", "max_tokens": 2})
        after = {m["id"]: m for m in (await http.get("/v1/models")).json()["data"]}
        missing = await http.post("/v1/completions", json={"model": "empty", "prompt": "hi"})
        outside = await http.post("/v1/completions", json={"model": "../found", "prompt": "hi"})
    assert "found" not in before and found.status_code == 200
    assert client.requests[-1].lora_name == "found"
    assert (after["found"]["root"], after["found"]["parent"]) == (str(tmp_path / "found"), BASE)
    assert missing.status_code == 404 and outside.status_code == 404
    assert client.adapter_commands[2:] == [("load", "found", str(tmp_path / "found"), False, False)]


async def test_metrics_describe_the_adapter_tiers():
    tier = dict(load_seconds_counts=[1, 0, 2], load_seconds_sum=0.25)
    lora = LoRAStats(gpu_slots_used=3, gpu_slots_total=8, host_entries=5, host_capacity=16, host_bytes=4096,
                     load_seconds_buckets=[0.001, 0.01],
                     host=LoRATierStats(hits=4, misses=6, loads=6, loaded_bytes=2048, evictions=1, **tier),
                     gpu=LoRATierStats(hits=7, misses=3, loads=3, loaded_bytes=1024, evictions=2, **tier))
    async with serve() as (http, client):
        client.stats = Stats(num_running=1, num_waiting=0, lora=lora)
        text = (await http.get("/metrics")).text
    model = 'model_name="base"'
    lines = set(text.splitlines())
    for line in (f"loraplex:lora_gpu_slots_used{{{model}}} 3.0", f"loraplex:lora_gpu_slots_total{{{model}}} 8.0",
                 f"loraplex:lora_host_cache_adapters{{{model}}} 5.0",
                 f"loraplex:lora_host_cache_bytes{{{model}}} 4096.0",
                 f'loraplex:lora_cache_hits_total{{{model},tier="gpu"}} 7.0',
                 f'loraplex:lora_cache_misses_total{{{model},tier="host"}} 6.0',
                 f'loraplex:lora_loads_total{{{model},tier="gpu"}} 3.0',
                 f'loraplex:lora_loaded_bytes_total{{{model},tier="host"}} 2048.0',
                 f'loraplex:lora_evictions_total{{{model},tier="gpu"}} 2.0',
                 f'loraplex:lora_load_latency_seconds_bucket{{le="0.001",{model},tier="gpu"}} 1.0',
                 f'loraplex:lora_load_latency_seconds_bucket{{le="0.01",{model},tier="gpu"}} 1.0',
                 f'loraplex:lora_load_latency_seconds_bucket{{le="+Inf",{model},tier="gpu"}} 3.0',
                 f'loraplex:lora_load_latency_seconds_sum{{{model},tier="host"}} 0.25',
                 "# TYPE loraplex:lora_cache_hits_total counter",
                 "# TYPE loraplex:lora_load_latency_seconds histogram"):
        assert line in lines, line


@pytest.mark.parametrize("flags, overlap, policy, fully_sharded", [
    ([], True, "lru", False),
    (["--no-enable-lora-overlap-loading"], False, "lru", False),
    (["--enable-lora-overlap-loading", "--lora-eviction-policy", "fifo"], True, "fifo", False),
    (["--fully-sharded-loras", "-tp", "2"], True, "lru", True)])
def test_adapter_flags_reach_the_worker_config(flags, overlap, policy, fully_sharded):
    args = build_parser().parse_args(["serve", "--model", "/m", "--lora-dir", "/a", "--lora-dir", "/b",
                                      "--max-cpu-loras", "9", *flags])
    args.model = args.model or args.model_tag
    lora = GatewayConfig.from_args(args).worker.lora
    assert lora == LoRAConfig(max_cpu_loras=9, enable_lora_overlap_loading=overlap, lora_eviction_policy=policy,
                              lora_dirs=("/a", "/b"), fully_sharded_loras=fully_sharded)


def test_unknown_eviction_policy_is_refused(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "/m", "--lora-eviction-policy", "random"])
    assert "invalid choice: 'random'" in capsys.readouterr().err


async def test_a_real_worker_reports_adapter_residency_and_tier_stats(hf_models):
    llama = hf_models["llama"]
    config = WorkerConfig(ModelConfig(str(llama)), cache=CacheConfig(block_size=4, num_gpu_blocks_override=128),
                          lora=LoRAConfig(max_loras=1), device="cpu")
    client = WorkerClient(config)
    await client.start()
    try:
        for spec in ADAPTERS[:2]:
            assert (await client.adapter_command("load", spec.name, str(adapter_dir(llama, spec.name)))).ok
        before = (await client.adapter_command("list", "")).adapters
        params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        outputs = [o async for o in client.generate(AddRequest("a", [5, 6, 7], params, ADAPTERS[1].name))]
        after = (await client.adapter_command("list", "")).adapters
        stats = client.stats.lora
    finally:
        await client.shutdown()
    assert [(s.name, s.residency, s.rank, s.version) for s in before] == \
        [(ADAPTERS[0].name, "disk", 4, 1), (ADAPTERS[1].name, "disk", 8, 1)]
    assert sum(len(o.new_token_ids) for o in outputs) == 3
    state = {s.name: s for s in after}[ADAPTERS[1].name]
    assert (state.residency, state.slot, state.target_modules) == ("gpu", 0, list(ADAPTERS[1].targets))
    assert state.gpu_load_ms is not None and state.disk_load_ms is not None and state.last_used is not None
    assert (stats.gpu_slots_used, stats.gpu_slots_total, stats.gpu.loads, stats.host.misses) == (1, 1, 1, 1)


async def test_a_moe_adapter_lists_the_experts_it_adapts(hf_moe_models, tmp_path):
    """GET /v1/adapters on what a real engine over Qwen2-MoE reports for a PEFT adapter on the experts
    (target_parameters), the attention, the shared expert and the dense layer's MLP."""
    from tests.moe_fixtures import PeftExpertAdapter, save_peft_expert_adapter
    from worker.engine import Engine
    model_dir = hf_moe_models["qwen2_moe"]
    spec = PeftExpertAdapter("moe", 4, alpha=8, modules=("q_proj", "gate_proj", "up_proj", "down_proj"),
                             rank_pattern={"gate_up_proj": 6})
    save_peft_expert_adapter(model_dir, spec, tmp_path / "moe", seed=0)
    engine = Engine(WorkerConfig(ModelConfig(str(model_dir)), cache=CacheConfig(num_gpu_blocks_override=16),
                                 lora=LoRAConfig(max_loras=1, max_lora_rank=8), device="cpu"))
    engine.add_adapter("moe", str(tmp_path / "moe"))
    async with serve(modules=(LoRAModulePath("moe", str(tmp_path / "moe")),)) as (http, client):
        client.adapter_results[""] = AdapterCommandResult(0, ok=True, adapters=engine.adapter_states())
        card = (await http.get("/v1/adapters/moe")).json()
    assert card["target_modules"] == ["q_proj", "gate_proj", "up_proj", "down_proj", "shared_expert.gate_proj",
                                      "shared_expert.up_proj", "shared_expert.down_proj", "experts.gate_proj",
                                      "experts.up_proj", "experts.down_proj"]
    assert card["rank"] == 6
