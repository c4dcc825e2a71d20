"""Prometheus metrics with vLLM's names, rendered in the text exposition format.

Counted per worker request (one per choice), as vLLM counts engine requests. Gauges of the queue
come from the worker's latest Stats; `loraplex:` metrics count requests and tokens per adapter, and
describe the adapter tiers (GPU slots, host cache) with hits, misses, loads, evictions and load
latency per tier, from the worker's LoRAStats. An adapter's series go when it is unloaded, so the
page stays as long as the set of adapters served.
"""
from __future__ import annotations

import bisect
import time
from collections import Counter
from dataclasses import dataclass

from worker.ipc.messages import LoRAStats, Stats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)     # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def samples(self, name: str, labels: str) -> list[str]:
        lines, cumulative = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(float(bound))
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        lines.append(f"{name}_sum{{{labels}}} {self.sum}")
        lines.append(f"{name}_count{{{labels}}} {cumulative}")
        return lines

    @classmethod
    def of(cls, buckets: list[float], counts: list[int], total: float) -> Histogram:
        """A histogram observed elsewhere: per-bucket (not cumulative) counts, the last one +Inf."""
        histogram = cls(tuple(buckets))
        histogram.counts, histogram.sum = list(counts), total
        return histogram


@dataclass
class RequestTimer:
    """One worker request's timings and token counts, reported to Metrics when it finishes."""
    metrics: Metrics
    lora_name: str | None
    start: float
    last: float | None = None
    num_generated: int = 0
    finished: bool = False

    def on_tokens(self, count: int) -> None:
        if count == 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.num_generated += count
        self.metrics.generation_tokens += count
        if self.lora_name in self.metrics.lora_requests:      # not if it was unloaded meanwhile
            self.metrics.lora_generation_tokens[self.lora_name] += count

    def finish(self, reason: str) -> None:
        if not self.finished:
            self.finished = True
            self.metrics.success[reason] += 1
            self.metrics.e2e.observe(time.monotonic() - self.start)


class Metrics:
    def __init__(self, model_name: str, max_loras: int):
        self.model_name = model_name
        self.max_loras = max_loras
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: Counter[str] = Counter()
        self.lora_requests: Counter[str] = Counter()
        self.lora_prompt_tokens: Counter[str] = Counter()
        self.lora_generation_tokens: Counter[str] = Counter()
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def start_request(self, lora_name: str | None, num_prompt_tokens: int) -> RequestTimer:
        self.prompt_tokens += num_prompt_tokens
        if lora_name is not None:
            self.lora_requests[lora_name] += 1
            self.lora_prompt_tokens[lora_name] += num_prompt_tokens
        return RequestTimer(self, lora_name, time.monotonic())

    def forget_adapter(self, lora_name: str) -> None:
        """Drop an unloaded adapter's series."""
        for counter in (self.lora_requests, self.lora_prompt_tokens, self.lora_generation_tokens):
            counter.pop(lora_name, None)

    def render(self, stats: Stats) -> str:
        model = f'model_name="{_escape(self.model_name)}"'
        out: list[str] = []
        _family(out, "vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                [f"vllm:num_requests_running{{{model}}} {stats.num_running}"])
        _family(out, "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                [f"vllm:num_requests_waiting{{{model}}} {stats.num_waiting}"])
        running, waiting = _escape(",".join(stats.running_adapters)), _escape(",".join(stats.waiting_adapters))
        lora_labels = f'max_lora="{self.max_loras}",running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"'
        _family(out, "vllm:lora_requests_info", "gauge", "Running stats on lora requests.",
                [f"vllm:lora_requests_info{{{lora_labels}}} {time.time()}"])
        _family(out, "vllm:request_success", "counter", "Count of successfully processed requests.",
                [f'vllm:request_success_total{{{model},finished_reason="{reason}"}} {count}'
                 for reason, count in sorted(self.success.items())])
        _family(out, "vllm:prompt_tokens", "counter", "Number of prefill tokens processed.",
                [f"vllm:prompt_tokens_total{{{model}}} {self.prompt_tokens}"])
        _family(out, "vllm:generation_tokens", "counter", "Number of generation tokens processed.",
                [f"vllm:generation_tokens_total{{{model}}} {self.generation_tokens}"])
        _family(out, "vllm:time_to_first_token_seconds", "histogram", "Histogram of time to first token in seconds.",
                self.ttft.samples("vllm:time_to_first_token_seconds", model))
        _family(out, "vllm:inter_token_latency_seconds", "histogram", "Histogram of inter-token latency in seconds.",
                self.itl.samples("vllm:inter_token_latency_seconds", model))
        _family(out, "vllm:e2e_request_latency_seconds", "histogram",
                "Histogram of e2e request latency in seconds.",
                self.e2e.samples("vllm:e2e_request_latency_seconds", model))
        for name, counter, help_text in (
                ("loraplex:lora_requests", self.lora_requests, "Requests per LoRA adapter."),
                ("loraplex:lora_prompt_tokens", self.lora_prompt_tokens, "Prompt tokens per LoRA adapter."),
                ("loraplex:lora_generation_tokens", self.lora_generation_tokens,
                 "Generated tokens per LoRA adapter.")):
            _family(out, name, "counter", help_text,
                    [f'{name}_total{{{model},lora_name="{_escape(lora)}"}} {count}'
                     for lora, count in sorted(counter.items())])
        if stats.lora is not None:
            _adapter_tiers(out, model, stats.lora)
        return "\n".join(out) + "\n"


def _adapter_tiers(out: list[str], model: str, lora: LoRAStats) -> None:
    for name, value, help_text in (
            ("loraplex:lora_gpu_slots_used", lora.gpu_slots_used, "GPU LoRA slots holding an adapter."),
            ("loraplex:lora_gpu_slots_total", lora.gpu_slots_total, "GPU LoRA slots (--max-loras)."),
            ("loraplex:lora_host_cache_adapters", lora.host_entries, "Adapters in the host cache."),
            ("loraplex:lora_host_cache_bytes", lora.host_bytes, "Bytes of adapters in the host cache.")):
        _family(out, name, "gauge", help_text, [f"{name}{{{model}}} {value}"])
    tiers = {"gpu": lora.gpu, "host": lora.host}
    for name, field, help_text in (
            ("loraplex:lora_cache_hits", "hits", "Requests whose adapter was in the tier when they arrived."),
            ("loraplex:lora_cache_misses", "misses", "Requests whose adapter was not in the tier when they arrived."),
            ("loraplex:lora_loads", "loads", "Adapter loads into the tier."),
            ("loraplex:lora_loaded_bytes", "loaded_bytes", "Bytes of adapters loaded into the tier."),
            ("loraplex:lora_evictions", "evictions", "Adapters evicted from the tier.")):
        _family(out, name, "counter", help_text,
                [f'{name}_total{{{model},tier="{tier}"}} {getattr(stats, field)}' for tier, stats in tiers.items()])
    name = "loraplex:lora_load_latency_seconds"
    _family(out, name, "histogram", "Adapter load time into the tier (disk read and pack; host-to-GPU copy).",
            [line for tier, stats in tiers.items()
             for line in Histogram.of(lora.load_seconds_buckets, stats.load_seconds_counts,
                                      stats.load_seconds_sum).samples(name, f'{model},tier="{tier}"')])


def _family(out: list[str], name: str, kind: str, help_text: str, samples: list[str]) -> None:
    out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
