"""/metrics: vLLM's series (names, types, labels, help texts, buckets as vLLM 0.33.0's PrometheusStatLogger
defines them in vllm/v1/metrics/loggers.py and buckets.py), moved by scripted requests through the fake
worker client, and request phases timed as vLLM times them."""
from __future__ import annotations

import re

import pytest

from fake_worker_client import FakeWorkerClient
from gateway.metrics import Metrics
from gateway_app import ADAPTER, BASE, serve
from worker.config import CacheConfig
from worker.ipc.messages import LoadedAdapter, LoRAStats, LoRATierStats, Ready, RequestOutput, Stats

ENGINE = ("engine", "model_name")
# vLLM 0.33.0, vllm/v1/metrics/buckets.py
REQUEST_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0]
TIME_TO_FIRST_TOKEN = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
INTER_TOKEN_LATENCY = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                       40.0, 80.0]
REQUEST_TOKENS_256 = [1, 2, 5, 10, 20, 50, 100, 200]        # build_1_2_5_buckets(max_model_len=256)

# name: (type, labels, help text), as vllm/v1/metrics/loggers.py (vLLM 0.33.0) registers them
FAMILIES = {
    "vllm:num_requests_running": ("gauge", ENGINE, "Number of requests in model execution batches."),
    "vllm:num_requests_waiting": ("gauge", ENGINE, "Number of requests waiting to be processed."),
    "vllm:kv_cache_usage_perc": ("gauge", ENGINE, "KV-cache usage. 1 means 100 percent usage."),
    "vllm:num_preemptions": ("counter", ENGINE, "Cumulative number of preemption from the engine."),
    "vllm:prompt_tokens": ("counter", ENGINE, "Number of prefill tokens processed."),
    "vllm:generation_tokens": ("counter", ENGINE, "Number of generation tokens processed."),
    "vllm:request_success": ("counter", (*ENGINE, "finished_reason"), "Count of successfully processed requests."),
    "vllm:request_prompt_tokens": ("histogram", ENGINE, "Number of prefill tokens processed."),
    "vllm:request_generation_tokens": ("histogram", ENGINE, "Number of generation tokens processed."),
    "vllm:request_params_max_tokens": ("histogram", ENGINE, "Histogram of the max_tokens request parameter."),
    "vllm:time_to_first_token_seconds": ("histogram", ENGINE, "Histogram of time to first token in seconds."),
    "vllm:inter_token_latency_seconds": ("histogram", ENGINE, "Histogram of inter-token latency in seconds."),
    "vllm:request_time_per_output_token_seconds": ("histogram", ENGINE,
                                                   "Histogram of time_per_output_token_seconds per request."),
    "vllm:e2e_request_latency_seconds": ("histogram", ENGINE, "Histogram of e2e request latency in seconds."),
    "vllm:request_queue_time_seconds": ("histogram", ENGINE, "Histogram of time spent in WAITING phase for request."),
    "vllm:request_inference_time_seconds": ("histogram", ENGINE,
                                            "Histogram of time spent in RUNNING phase for request."),
    "vllm:request_prefill_time_seconds": ("histogram", ENGINE,
                                          "Histogram of time spent in PREFILL phase for request."),
    "vllm:request_decode_time_seconds": ("histogram", ENGINE, "Histogram of time spent in DECODE phase for request."),
    "vllm:lora_requests_info": ("gauge", ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
                                "Running stats on lora requests."),
    "vllm:cache_config_info": ("gauge", ("block_size", "cache_dtype", "enable_prefix_caching", "engine",
                                         "gpu_memory_utilization", "num_gpu_blocks"),
                               "Information of the LLMEngine CacheConfig"),
}
BUCKETS = {
    "vllm:request_prompt_tokens": REQUEST_TOKENS_256, "vllm:request_generation_tokens": REQUEST_TOKENS_256,
    "vllm:request_params_max_tokens": REQUEST_TOKENS_256,
    "vllm:time_to_first_token_seconds": TIME_TO_FIRST_TOKEN,
    "vllm:inter_token_latency_seconds": INTER_TOKEN_LATENCY,
    "vllm:request_time_per_output_token_seconds": INTER_TOKEN_LATENCY,
    **{name: REQUEST_LATENCY for name in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                                          "vllm:request_inference_time_seconds", "vllm:request_prefill_time_seconds",
                                          "vllm:request_decode_time_seconds")},
}
TOKEN = 272


def four_token_client() -> FakeWorkerClient:
    """Answers with TOKEN until max_tokens; the worker scheduled each request at once."""
    return FakeWorkerClient(lambda request: [TOKEN] * 8, queue_time=0.0)


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\} (\S+)$')


def samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample line; label text must be in sorted order, as prometheus_client
    writes it."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, label_text, value = SAMPLE.match(line).groups()
        pairs = re.findall(r'([a-z_]+)="((?:[^"\\]|\\.)*)"', label_text)
        assert [key for key, _ in pairs] == sorted(key for key, _ in pairs), line
        out.append((name, dict(pairs), float(value)))
    return out


def value(text: str, name: str, **labels: str) -> float:
    found = [v for n, found_labels, v in samples(text) if n == name and labels.items() <= found_labels.items()]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def buckets(text: str, name: str) -> list[float]:
    return [float(labels["le"]) for n, labels, _ in samples(text) if n == f"{name}_bucket"]


async def scrape_after_one_request() -> str:
    async with serve(four_token_client()) as (http, client, app):
        await http.post("/v1/completions", json={"model": ADAPTER, "prompt": "hello", "max_tokens": 4})
        return (await http.get("/metrics")).text


@pytest.mark.parametrize("name", FAMILIES)
async def test_each_vllm_family_has_vllms_type_labels_and_help(name):
    text = await scrape_after_one_request()
    kind, label_names, help_text = FAMILIES[name]
    family = f"{name}_total" if kind == "counter" else name     # prometheus_client names a counter by its sample
    lines = text.splitlines()
    assert f"# HELP {family} {help_text}" in lines and f"# TYPE {family} {kind}" in lines
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",)}.get(kind, ("",))
    found = [(n, tuple(sorted(labels))) for n, labels, _ in samples(text) if n in {name + s for s in suffixes}]
    expected_labels = {tuple(sorted(label_names)), tuple(sorted((*label_names, "le")))}
    assert found and {labels for _, labels in found} <= expected_labels
    assert {n for n, _ in found} == {name + s for s in suffixes}


@pytest.mark.parametrize("name", BUCKETS)
async def test_histogram_buckets_are_vllms(name):
    text = await scrape_after_one_request()
    assert buckets(text, name) == [*BUCKETS[name], float("inf")]


async def test_token_buckets_past_a_million_are_written_as_go_writes_them():
    metrics = Metrics(BASE, 4, 16, 0.9)
    metrics.engine_ready(Ready(max_model_len=1_048_576, vocab_size=320, eos_token_ids=[2], num_kv_blocks=64))
    text = metrics.render(Stats(num_running=0, num_waiting=0))
    assert 'le="500000.0"' in text and 'vllm:request_prompt_tokens_bucket{engine="0",le="1e+06",model_name="base"} 0' \
        in text


async def test_one_request_moves_the_counters_and_histograms():
    async with serve(four_token_client()) as (http, client, app):
        client.stats = Stats(num_running=3, num_waiting=2, running_adapters=[ADAPTER], waiting_adapters=[])
        before = (await http.get("/metrics")).text
        await http.post("/v1/completions", json={"model": ADAPTER, "prompt": "hello", "max_tokens": 4})
        response = await http.get("/metrics")
    after, model = response.text, {"model_name": BASE, "engine": "0"}
    assert response.headers["content-type"].startswith("text/plain")
    assert value(after, "vllm:num_requests_running", **model) == 3
    assert value(after, "vllm:num_requests_waiting", **model) == 2
    assert value(after, "vllm:request_success_total", finished_reason="length", **model) == 1
    prompt_tokens = value(after, "vllm:prompt_tokens_total", **model) - value(before, "vllm:prompt_tokens_total")
    assert prompt_tokens == 1
    assert value(after, "vllm:generation_tokens_total", **model) == 4
    counts = {name: value(after, f"{name}_count", **model) for name in BUCKETS}
    assert counts == {**dict.fromkeys(BUCKETS, 1), "vllm:inter_token_latency_seconds": 3}
    assert value(after, "vllm:request_prompt_tokens_sum") == 1 and value(after, "vllm:request_generation_tokens_sum") == 4
    assert value(after, "vllm:request_params_max_tokens_bucket", le="2.0") == 0
    assert value(after, "vllm:request_params_max_tokens_bucket", le="5.0") == 1
    assert value(after, "loraplex:lora_requests_total", model_name=BASE, lora_name=ADAPTER) == 1
    assert value(after, "loraplex:lora_generation_tokens_total", model_name=BASE, lora_name=ADAPTER) == 4


async def test_kv_cache_usage_and_preemptions_are_the_workers_latest_stats():
    async with serve() as (http, client, app):
        client.stats = Stats(num_running=1, num_waiting=0, kv_cache_usage=0.25, num_preemptions=3)
        first = (await http.get("/metrics")).text
        client.stats = Stats(num_running=1, num_waiting=0, kv_cache_usage=0.75, num_preemptions=5)
        second = (await http.get("/metrics")).text
    assert 'vllm:kv_cache_usage_perc{engine="0",model_name="base"} 0.25' in first.splitlines()
    assert 'vllm:num_preemptions_total{engine="0",model_name="base"} 3.0' in first.splitlines()
    assert (value(second, "vllm:kv_cache_usage_perc"), value(second, "vllm:num_preemptions_total")) == (0.75, 5)


async def test_cache_config_info_labels_the_block_size_and_the_workers_block_count():
    async with serve(cache=CacheConfig(block_size=32, gpu_memory_utilization=0.5)) as (http, client, app):
        text = (await http.get("/metrics")).text
    assert ('vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
            f'gpu_memory_utilization="0.5",num_gpu_blocks="{client.ready.num_kv_blocks}"}} 1.0') in text.splitlines()


async def test_lora_requests_info_is_one_series_of_the_latest_stats():
    async with serve() as (http, client, app):
        client.stats = Stats(num_running=1, num_waiting=1, running_adapters=[ADAPTER], waiting_adapters=["b", "c"])
        await http.get("/metrics")
        client.stats = Stats(num_running=0, num_waiting=0)
        text = (await http.get("/metrics")).text
    info = [(labels, v) for name, labels, v in samples(text) if name == "vllm:lora_requests_info"]
    assert [labels for labels, _ in info] == [{"max_lora": "4", "running_lora_adapters": "",
                                               "waiting_lora_adapters": ""}]
    assert info[0][1] > 1e9          # set to the current unix time, as vLLM's set_to_current_time()


LOAD_BUCKETS = [0.5, 2.0]


def lora_stats(loaded: list[LoadedAdapter], gpu_counts=(0, 0, 0), host_counts=(0, 0, 0)) -> LoRAStats:
    return LoRAStats(gpu_slots_used=sum(a.level == "gpu" for a in loaded), gpu_slots_total=2, host_entries=3,
                     host_capacity=None, host_bytes=0, load_seconds_buckets=LOAD_BUCKETS, loaded=loaded,
                     gpu=LoRATierStats(load_seconds_counts=list(gpu_counts), load_seconds_sum=0.25),
                     host=LoRATierStats(load_seconds_counts=list(host_counts), load_seconds_sum=3.0))


RESIDENCY = {   # name: (type, labels), as vLLM's open #54830 and llm-d-router's open #2792 name them
    "vllm:lora_adapter_loaded": ("gauge", (*ENGINE, "adapter_name", "level", "pinned", "rank")),
    "vllm:num_gpu_loaded_lora_adapters": ("gauge", ENGINE),
    "vllm:num_cpu_loaded_lora_adapters": ("gauge", ENGINE),
    "vllm:max_gpu_lora_adapters": ("gauge", ENGINE),
    "vllm:lora_adapter_load_seconds": ("histogram", (*ENGINE, "transition")),
}


def test_residency_families_have_the_open_pull_requests_names_types_and_labels():
    text = Metrics(BASE, 2, 16, 0.9).render(Stats(num_running=0, num_waiting=0, lora=lora_stats(
        [LoadedAdapter("a", "gpu", True, 8), LoadedAdapter("b", "cpu", False, 16)])))
    for name, (kind, label_names) in RESIDENCY.items():
        assert f"# TYPE {name} {kind}" in text.splitlines()
        suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
        found = {tuple(sorted(set(labels) - {"le"})) for n, labels, _ in samples(text) if n in {name + s for s in suffixes}}
        assert found == {tuple(sorted(label_names))}, name


def test_each_loaded_adapter_is_one_series_at_one_with_its_tier_pin_and_rank():
    text = Metrics(BASE, 2, 16, 0.9).render(Stats(num_running=0, num_waiting=0, lora=lora_stats(
        [LoadedAdapter("a", "gpu", True, 8), LoadedAdapter("b", "cpu", False, 16), LoadedAdapter("c", "gpu", False, 4)])))
    loaded = {(labels["adapter_name"], labels["level"], labels["pinned"], labels["rank"]): v
              for name, labels, v in samples(text) if name == "vllm:lora_adapter_loaded"}
    assert loaded == {("a", "gpu", "true", "8"): 1.0, ("b", "cpu", "false", "16"): 1.0, ("c", "gpu", "false", "4"): 1.0}
    assert value(text, "vllm:num_gpu_loaded_lora_adapters") == 2
    assert value(text, "vllm:num_cpu_loaded_lora_adapters") == 3     # the CPU tier counts the GPU's adapters too
    assert value(text, "vllm:max_gpu_lora_adapters") == 2


def test_an_evicted_or_unloaded_adapters_series_goes_with_it():
    metrics = Metrics(BASE, 2, 16, 0.9)
    before = metrics.render(Stats(num_running=0, num_waiting=0, lora=lora_stats([LoadedAdapter("a", "gpu", False, 8)])))
    after = metrics.render(Stats(num_running=0, num_waiting=0, lora=lora_stats([])))
    assert 'adapter_name="a"' in before and 'adapter_name="a"' not in after
    assert "# TYPE vllm:lora_adapter_loaded gauge" in after.splitlines()
    assert (value(after, "vllm:num_gpu_loaded_lora_adapters"), value(after, "vllm:num_cpu_loaded_lora_adapters"),
            value(after, "vllm:max_gpu_lora_adapters")) == (0, 0, 2)


def test_load_seconds_splits_disk_loads_from_activations():
    text = Metrics(BASE, 2, 16, 0.9).render(Stats(num_running=0, num_waiting=0, lora=lora_stats(
        [], gpu_counts=(3, 0, 0), host_counts=(0, 1, 1))))
    name = "vllm:lora_adapter_load_seconds"
    assert buckets(text, name) == [*LOAD_BUCKETS, float("inf")] * 2
    assert [(value(text, f"{name}_count", transition=t), value(text, f"{name}_sum", transition=t))
            for t in ("load", "activate")] == [(2, 3.0), (3, 0.25)]
    assert value(text, f"{name}_bucket", transition="load", le="2.0") == 1


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def timed_request(monkeypatch, outputs: list[tuple[float, RequestOutput]], finish_at: float,
                  reason: str = "length") -> str:
    """One request started at t=100 on a scripted clock: each output arrives at its time, then it finishes."""
    clock = Clock(100.0)
    monkeypatch.setattr("gateway.metrics.time.monotonic", clock)
    metrics = Metrics(BASE, 4, 16, 0.9)
    metrics.engine_ready(Ready(max_model_len=256, vocab_size=320, eos_token_ids=[2], num_kv_blocks=64))
    timer = metrics.start_request(None, 7, 16)
    for at, output in outputs:
        clock.now = at
        timer.on_output(output)
    clock.now = finish_at
    timer.finish(reason)
    return metrics.render(Stats(num_running=0, num_waiting=0))


def test_request_phases_are_split_as_vllm_splits_them(monkeypatch):
    text = timed_request(monkeypatch, [(101.0, RequestOutput("r", [5], queue_time=0.5)),
                                       (101.25, RequestOutput("r", [6])),
                                       (101.75, RequestOutput("r", [7, 8], finish_reason="length"))], 102.0)
    sums = {name: value(text, f"{name}_sum") for name in BUCKETS}
    assert sums == {
        "vllm:request_queue_time_seconds": 0.5,               # arrival -> first scheduled (the worker's)
        "vllm:time_to_first_token_seconds": 1.0,
        "vllm:request_prefill_time_seconds": 0.5,             # first scheduled (100.5) -> first token
        "vllm:request_decode_time_seconds": 0.75,             # first token -> last token
        "vllm:request_inference_time_seconds": 1.25,          # first scheduled -> last token
        "vllm:request_time_per_output_token_seconds": 0.25,   # decode / (4 tokens - 1)
        "vllm:inter_token_latency_seconds": 0.75,             # 0.25 + 0.5
        "vllm:e2e_request_latency_seconds": 2.0,
        "vllm:request_prompt_tokens": 7, "vllm:request_generation_tokens": 4, "vllm:request_params_max_tokens": 16}
    assert value(text, "vllm:request_decode_time_seconds_bucket", le="0.5") == 0
    assert value(text, "vllm:request_decode_time_seconds_bucket", le="0.8") == 1


def test_one_token_request_has_zero_time_per_output_token(monkeypatch):
    text = timed_request(monkeypatch, [(100.5, RequestOutput("r", [5], finish_reason="stop", queue_time=0.25))],
                         100.5)
    assert value(text, "vllm:request_time_per_output_token_seconds_count") == 1
    assert value(text, "vllm:request_time_per_output_token_seconds_sum") == 0
    assert value(text, "vllm:request_decode_time_seconds_sum") == 0
    assert value(text, "vllm:request_prefill_time_seconds_sum") == 0.25


def test_request_without_tokens_has_no_phases_but_counts(monkeypatch):
    text = timed_request(monkeypatch, [(100.1, RequestOutput("r", [], finish_reason="error", error="bad"))], 100.1,
                         reason="error")
    assert value(text, "vllm:request_success_total", finished_reason="error") == 1
    assert value(text, "vllm:request_prompt_tokens_count") == value(text, "vllm:request_generation_tokens_count") == 1
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_time_per_output_token_seconds", "vllm:time_to_first_token_seconds"):
        assert value(text, f"{name}_count") == 0, name
