"""Concurrency sweep: output throughput and TPOT against the number of concurrent streams, for the base model,
one adapter, and N distinct adapters, against one running server.

    python -m bench.sweep --base-url http://127.0.0.1:8100 --concurrency 1 8 32 64 128 256 512 \\
        --adapters base one many --num-loras 64 --out sweep.json

For each adapter setting and concurrency c: 2c requests (at least 16) are sent at once with at most c in
flight, fixed `--input-len` / `--output-len` (`ignore_eos`), so the steady state holds c streams. "one": every
request on `lora-0`; "many": requests cycle over `lora-0` .. `lora-(N-1)` (the server needs them, e.g.
`--lora-modules` of `bench.make_adapters --num N`). From 65 streams the requests go out from several client
processes (`--client-processes`, default one per 64 streams): one process parsing 256 streams was the
bottleneck of earlier runs. Writes each point's summary (bench/report.py) to the JSON
and, with matplotlib, `<out>.png`: throughput and TPOT p50 against concurrency, one line per setting.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from bench.report import summarize
from bench.serve import Endpoint, auth_headers, benchmark, client_processes, served_base_model
from bench.workloads import Workload, adapter_names

logger = logging.getLogger("bench.sweep")
SETTINGS = ("base", "one", "many")


def workload(setting: str, concurrency: int, input_len: int, output_len: int, num_loras: int,
             vocab_size: int) -> Workload:
    """The requests of one point of the sweep."""
    adapters = {"base": (), "one": adapter_names("lora", 1), "many": adapter_names("lora", num_loras)}[setting]
    return Workload(num_prompts=max(2 * concurrency, 16), input_len=(input_len, input_len),
                    output_len=(output_len, output_len), vocab_size=vocab_size, adapters=adapters,
                    adapter_choice="distinct" if adapters else "uniform", max_concurrency=concurrency)


def point(summary: dict[str, Any], setting: str, concurrency: int) -> dict[str, Any]:
    keys = ("completed", "errors", "output_throughput", "p50_tpot_ms", "p99_tpot_ms", "p50_ttft_ms", "p99_ttft_ms",
            "p50_itl_ms", "p99_itl_ms", "duration_s")
    return {"setting": setting, "concurrency": concurrency, **{k: summary.get(k) for k in keys}}


def sweep(endpoint: Endpoint, settings: list[str], levels: list[int], input_len: int, output_len: int,
          num_loras: int, vocab_size: int, seed: int = 0, warmup: int = 0,
          processes: int = 0) -> list[dict[str, Any]]:
    """Every (setting, concurrency) point in turn, each after `warmup` requests of its own workload (untimed):
    a server's first point otherwise pays for its first steps, first adapter loads and first connections."""
    points = []
    for setting in settings:
        for c in levels:
            load = workload(setting, c, input_len, output_len, num_loras, vocab_size)
            senders = client_processes(processes, c)
            records, duration = asyncio.run(benchmark(endpoint, load, seed, warmup=warmup, progress=False,
                                                      timeout_s=3600.0, client_processes=senders))
            points.append({**point(summarize(records, duration), setting, c), "client_processes": senders})
            logger.info("%s", points[-1])
    return points


def plot(points: list[dict[str, Any]], path: Path) -> Path | None:
    """Throughput and TPOT p50 against concurrency, one line per setting; None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'loraplex[bench]'): no plot written")
        return None
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for setting in dict.fromkeys(p["setting"] for p in points):
        mine = [p for p in points if p["setting"] == setting]
        xs = [p["concurrency"] for p in mine]
        left.plot(xs, [p["output_throughput"] for p in mine], marker="o", label=setting)
        right.plot(xs, [p["p50_tpot_ms"] for p in mine], marker="o", label=setting)
    for ax, label in ((left, "output tokens/s"), (right, "TPOT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(prog="bench.sweep", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000")
    add("--api-key", default=None)
    add("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 512])
    add("--adapters", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    add("--num-loras", type=int, default=64, help="adapters of the 'many' setting")
    add("--input-len", type=int, default=130)
    add("--output-len", type=int, default=256)
    add("--vocab-size", type=int, default=1000)
    add("--warmup", type=int, default=0, help="untimed requests before each point (0: none, as earlier runs)")
    add("--client-processes", type=int, default=0,
        help="processes that send each point's requests (default: one per 64 streams, at most one per core; "
             "earlier runs: one)")
    add("--out", default="sweep.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    base_url = args.base_url.rstrip("/")
    endpoint = Endpoint(base_url, asyncio.run(served_base_model(base_url, auth_headers(args.api_key))), args.api_key)
    points = sweep(endpoint, args.adapters, args.concurrency, args.input_len, args.output_len, args.num_loras,
                   args.vocab_size, warmup=args.warmup, processes=args.client_processes)
    out = Path(args.out)
    out.write_text(json.dumps({"settings": vars(args), "points": points}, indent=1))
    plot(points, out.with_suffix(".png"))
    return points


if __name__ == "__main__":
    main()
