"""Per-request records, the summary vLLM's and SGLang's serving benchmarks report, and PNG plots.

Definitions (as vLLM's benchmark_serving):
    TTFT  send -> first streamed chunk with a choice
    ITL   gaps between consecutive streamed chunks of one request (all requests pooled)
    TPOT  (E2E - TTFT) / (output tokens - 1), per request with more than one output token
    E2EL  send -> last byte of the response
Statistics are over successful requests; percentiles interpolate linearly (numpy's default). A
server that sends several tokens in one chunk makes fewer, longer ITLs; TPOT is unaffected.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

PERCENTILES = (50, 90, 95, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": "Time to first token", "tpot": "Time per output token",
                 "itl": "Inter-token latency", "e2el": "End-to-end latency"}


@dataclass
class RequestRecord:
    """What one request did; times in seconds."""
    adapter: str | None
    max_tokens: int
    prompt_tokens: int | None = None
    send_time: float = 0.0                  # after the benchmark's start
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2el: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)

    def chunk_times(self) -> list[float]:
        """When each streamed chunk arrived, after the benchmark's start."""
        if self.ttft is None:
            return []
        return list(self.send_time + self.ttft + np.cumsum([0.0] + self.itls))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def samples(records: list[RequestRecord], metric: str) -> list[float]:
    """The values of one metric (seconds) over the successful requests; ITLs pooled."""
    done = [r for r in records if r.ok]
    if metric == "itl":
        return [gap for r in done for gap in r.itls]
    if metric == "tpot":
        return [r.tpot for r in done if r.tpot is not None]
    return [getattr(r, metric) for r in done]


def stats_ms(values: list[float], name: str) -> dict[str, float | None]:
    """mean, std, median and PERCENTILES of `values` (seconds) in ms, keyed as vLLM (`p99_ttft_ms`)."""
    keys = [f"mean_{name}_ms", f"std_{name}_ms", f"median_{name}_ms"] + [f"p{p}_{name}_ms" for p in PERCENTILES]
    if not values:
        return dict.fromkeys(keys)
    ms = np.asarray(values, dtype=np.float64) * 1000.0
    numbers = [ms.mean(), ms.std(), np.median(ms)] + [np.percentile(ms, p) for p in PERCENTILES]
    return {key: float(value) for key, value in zip(keys, numbers)}


def summarize(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Counts, throughputs and latency statistics of one run lasting `duration_s`."""
    done = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    summary: dict[str, Any] = {
        "num_requests": len(records), "completed": len(done), "errors": len(records) - len(done),
        "duration_s": duration_s, "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s, "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "concurrency": sum(r.e2el for r in done) / duration_s,
    }
    for metric in METRICS:
        summary.update(stats_ms(samples(records, metric), metric))
    return summary


def throughput_timeline(records: list[RequestRecord], bin_s: float = 1.0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bin starts, output tokens/s, completed requests/s) per bin of `bin_s` seconds.

    A request's output tokens are spread evenly over its streamed chunks.
    """
    done = [r for r in records if r.ok and r.ttft is not None]
    end = max((r.send_time + r.e2el for r in done), default=0.0)
    num_bins = max(1, math.ceil(end / bin_s))
    tokens, completions = np.zeros(num_bins), np.zeros(num_bins)
    for r in done:
        times = r.chunk_times()
        for t in times:
            tokens[min(int(t // bin_s), num_bins - 1)] += r.output_tokens / len(times)
        completions[min(int((r.send_time + r.e2el) // bin_s), num_bins - 1)] += 1
    return np.arange(num_bins) * bin_s, tokens / bin_s, completions / bin_s


def format_summary(summary: dict[str, Any], title: str) -> str:
    """The summary as an aligned text table."""
    lines = [f"{' ' + title + ' ':=^60}"]
    for key, value in summary.items():
        text = "n/a" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"{key:<44}{text:>16}")
    return "\n".join(lines)


def write_plots(records: list[RequestRecord], stem: Path) -> list[Path]:
    """`<stem>.latency_cdf.png` and `<stem>.throughput.png`; none, with a warning, without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'loraplex[bench]'): no plots written")
        return []
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    paths = [stem.with_name(stem.name + ".latency_cdf.png"), stem.with_name(stem.name + ".throughput.png")]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, metric in zip(axes.flat, METRICS):
        values = np.sort(np.asarray(samples(records, metric)) * 1000.0)
        ax.step(values, np.arange(1, len(values) + 1) / max(len(values), 1), where="post")
        ax.set(title=METRIC_TITLES[metric], xlabel="ms", ylabel="fraction of samples", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)
    starts, tokens, completions = throughput_timeline(records)
    edges = np.append(starts, starts[-1] + 1.0)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.stairs(tokens, edges)
    top.set(ylabel="output tokens/s", title="Throughput over time (1 s bins)")
    bottom.stairs(completions, edges, color="tab:orange")
    bottom.set(ylabel="completed requests/s", xlabel="seconds since start")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths


def write_result(records: list[RequestRecord], summary: dict[str, Any], settings: dict[str, Any],
                 out: str | None, default_prefix: str, plots: bool) -> dict[str, Any]:
    """Write {summary, settings, records} as JSON to `out` (default: `<prefix>-<time>.json`) and, unless
    `plots` is False, the PNG plots beside it; returns what was written."""
    result = {"summary": summary, "settings": settings, "records": [r.to_json() for r in records]}
    path = Path(out or f"{default_prefix}-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    written = [path, *(write_plots(records, path.with_suffix("")) if plots else [])]
    logger.info("wrote %s", ", ".join(str(p) for p in written))
    return result
