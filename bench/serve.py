"""Serving benchmark: streams /v1/completions requests at any OpenAI-compatible server and reports
TTFT, ITL, TPOT, E2E latency and throughput as vLLM's and SGLang's serving benchmarks do.

    python -m bench.serve --base-url http://127.0.0.1:8000 --preset sglang-multi-adapter
    python -m bench.serve --num-prompts 100 --random-input-len 512 --random-output-len 128 \\
        --request-rate 4 --lora-prefix lora --num-loras 16 --lora-choice zipf --zipf-alpha 1.5
    loraplex bench ...        (the same command line)

Requests carry random token-id prompts (or a JSONL file's prompts) with `ignore_eos` and `max_tokens`,
so output lengths are exact. The adapter goes in `model` (loraplex, vLLM) or, with
`--adapter-field lora_path`, in SGLang's `lora_path` with `model` the base. Writes the summary, the
run's settings and every request's record to a JSON file, and latency-CDF and throughput-over-time
PNGs beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import httpx

from bench.presets import PRESETS
from bench.report import RequestRecord, format_summary, summarize, write_result
from bench.workloads import ADAPTER_CHOICES, ARRIVALS, RequestSpec, Workload, adapter_names, length_range

logger = logging.getLogger("bench.serve")


@dataclass(frozen=True)
class Endpoint:
    """Where requests go and how a request names its model and adapter."""
    base_url: str
    model: str                      # the served base model
    api_key: str | None = None
    adapter_field: str = "model"    # "model": model=<adapter>; "lora_path": model=<base>, lora_path=<adapter>
    ignore_eos: bool = True
    path: str = "/v1/completions"
    structured: dict[str, Any] | None = None    # vLLM's `structured_outputs` of every request (regex, json, ...)

    @property
    def headers(self) -> dict[str, str]:
        return auth_headers(self.api_key)

    def payload(self, spec: RequestSpec) -> dict[str, Any]:
        body = {"model": self.model, "prompt": spec.prompt, "max_tokens": spec.output_len, "temperature": 0.0,
                "ignore_eos": self.ignore_eos, "stream": True, "stream_options": {"include_usage": True}}
        if spec.adapter is not None:
            body[self.adapter_field] = spec.adapter
        if self.structured is not None:
            body["structured_outputs"] = self.structured
        return body


async def send(client: httpx.AsyncClient, endpoint: Endpoint, spec: RequestSpec, start: float) -> RequestRecord:
    """Stream one completion and time its chunks; failures end up in the record's error."""
    record = RequestRecord(spec.adapter, spec.output_len, spec.prompt_len)
    sent = time.perf_counter()
    record.send_time = sent - start
    try:
        await _stream(client, endpoint, spec, record, sent)
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:   # a malformed response too
        record.error = f"{type(e).__name__}: {e}"
    if record.ok and record.ttft is None:
        record.error = "the stream ended without a completion chunk"
    return record


async def _stream(client: httpx.AsyncClient, endpoint: Endpoint, spec: RequestSpec, record: RequestRecord,
                  sent: float) -> None:
    last, chunks = sent, 0
    async with client.stream("POST", endpoint.base_url + endpoint.path, json=endpoint.payload(spec),
                             headers=endpoint.headers) as response:
        if response.status_code != 200:
            record.error = f"HTTP {response.status_code}: {_error_message((await response.aread()).decode())}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            data = json.loads(line[5:])
            now = time.perf_counter()
            if "error" in data:
                record.error = f"stream error: {_error_message(json.dumps(data))}"
                return
            if data.get("choices"):
                if record.ttft is None:
                    record.ttft = now - sent
                else:
                    record.itls.append(now - last)
                last, chunks = now, chunks + 1
            if data.get("usage"):
                record.output_tokens = data["usage"]["completion_tokens"]
                record.prompt_tokens = data["usage"]["prompt_tokens"]
    record.e2el = time.perf_counter() - sent
    record.output_tokens = record.output_tokens or chunks   # a server without usage: one token per chunk


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _error_message(body: str) -> str:
    with contextlib.suppress(ValueError, TypeError, KeyError, AttributeError):
        return json.loads(body)["error"]["message"]
    return body[:500]


class Progress:
    """A one-line progress bar on stderr; a plain line per 10 % when stderr is not a terminal."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.enabled = total, enabled and total > 0
        self.done = self.errors = 0
        self.started = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._last_tenth = 0

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.errors += not record.ok
        if not self.enabled:
            return
        tenth = self.done * 10 // self.total
        if self.tty:
            sys.stderr.write("\r" + self._line())
        elif tenth > self._last_tenth:
            sys.stderr.write(self._line() + "\n")
        self._last_tenth = tenth
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")

    def _line(self) -> str:
        filled = self.done * 30 // self.total
        return (f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} requests, "
                f"{self.errors} errors, {time.perf_counter() - self.started:.1f} s")


async def run(endpoint: Endpoint, specs: list[RequestSpec], due: list[float], max_concurrency: int | None,
              progress: Progress, timeout_s: float, start: float | None = None) -> tuple[list[RequestRecord], float]:
    """Send each request at its due time (seconds after the start: `start`, a time.perf_counter() value, or now),
    at most `max_concurrency` in flight.

    Returns the records in request order and the duration, from the start to the last response.
    """
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    async with _client(timeout_s) as client:
        start = time.perf_counter() if start is None else start

        async def one(spec: RequestSpec, at: float) -> RequestRecord:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            async with limit:
                record = await send(client, endpoint, spec, start)
            progress.update(record)
            return record

        records = await asyncio.gather(*(one(spec, at) for spec, at in zip(specs, due)))
        duration = time.perf_counter() - start
    progress.close()
    return list(records), duration


STREAMS_PER_CLIENT = 64   # streams one client process times faithfully: on the H100 machine one process was at 100% of a
                          # core with 256 streams of ~30 tokens/s each, and the server's batches stayed under half full


def client_processes(requested: int, streams: int | None) -> int:
    """How many client processes send a run: `requested`, or (0) one per STREAMS_PER_CLIENT of the `streams` it
    may have in flight (streams_in_flight), at most one per core; one when that is not bounded."""
    if requested > 0:
        return requested
    if not streams:
        return 1
    return max(1, min(os.cpu_count() or 1, math.ceil(streams / STREAMS_PER_CLIENT)))


def streams_in_flight(workload: Workload) -> int | None:
    """The most requests a workload has in flight: its concurrency cap, all of them when they are sent at once,
    else unbounded (None: it depends on the server's speed)."""
    if workload.max_concurrency:
        return workload.max_concurrency
    return workload.num_prompts if math.isinf(workload.request_rate) else None


def deal(specs: list[RequestSpec], max_concurrency: int | None, processes: int) -> list[tuple[list[int], int | None]]:
    """Each client process's share of a run: the request indices dealt round robin and its cap on requests in
    flight, the caps summing to `max_concurrency`; fewer processes than asked where there are fewer requests or
    streams."""
    processes = max(1, min(processes, len(specs), max_concurrency or processes))
    return [(list(range(p, len(specs), processes)),
             None if not max_concurrency else max_concurrency // processes + (p < max_concurrency % processes))
            for p in range(processes)]


def _run_share(endpoint: Endpoint, specs: list[RequestSpec], due: list[float], max_concurrency: int | None,
               timeout_s: float, barrier) -> tuple[list[RequestRecord], float, float]:
    """One client process's share: waits for every process at the barrier, then runs; returns its records (send
    times after its own start), its start and its end (time.perf_counter(): the system-wide monotonic clock)."""
    barrier.wait(timeout=300)
    start = time.perf_counter()
    records, duration = asyncio.run(run(endpoint, specs, due, max_concurrency, Progress(0, False), timeout_s, start))
    return records, start, start + duration


async def run_processes(endpoint: Endpoint, specs: list[RequestSpec], due: list[float], max_concurrency: int | None,
                        processes: int, timeout_s: float) -> tuple[list[RequestRecord], float]:
    """run() over several client processes started together, so that parsing the streams of hundreds of requests
    does not slow the client down (and with it the requests it sends next). Records in request order, send times
    after the earliest start; the duration from that start to the last response."""
    shares = deal(specs, max_concurrency, processes)
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(len(shares)) as pool:
        barrier = manager.Barrier(len(shares))
        args = [(endpoint, [specs[i] for i in indices], [due[i] for i in indices], cap, timeout_s, barrier)
                for indices, cap in shares]
        results = await asyncio.to_thread(pool.starmap, _run_share, args, 1)
    start = min(first for _, first, _ in results)
    records: list[RequestRecord | None] = [None] * len(specs)
    for (indices, _), (share, first, _) in zip(shares, results):
        for i, record in zip(indices, share):
            record.send_time += first - start
            records[i] = record
    return records, max(end for _, _, end in results) - start


async def warm_up(endpoint: Endpoint, specs: list[RequestSpec], timeout_s: float) -> None:
    """Send `specs` at once and wait; fail when none of them succeeds."""
    if not specs:
        return
    records, _ = await run(endpoint, specs, [0.0] * len(specs), None, Progress(0, False), timeout_s)
    failed = [r for r in records if not r.ok]
    if len(failed) == len(records):
        raise SystemExit(f"every warm-up request failed; the first: {failed[0].error}")
    logger.info("warm-up: %d requests, %d failed", len(records), len(failed))


async def served_base_model(base_url: str, headers: dict[str, str]) -> str:
    """The first model /v1/models lists: the base model on vLLM, SGLang and loraplex."""
    async with _client(30.0) as client:
        response = await client.get(base_url + "/v1/models", headers=headers)
        response.raise_for_status()
        return response.json()["data"][0]["id"]


def _client(timeout_s: float) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=httpx.Limits(max_connections=None))


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that build a Workload (vLLM's names where it has one); unset flags keep the preset's value."""
    add = parser.add_argument
    add("--preset", choices=sorted(PRESETS), help="a peer's workload; flags given beside it override it")
    add("--num-prompts", type=int)
    add("--dataset-path", help="JSONL of {\"prompt\": text or token ids, \"max_tokens\": optional}")
    add("--random-input-len", type=int, help="prompt length in tokens")
    add("--random-output-len", type=int, help="max_tokens (exact, with ignore_eos)")
    add("--random-range-ratio", type=float, default=0.0,
        help="lengths uniform in [len * (1 - r), len * (1 + r)], as vLLM")
    add("--input-len-range", type=int, nargs=2, metavar=("MIN", "MAX"), help="instead of len and ratio")
    add("--output-len-range", type=int, nargs=2, metavar=("MIN", "MAX"), help="instead of len and ratio")
    add("--vocab-size", type=int, help="random prompt token ids are drawn from [0, vocab-size)")
    add("--lora-names", "--lora-modules", nargs="+", help="adapter names to choose from")
    add("--lora-prefix", help="adapters PREFIX-0 .. PREFIX-(N-1), with --num-loras N")
    add("--num-loras", type=int, help="how many adapters, with --lora-prefix (default: lora)")
    add("--lora-choice", choices=ADAPTER_CHOICES, help="how each request picks its adapter")
    add("--zipf-alpha", type=float)
    add("--request-rate", type=float, help="requests per second (default inf: all at once)")
    add("--arrival", choices=ARRIVALS, help="gaps between requests: exponential (poisson) or fixed")
    add("--max-concurrency", type=int, help="requests in flight at most")
    add("--shared-prefix-len", type=int, help="tokens of a system prompt each adapter's requests share")


def workload_from_args(args: argparse.Namespace) -> Workload:
    base = PRESETS[args.preset].workload if args.preset else Workload()
    fields: dict[str, Any] = {
        "num_prompts": args.num_prompts, "dataset_path": args.dataset_path, "vocab_size": args.vocab_size,
        "adapter_choice": args.lora_choice, "zipf_alpha": args.zipf_alpha, "request_rate": args.request_rate,
        "arrival": args.arrival, "max_concurrency": args.max_concurrency, "shared_prefix_len": args.shared_prefix_len,
        "input_len": _range(args.input_len_range, args.random_input_len, args.random_range_ratio),
        "output_len": _range(args.output_len_range, args.random_output_len, args.random_range_ratio),
        "adapters": _names(args, len(base.adapters)),
    }
    return dataclasses.replace(base, **{k: v for k, v in fields.items() if v is not None})


def _range(explicit: list[int] | None, length: int | None, ratio: float) -> tuple[int, int] | None:
    if explicit:
        return tuple(explicit)
    return length_range(length, ratio) if length else None


def _names(args: argparse.Namespace, preset_count: int) -> tuple[str, ...] | None:
    if args.lora_names:
        return tuple(args.lora_names)
    if args.lora_prefix or args.num_loras:
        return adapter_names(args.lora_prefix or "lora", args.num_loras or preset_count)
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench.serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000")
    add("--model", help="the served base model name (default: the first of /v1/models)")
    add("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    add("--adapter-field", choices=("model", "lora_path"), default="model",
        help="where a request names its adapter: model (loraplex, vLLM) or lora_path (SGLang)")
    add("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    add("--structured-outputs", type=json.loads, metavar="JSON",
        help='vLLM\'s structured_outputs for every request, e.g. \'{"regex": "[a-z ]+"}\'')
    add_workload_arguments(parser)
    add("--warmup-requests", type=int, default=0, help="sent (and not counted) before the run")
    add("--client-processes", type=int, default=0,
        help=f"processes that send the requests (default: one per {STREAMS_PER_CLIENT} requests that may be in "
             "flight, by --max-concurrency or all at once, at most one per core)")
    add("--seed", type=int, default=0)
    add("--request-timeout", type=float, default=6 * 3600.0, help="seconds")
    add("--out", help="result JSON path (default: bench-serve-<preset>-<time>.json); plots go beside it")
    add("--no-plots", action="store_true")
    add("--no-progress", action="store_true")
    add("--list-presets", action="store_true", help="print the presets and exit")
    return parser


async def benchmark(endpoint: Endpoint, workload: Workload, seed: int, warmup: int, progress: bool,
                    timeout_s: float, client_processes: int = 1) -> tuple[list[RequestRecord], float]:
    """Warm up, then run the workload (over `client_processes` processes when more than one); the records and the
    run's duration."""
    await warm_up(endpoint, dataclasses.replace(workload, num_prompts=warmup).requests(seed + 1), timeout_s)
    specs, due = workload.requests(seed), workload.arrival_times(seed)
    if client_processes > 1:
        logger.info("%d requests over %d client processes", len(specs), client_processes)
        return await run_processes(endpoint, specs, due, workload.max_concurrency, client_processes, timeout_s)
    return await run(endpoint, specs, due, workload.max_concurrency,
                     Progress(len(specs), progress), timeout_s)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark the command line describes; returns what it writes to the JSON file."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    if args.list_presets:
        for preset in PRESETS.values():
            sys.stdout.write(f"{preset.name}\n    {preset.description}\n    server: {preset.server_args}\n"
                             f"    adapters: python -m bench.make_adapters {preset.make_adapters_args()}\n")
        return {}
    workload = workload_from_args(args)
    model = args.model or asyncio.run(served_base_model(args.base_url.rstrip("/"), auth_headers(args.api_key)))
    endpoint = Endpoint(args.base_url.rstrip("/"), model, args.api_key, args.adapter_field, args.ignore_eos,
                        structured=args.structured_outputs)
    processes = client_processes(args.client_processes, streams_in_flight(workload))
    records, duration = asyncio.run(benchmark(endpoint, workload, args.seed, args.warmup_requests,
                                              not args.no_progress, args.request_timeout, processes))
    summary = summarize(records, duration)
    logger.info("\n%s", format_summary(summary, f"Serving benchmark: {args.preset or 'custom'}"))
    return write_result(records, summary, _settings(args, endpoint, workload), args.out,
                        f"bench-serve-{args.preset or 'custom'}", not args.no_plots)


def _settings(args: argparse.Namespace, endpoint: Endpoint, workload: Workload) -> dict[str, Any]:
    settings = {"preset": args.preset, "seed": args.seed, "warmup_requests": args.warmup_requests,
                "client_processes": client_processes(args.client_processes, streams_in_flight(workload)),
                **dataclasses.asdict(endpoint), **dataclasses.asdict(workload)}
    settings.pop("api_key")
    if math.isinf(settings["request_rate"]):
        settings["request_rate"] = "inf"
    return settings


if __name__ == "__main__":
    main()
