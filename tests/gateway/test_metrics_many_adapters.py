"""/metrics with 1,000 adapters stays small and quick to render: the endpoint picker scrapes it every 50 ms.

The worst case: every adapter has served requests (three `loraplex:` counters each) and waits in the queue
(all named in `waiting_lora_adapters`). BENCHMARKS.md has the measured sizes and times.
"""
from __future__ import annotations

import statistics
import time

from gateway.metrics import Metrics
from worker.ipc.messages import LoRAStats, LoRATierStats, Ready, RequestOutput, Stats

NUM_ADAPTERS = 1000
MAX_LORAS = 8
NAMES = [f"adapter-{i:04d}" for i in range(NUM_ADAPTERS)]
# The page's bytes: a fixed part (vLLM's families, the adapter tiers) plus, per adapter, three counter lines
# and its name in the waiting list. Measured: 30.7 kB with no adapter, 318.7 kB with the thousand.
MAX_FIXED_BYTES = 40_000
MAX_BYTES_PER_ADAPTER = 320
MAX_RENDER_SECONDS = 0.020         # measured: 3.8 ms; the picker scrapes every 50 ms


def metrics_with_adapters(names: list[str]) -> Metrics:
    metrics = Metrics("loraplex-demo", max_loras=MAX_LORAS, block_size=16, gpu_memory_utilization=0.9)
    metrics.engine_ready(Ready(max_model_len=4096, vocab_size=32000, eos_token_ids=[2], num_kv_blocks=8192))
    for name in names:
        timer = metrics.start_request(name, num_prompt_tokens=512, max_tokens=128)
        timer.on_output(RequestOutput(name, [1, 2], queue_time=0.01))
        timer.on_output(RequestOutput(name, [3], finish_reason="stop"))
        timer.finish("stop")
    return metrics


def busy_stats(names: list[str]) -> Stats:
    tier = LoRATierStats(hits=10, misses=5, loads=5, loaded_bytes=1 << 20, load_seconds_counts=[1] * 14)
    lora = LoRAStats(gpu_slots_used=MAX_LORAS, gpu_slots_total=MAX_LORAS, host_entries=64, host_capacity=64,
                     host_bytes=1 << 30, load_seconds_buckets=[0.001 * 2 ** i for i in range(13)], host=tier, gpu=tier)
    return Stats(num_running=MAX_LORAS, num_waiting=len(names), running_adapters=names[:MAX_LORAS],
                 waiting_adapters=names, lora=lora, kv_cache_usage=0.5)


def test_page_with_a_thousand_adapters_stays_under_its_byte_bound():
    text = metrics_with_adapters(NAMES).render(busy_stats(NAMES))
    per_adapter = [line for line in text.splitlines() if 'lora_name="' in line]
    assert len(per_adapter) == 3 * NUM_ADAPTERS
    assert len(text.encode()) <= MAX_FIXED_BYTES + NUM_ADAPTERS * MAX_BYTES_PER_ADAPTER


def test_registered_adapters_without_requests_add_no_series():
    """Metrics only hears of an adapter through its requests: the idle ones cost nothing on the page."""
    idle = metrics_with_adapters([])
    text = idle.render(busy_stats([]))
    assert 'lora_name="' not in text and len(text.encode()) <= MAX_FIXED_BYTES


def test_page_with_a_thousand_adapters_renders_well_within_the_scrape_interval():
    metrics, stats = metrics_with_adapters(NAMES), busy_stats(NAMES)
    metrics.render(stats)
    times = []
    for _ in range(15):
        start = time.perf_counter()
        metrics.render(stats)
        times.append(time.perf_counter() - start)
    assert statistics.median(times) < MAX_RENDER_SECONDS


def test_an_unloaded_adapters_series_and_labels_go():
    metrics = metrics_with_adapters(NAMES[:3])
    metrics.render(busy_stats([]))
    metrics.forget_adapter(NAMES[1])
    text = metrics.render(busy_stats([]))
    assert f'lora_name="{NAMES[1]}"' not in text and f'lora_name="{NAMES[2]}"' in text
