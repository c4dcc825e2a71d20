"""Prometheus metrics with vLLM's names, rendered in the text exposition format.

The `vllm:` series are those of vLLM's PrometheusStatLogger (vllm/v1/metrics/loggers.py and
buckets.py, vLLM 0.33.0): names, types, label sets, help texts and bucket bounds, each labelled
`model_name` and `engine="0"` (one engine). Counted per worker request (one per choice), as vLLM counts
engine requests. The queue and KV-cache gauges, the prefix-cache queries and hits (in prompt tokens) and
the preemption count come from the worker's latest Stats. Request timings are taken here as outputs
arrive, with the queue time the worker reports, and split as vLLM splits them: queue = first scheduled -
arrival, prefill = first token - first scheduled, decode = last token - first token, inference = last
token - first scheduled, time per output token = decode / (generated tokens - 1).

`vllm:lora_requests_info` is what the Gateway API Inference Extension's endpoint picker (the llm-d router)
reads for LoRA affinity: one series whose value is the time it was rendered (the picker keeps the series with the
largest value), `max_lora` = --max-loras, `waiting_lora_adapters` = adapters of queued requests, and
`running_lora_adapters` = adapters resident in a GPU slot (plus those of running requests), comma-separated:
"already loaded here", which the picker's LoRA-affinity scorer ranks first. vLLM 0.33.0 lists in both labels the
adapters with a request in flight (LoRARequestStates); an idle adapter still in its slot would then look absent
to the released router, whose lora-affinity-scorer reads only this family.

Residency follows vLLM's open pull requests #51433 (engine notifications) and #54830 (LoRA load events and their
metrics), as llm-d-router's open #2792 (lora-load-state-scorer) reads them; none is in a vLLM release yet, and these
names follow theirs if they change:
- `vllm:lora_adapter_loaded{adapter_name, level, pinned, rank}`: a gauge at 1 per adapter whose weights are loaded:
  `level="gpu"` in a GPU slot (its copy done), else `level="cpu"` in the host cache; `pinned` "true" or "false";
  `rank` its LoRA rank. An adapter's series goes when it leaves both tiers or is unloaded, so the family holds at
  most one series per loaded adapter.
- `vllm:num_gpu_loaded_lora_adapters` and `vllm:num_cpu_loaded_lora_adapters`: adapters in a GPU slot, and adapters
  in either tier (vLLM's CPU tier holds every GPU-resident adapter too).
- `vllm:max_gpu_lora_adapters`: --max-loras. These three are present from the worker's first stats on.
- `vllm:lora_adapter_load_seconds{transition}`: a histogram of load times, `transition="load"` disk to host cache,
  `transition="activate"` host cache to GPU slot (the two transitions #2792's scorer prices).

`loraplex:` metrics count requests and tokens per adapter, and describe the adapter tiers (GPU slots,
host cache) with hits, misses, loads, evictions and load latency per tier, from the worker's LoRAStats.
An adapter's series go when it is unloaded, so the page stays as long as the set of adapters served.
"""
from __future__ import annotations

import bisect
import time
from collections import Counter
from dataclasses import dataclass

from worker.ipc.messages import LoRAStats, Ready, RequestOutput, Stats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Metrics attribute, vLLM name, vLLM help text: the histograms, in vLLM's order.
HISTOGRAMS = (
    ("request_prompt_tokens", "vllm:request_prompt_tokens", "Number of prefill tokens processed."),
    ("request_generation_tokens", "vllm:request_generation_tokens", "Number of generation tokens processed."),
    ("request_max_tokens", "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter."),
    ("ttft", "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    ("itl", "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    ("time_per_output_token", "vllm:request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request."),
    ("e2e", "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
    ("queue_time", "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
    ("inference_time", "vllm:request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request."),
    ("prefill_time", "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
    ("decode_time", "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request."),
)


def request_tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 series up to max_model_len: 100 -> (1, 2, 5, 10, 20, 50, 100)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)     # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def samples(self, name: str, labels: dict[str, object]) -> list[str]:
        lines, cumulative = [], 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts):
            cumulative += count
            lines.append(_sample(f"{name}_bucket", {**labels, "le": _go_float(bound)}, cumulative))
        lines.append(_sample(f"{name}_sum", labels, self.sum))
        lines.append(_sample(f"{name}_count", labels, cumulative))
        return lines

    @classmethod
    def of(cls, buckets: list[float], counts: list[int], total: float) -> Histogram:
        """A histogram observed elsewhere: per-bucket (not cumulative) counts, the last one +Inf."""
        histogram = cls(tuple(buckets))
        histogram.counts, histogram.sum = list(counts), total
        return histogram


@dataclass
class RequestTimer:
    """One worker request's timings and token counts, reported to Metrics as its outputs arrive."""
    metrics: Metrics
    lora_name: str | None
    num_prompt_tokens: int
    max_tokens: int
    start: float
    queue_time: float | None = None       # the worker's, from arrival to first scheduled; with the first output
    first: float | None = None            # when the first token arrived
    last: float | None = None             # when the latest token arrived
    num_generated: int = 0
    finished: bool = False

    def on_output(self, output: RequestOutput) -> None:
        if output.queue_time is not None:
            self.queue_time = output.queue_time
        count = len(output.new_token_ids)
        if count == 0:
            return
        now = time.monotonic()
        if self.last is None:
            self.first = now
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.num_generated += count
        self.metrics.generation_tokens += count
        if self.lora_name in self.metrics.lora_requests:      # not if it was unloaded meanwhile
            self.metrics.lora_generation_tokens[self.lora_name] += count

    def finish(self, reason: str) -> None:
        if self.finished:
            return
        self.finished = True
        metrics = self.metrics
        metrics.success[reason] += 1
        metrics.e2e.observe(time.monotonic() - self.start)
        metrics.request_prompt_tokens.observe(self.num_prompt_tokens)
        metrics.request_generation_tokens.observe(self.num_generated)
        if self.max_tokens:
            metrics.request_max_tokens.observe(self.max_tokens)
        if self.first is not None and self.queue_time is not None:
            self._observe_phases()

    def _observe_phases(self) -> None:
        """vLLM's phase histograms, for a request that was scheduled and produced a token. The worker's queue
        time starts when the request reached it, so the ring transit (microseconds) falls into the prefill."""
        metrics, scheduled = self.metrics, self.start + self.queue_time   # first scheduled, on this clock
        decode = self.last - self.first
        metrics.queue_time.observe(self.queue_time)
        metrics.prefill_time.observe(self.first - scheduled)
        metrics.decode_time.observe(decode)
        metrics.inference_time.observe(self.last - scheduled)
        metrics.time_per_output_token.observe(decode / (self.num_generated - 1) if self.num_generated > 1 else 0.0)


class Metrics:
    def __init__(self, model_name: str, max_loras: int, block_size: int, gpu_memory_utilization: float,
                 enable_prefix_caching: bool = True, cache_dtype: str = "auto"):
        self.model_name = model_name
        self.max_loras = max_loras
        self.block_size = block_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_dtype = cache_dtype                  # --kv-cache-dtype
        self.num_gpu_blocks: int | None = None     # from the worker's Ready
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: Counter[str] = Counter()
        self.lora_requests: Counter[str] = Counter()
        self.lora_prompt_tokens: Counter[str] = Counter()
        self.lora_generation_tokens: Counter[str] = Counter()
        self._adapter_label_text: dict[str, str] = {}     # lora_name -> its label set, rendered
        self.request_prompt_tokens = Histogram(())        # token histograms: bucketed in engine_ready
        self.request_generation_tokens = Histogram(())
        self.request_max_tokens = Histogram(())
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.time_per_output_token = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = Histogram(REQUEST_LATENCY_BUCKETS)

    def engine_ready(self, ready: Ready) -> None:
        """What only the started worker knows: the KV pool's size and max_model_len (the token buckets)."""
        self.num_gpu_blocks = ready.num_kv_blocks
        buckets = request_tokens_buckets(ready.max_model_len)
        self.request_prompt_tokens = Histogram(buckets)
        self.request_generation_tokens = Histogram(buckets)
        self.request_max_tokens = Histogram(buckets)

    def start_request(self, lora_name: str | None, num_prompt_tokens: int, max_tokens: int) -> RequestTimer:
        self.prompt_tokens += num_prompt_tokens
        if lora_name is not None:
            self.lora_requests[lora_name] += 1
            self.lora_prompt_tokens[lora_name] += num_prompt_tokens
        return RequestTimer(self, lora_name, num_prompt_tokens, max_tokens, time.monotonic())

    def forget_adapter(self, lora_name: str) -> None:
        """Drop an unloaded adapter's series."""
        for counter in (self.lora_requests, self.lora_prompt_tokens, self.lora_generation_tokens):
            counter.pop(lora_name, None)
        self._adapter_label_text.pop(lora_name, None)

    def render(self, stats: Stats) -> str:
        engine = {"model_name": self.model_name, "engine": "0"}
        out: list[str] = []
        for name, kind, help_text, value in (
                ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                 stats.num_running),
                ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                 stats.num_waiting),
                ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                 stats.kv_cache_usage),
                ("vllm:prefix_cache_queries", "counter",
                 "Prefix cache queries, in terms of number of queried tokens.", stats.prefix_cache_queries),
                ("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in terms of number of cached tokens.",
                 stats.prefix_cache_hits),
                ("vllm:num_preemptions", "counter", "Cumulative number of preemption from the engine.",
                 stats.num_preemptions),
                ("vllm:prompt_tokens", "counter", "Number of prefill tokens processed.", self.prompt_tokens),
                ("vllm:generation_tokens", "counter", "Number of generation tokens processed.",
                 self.generation_tokens)):
            _family(out, name, kind, help_text, [_sample(_sample_name(name, kind), engine, value)])
        _family(out, "vllm:request_success", "counter", "Count of successfully processed requests.",
                [_sample("vllm:request_success_total", {**engine, "finished_reason": reason}, count)
                 for reason, count in sorted(self.success.items())])
        for attribute, name, help_text in HISTOGRAMS:
            _family(out, name, "histogram", help_text, getattr(self, attribute).samples(name, engine))
        lora_info = {"max_lora": self.max_loras, "waiting_lora_adapters": ",".join(stats.waiting_adapters),
                     "running_lora_adapters": ",".join(stats.running_adapters)}
        _family(out, "vllm:lora_requests_info", "gauge", "Running stats on lora requests.",
                [_sample("vllm:lora_requests_info", lora_info, time.time())])
        if stats.lora is not None:
            self._render_residency(out, engine, stats.lora)
        if self.num_gpu_blocks is not None:
            _family(out, "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig",
                    [_sample("vllm:cache_config_info", self._cache_labels(), 1)])
        self._render_adapters(out, stats)
        return "\n".join(out) + "\n"

    def _render_residency(self, out: list[str], engine: dict[str, object], lora: LoRAStats) -> None:
        """The residency families of vLLM's open #54830 (module docstring)."""
        name = "vllm:lora_adapter_loaded"
        _family(out, name, "gauge", "LoRA adapters whose weights are loaded, by tier (gpu: a GPU slot; cpu: "
                "only the host cache).",
                [_sample(name, {**engine, "adapter_name": a.name, "level": a.level,
                                "pinned": "true" if a.pinned else "false", "rank": a.rank}, 1)
                 for a in lora.loaded])
        num_gpu = sum(a.level == "gpu" for a in lora.loaded)
        for name, value, help_text in (
                ("vllm:num_gpu_loaded_lora_adapters", num_gpu, "LoRA adapters in GPU slots."),
                ("vllm:num_cpu_loaded_lora_adapters", len(lora.loaded),
                 "LoRA adapters in the host cache or in GPU slots."),
                ("vllm:max_gpu_lora_adapters", lora.gpu_slots_total, "GPU LoRA slots (--max-loras).")):
            _family(out, name, "gauge", help_text, [_sample(name, engine, value)])
        name = "vllm:lora_adapter_load_seconds"
        _family(out, name, "histogram", "LoRA adapter load time in seconds, by transition (load: disk to host "
                "cache; activate: host cache to GPU slot).",
                [line for transition, tier in (("load", lora.host), ("activate", lora.gpu))
                 for line in Histogram.of(lora.load_seconds_buckets, tier.load_seconds_counts,
                                          tier.load_seconds_sum).samples(name, {**engine, "transition": transition})])

    def _adapter_labels(self, lora_name: str) -> str:
        """`{lora_name="...",model_name="..."}`, as _sample writes it, made once per adapter: with a thousand
        adapters these are most of the page, which the router scrapes every 50 ms."""
        text = self._adapter_label_text.get(lora_name)
        if text is None:
            text = _label_text({"model_name": self.model_name, "lora_name": lora_name})
            self._adapter_label_text[lora_name] = text
        return text

    def _cache_labels(self) -> dict[str, object]:
        """vLLM's CacheConfig fields that mean something here, as str(value) (vLLM labels them all), and engine."""
        return {"block_size": self.block_size, "gpu_memory_utilization": self.gpu_memory_utilization,
                "cache_dtype": self.cache_dtype, "enable_prefix_caching": self.enable_prefix_caching,
                "num_gpu_blocks": self.num_gpu_blocks,
                "engine": 0}

    def _render_adapters(self, out: list[str], stats: Stats) -> None:
        model = {"model_name": self.model_name}
        for name, counter, help_text in (
                ("loraplex:lora_requests", self.lora_requests, "Requests per LoRA adapter."),
                ("loraplex:lora_prompt_tokens", self.lora_prompt_tokens, "Prompt tokens per LoRA adapter."),
                ("loraplex:lora_generation_tokens", self.lora_generation_tokens,
                 "Generated tokens per LoRA adapter.")):
            sample = f"{name}_total"
            _family(out, name, "counter", help_text,
                    [f"{sample}{self._adapter_labels(lora)} {_go_float(count)}"
                     for lora, count in sorted(counter.items())])
        if stats.lora is not None:
            _adapter_tiers(out, model, stats.lora)


def _adapter_tiers(out: list[str], model: dict[str, object], lora: LoRAStats) -> None:
    for name, value, help_text in (
            ("loraplex:lora_gpu_slots_used", lora.gpu_slots_used, "GPU LoRA slots holding an adapter."),
            ("loraplex:lora_gpu_slots_total", lora.gpu_slots_total, "GPU LoRA slots (--max-loras)."),
            ("loraplex:lora_host_cache_adapters", lora.host_entries, "Adapters in the host cache."),
            ("loraplex:lora_host_cache_bytes", lora.host_bytes, "Bytes of adapters in the host cache.")):
        _family(out, name, "gauge", help_text, [_sample(name, model, value)])
    tiers = {"gpu": lora.gpu, "host": lora.host}
    for name, field, help_text in (
            ("loraplex:lora_cache_hits", "hits", "Requests whose adapter was in the tier when they arrived."),
            ("loraplex:lora_cache_misses", "misses", "Requests whose adapter was not in the tier when they arrived."),
            ("loraplex:lora_loads", "loads", "Adapter loads into the tier."),
            ("loraplex:lora_loaded_bytes", "loaded_bytes", "Bytes of adapters loaded into the tier."),
            ("loraplex:lora_evictions", "evictions", "Adapters evicted from the tier.")):
        _family(out, name, "counter", help_text,
                [_sample(f"{name}_total", {**model, "tier": tier}, getattr(stats, field))
                 for tier, stats in tiers.items()])
    name = "loraplex:lora_load_latency_seconds"
    _family(out, name, "histogram", "Adapter load time into the tier (disk read and pack; host-to-GPU copy).",
            [line for tier, stats in tiers.items()
             for line in Histogram.of(lora.load_seconds_buckets, stats.load_seconds_counts,
                                      stats.load_seconds_sum).samples(name, {**model, "tier": tier})])


def _family(out: list[str], name: str, kind: str, help_text: str, samples: list[str]) -> None:
    """HELP and TYPE lines, then the samples; a counter's family is named by its `_total` sample, as
    prometheus_client writes the Prometheus text format."""
    name = _sample_name(name, kind)
    out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", *samples]


def _sample_name(name: str, kind: str) -> str:
    return f"{name}_total" if kind == "counter" else name


def _sample(name: str, labels: dict[str, object], value: float) -> str:
    """One sample line as prometheus_client writes it: labels sorted by name, values as Go floats."""
    return f"{name}{_label_text(labels)} {_go_float(value)}"


def _label_text(labels: dict[str, object]) -> str:
    """`{a="1",b="x"}`: labels sorted by name, values escaped."""
    return "{" + ",".join(f'{key}="{_escape(str(labels[key]))}"' for key in sorted(labels)) + "}"


def _go_float(value: float) -> str:
    """A number as prometheus_client writes it (Go's notation): 3 -> 3.0, 2560 -> 2560.0, 1e6 -> 1e+06."""
    if value == float("inf"):
        return "+Inf"
    text = repr(float(value))
    dot = text.find(".")
    if value > 0 and dot > 6:
        mantissa = f"{text[0]}.{text[1:dot]}{text[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return text


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
