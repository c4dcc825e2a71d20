"""/metrics with 1,000 adapters stays small, and its render time grows in proportion to the adapters (no worse):
the endpoint picker scrapes it every 50 ms.

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
# render time with 1,000 adapters over that with 100, each the median of interleaved renders: a fixed part plus
# a part per adapter gives under 10 (measured: 3), a part per pair of adapters about 100 (measured: over 20)
MAX_RENDER_RATIO_10X_ADAPTERS = 8


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


def test_render_time_grows_no_faster_than_the_adapters():
    """A ratio of two render times on the same machine at the same moment, so it holds on any machine."""
    pages = {n: (metrics_with_adapters(NAMES[:n]), busy_stats(NAMES[:n])) for n in (100, NUM_ADAPTERS)}
    times: dict[int, list[float]] = {n: [] for n in pages}
    for _ in range(15):
        for n, (metrics, stats) in pages.items():
            start = time.perf_counter()
            metrics.render(stats)
            times[n].append(time.perf_counter() - start)
    ratio = statistics.median(times[NUM_ADAPTERS]) / statistics.median(times[100])
    assert ratio < MAX_RENDER_RATIO_10X_ADAPTERS, ratio


def test_an_unloaded_adapters_series_and_labels_go():
    metrics = metrics_with_adapters(NAMES[:3])
    metrics.render(busy_stats([]))
    metrics.forget_adapter(NAMES[1])
    text = metrics.render(busy_stats([]))
    assert f'lora_name="{NAMES[1]}"' not in text and f'lora_name="{NAMES[2]}"' in text
