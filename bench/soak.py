"""A bounded soak of the whole server on loopback: mixed traffic, disconnects, adapter churn, bad requests.

    python -m bench.soak --minutes 10 --out soak.json

Serves the embedded demo (`python -m gateway demo`, runtime adapter loading on), then runs `--clients`
concurrent clients for `--minutes`. Each client loops over a random mix of: streamed completions and chat
completions on the base model or an adapter (a share of them cut off after a few chunks), whole
completions, loads and unloads of extra copies of a demo adapter, bad requests (malformed bodies,
wrong content types, unknown models, out-of-range fields), and hostile ones (HOSTILE: deep JSON inside
string fields, long token-id lists, a large fan-out, specs no output satisfies, bad adapter names; each client
sends them in turn, in the warm-up too: the first requests with 100,000 allowed token ids or 2,000 bad words raise
the gateway's RSS by a few MB once, the heap those large bodies need, flat after). Beside them a probe sends one plain request every
`--probe-every-s`. The soak alternates, every `--phase-seconds`, between sending the hostile requests and sending
their twins in their place (TWINS: the same route and work without what makes them hostile: the request without its
long list, a satisfiable grammar, a plain completion where the hostile one is refused), so the slow-down a hostile
neighbour causes is the probe's latency in the hostile phases over its latency in the twin phases, taken side by side
in one run (median, 95th percentile and worst): on a CPU a legitimate neighbour (an `n` of 16) slows the probe by
its own compute, which the twin phases hold too. Afterwards it waits for the server to go idle
and checks what a long-running server must keep true:

- no answer was a 5xx, every bad request got a 4xx, every hostile one a 2xx or a 4xx, and every twin a 2xx;
- no plain request was slowed more than `--max-slowdown` times by hostile neighbours (the worst probe of the hostile
  phases over the worst of the twin phases);
- running and waiting requests are back to 0, KV-cache usage (`vllm:kv_cache_usage_perc`) is back to 0 (no
  leaked blocks), and the GPU adapter slots hold no more adapters than `--max-loras` with none still loading;
- the gateway's and the worker's private RSS (RSS less shared memory) are within `--rss-tolerance` of their
  values after the warm-up, and the gateway's shared memory (the two rings, whose pages count as they are
  first written, so it grows until each ring has gone round once) is at most the rings' size.

The JSON holds the counts per kind and status (each hostile request also under its name), the 5xx count per
kind, the plain request's latencies against its baseline, the RSS samples and each check's result; the exit
status is 1 when a check failed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from gateway.worker_client import RING_BYTES
from worker.ipc.shm_ring import HEADER_BYTES

PAGE = os.sysconf("SC_PAGE_SIZE")
RINGS_MB = 2 * -(-(HEADER_BYTES + RING_BYTES) // PAGE) * PAGE / 2**20   # the gateway's two rings, in whole pages
EXTRA_ADAPTERS = 4          # runtime-loaded copies of a demo adapter, churned by the clients
BAD_BODIES = [               # (content type, body): each must get a 4xx
    ("application/json", b"{"),
    ("application/json", b"\xff\xfe{}"),
    ("application/json", b"[" * 5000 + b"]" * 5000),
    ("text/plain", b'{"prompt": "x", "model": "loraplex-demo"}'),
    ("application/json", b'{"prompt": "x", "model": "no-such-model"}'),
    ("application/json", b'{"prompt": "x", "model": "loraplex-demo", "max_tokens": -3}'),
    ("application/json", b'{"prompt": "x", "model": "loraplex-demo", "temperature": "hot"}'),
    ("application/json", b'{"prompt": [999999999], "model": "loraplex-demo"}'),
]


PLAIN = {"model": "loraplex-demo", "prompt": "The weather today", "max_tokens": 8, "temperature": 0.0,
         "ignore_eos": True}       # the probe's request


def hostile_requests(adapter_path: str) -> dict[str, tuple[str, dict]]:
    """name -> (route, body): what a careless or hostile client sends; each must get a 2xx or a 4xx, and no
    neighbour may wait on it."""
    chat = [{"role": "user", "content": "hi"}]
    deep_arguments = [*chat, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": "[" * 1000 + "]" * 1000}}]}]
    completion = {"model": "loraplex-demo", "prompt": "hi", "max_tokens": 4}
    return {
        "deep_json_in_tool_arguments": ("/v1/chat/completions",
                                        {"model": "loraplex-demo", "messages": deep_arguments, "max_tokens": 4}),
        "deep_json_in_tool_arguments_tokenize": ("/tokenize", {"model": "loraplex-demo", "messages": deep_arguments}),
        "deep_json_in_guided_json": ("/v1/completions", {**completion, "guided_json": "[" * 2000 + "]" * 2000}),
        "deep_json_in_structured_outputs": ("/v1/completions", {**completion, "structured_outputs": {
            "json": '{"a": ' * 2000 + "1" + "}" * 2000}}),
        "long_allowed_token_ids": ("/v1/completions", {**completion, "max_tokens": 10, "ignore_eos": True, "n": 16,
                                                       "temperature": 1.0, "allowed_token_ids": [300] * 100_000}),
        "long_bad_words": ("/v1/completions", {**completion, "bad_words": [f"w{i}" for i in range(2000)]}),
        "long_logit_bias": ("/v1/completions", {**completion, "logit_bias": {str(i): 1.0 for i in range(1000)}}),
        "long_stop_list": ("/v1/completions", {**completion, "stop": [f"s{i}" for i in range(1000)]}),
        "large_fan_out": ("/v1/completions", {**completion, "prompt": [[5, 6]] * 800, "n": 128, "max_tokens": 1,
                                              "temperature": 1.0}),
        "unsatisfiable_grammar": ("/v1/completions", {**completion, "guided_grammar": "root ::= x\nx ::= y\ny ::= x"}),
        "self_referring_schema": ("/v1/chat/completions", {"model": "loraplex-demo", "messages": chat,
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "s", "schema": {"$ref": "#"}}}}),
        "remote_ref_schema": ("/v1/completions", {**completion, "guided_json": {"$ref": "https://example.com/s.json"}}),
        "best_of": ("/v1/completions", {**completion, "best_of": 4, "n": 2, "temperature": 1.0}),
        "adapter_name_with_dots": ("/v1/load_lora_adapter", {"lora_name": "x/../y", "lora_path": adapter_path}),
        "adapter_name_with_nul": ("/v1/load_lora_adapter", {"lora_name": "a\u0000b", "lora_path": adapter_path}),
        "adapter_path_outside": ("/v1/load_lora_adapter", {"lora_name": "outside", "lora_path": "/etc"}),
        "model_is_a_path": ("/v1/completions", {**completion, "model": "../../etc/passwd"}),
        "tokenize_past_the_context": ("/tokenize", {"model": "loraplex-demo", "messages": [
            {"role": "user", "content": "hello " * 5000}]}),
    }


def twin_requests(hostile: dict[str, tuple[str, dict]]) -> dict[str, tuple[str, dict]]:
    """name -> (route, body): each hostile request's twin, the same work without what makes it hostile."""
    chat = [{"role": "user", "content": "hi"}]
    plain_arguments = [*chat, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a": [1]}'}}]}]
    completion = {"model": "loraplex-demo", "prompt": "hi", "max_tokens": 4}

    def without(name: str, *fields: str) -> tuple[str, dict]:
        route, body = hostile[name]
        return route, {key: value for key, value in body.items() if key not in fields}

    twins = {
        "deep_json_in_tool_arguments": ("/v1/chat/completions",
                                        {"model": "loraplex-demo", "messages": plain_arguments, "max_tokens": 4}),
        "deep_json_in_tool_arguments_tokenize": ("/tokenize", {"model": "loraplex-demo", "messages": plain_arguments}),
        "deep_json_in_guided_json": ("/v1/completions", {**completion, "guided_json": '{"type": "array"}'}),
        "deep_json_in_structured_outputs": ("/v1/completions", {**completion, "structured_outputs": {
            "json": '{"type": "object", "properties": {"a": {"type": "integer"}}}'}}),
        "long_allowed_token_ids": without("long_allowed_token_ids", "allowed_token_ids"),
        "long_bad_words": without("long_bad_words", "bad_words"),
        "long_logit_bias": without("long_logit_bias", "logit_bias"),
        "long_stop_list": without("long_stop_list", "stop"),
        "unsatisfiable_grammar": ("/v1/completions", {**completion, "guided_grammar": 'root ::= "a" | "b" root'}),
        "self_referring_schema": ("/v1/chat/completions", {"model": "loraplex-demo", "messages": chat,
                                  "response_format": {"type": "json_schema",
                                                      "json_schema": {"name": "s", "schema": {"type": "object"}}}}),
        "remote_ref_schema": ("/v1/completions", {**completion, "guided_json": {"type": "string"}}),
        "best_of": without("best_of", "best_of"),
        "tokenize_past_the_context": hostile["tokenize_past_the_context"],    # served either way: counted
    }
    return {name: twins.get(name, ("/v1/completions", completion)) for name in hostile}


class Phases:
    """Hostile and twin phases of `seconds` each, in turn from `start` (twin first)."""

    def __init__(self, start: float, seconds: float):
        self.start, self.seconds = start, seconds

    def hostile_now(self) -> bool:
        return int((time.monotonic() - self.start) // self.seconds) % 2 == 1


def demo_assets() -> dict:
    done = subprocess.run([sys.executable, "-m", "worker.demo"], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def start_server(port: int, max_loras: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    command = [sys.executable, "-m", "gateway", "demo", "--port", str(port), "--max-loras", str(max_loras),
               "--uvicorn-log-level", "warning"]
    return subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def wait_healthy(url: str, process: subprocess.Popen, timeout_s: float = 180, every_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} during startup")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(every_s)
    raise RuntimeError(f"the server was not healthy within {timeout_s} s")


def rss_mb(process: subprocess.Popen) -> dict[str, float]:
    """Resident memory of the gateway and of its worker (its child processes, summed): private (RSS less
    shared memory) as `gateway` and `worker`, shared memory as `gateway_shared` and `worker_shared`."""
    private, shared = _private_and_shared_kb(process.pid)
    workers = [_private_and_shared_kb(p.pid) for p in psutil.Process(process.pid).children(recursive=True)]
    return {"gateway": private / 1024, "worker": sum(p for p, _ in workers) / 1024,
            "gateway_shared": shared / 1024, "worker_shared": sum(s for _, s in workers) / 1024}


def _private_and_shared_kb(pid: int) -> tuple[int, int]:
    """(RSS less shared memory, shared memory) of one process, in kB, from /proc/<pid>/status (Linux)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    rss, shared = (int(fields[key].split()[0]) for key in ("VmRSS", "RssShmem"))
    return rss - shared, shared


def sample_rss(process: subprocess.Popen, samples: list, seconds: float, every_s: float = 30.0) -> None:
    """Append rss_mb(process) every `every_s` for `seconds` (the shape of any growth: a plateau or a slope)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(every_s, max(0.0, end - time.monotonic())))
        samples.append({side: round(mb, 1) for side, mb in rss_mb(process).items()})


class Client:
    """One client's loop of random operations; counts (kind, status) pairs."""

    def __init__(self, http: httpx.AsyncClient, rng: random.Random, adapters: list[str], extra: dict[str, str],
                 counts: Counter, hostile: dict[str, tuple[str, dict]], hostile_weight: float = 1.0,
                 phases: Phases | None = None):
        self.http, self.rng, self.adapters, self.extra, self.counts = http, rng, adapters, extra, counts
        self.hostile_requests, self.hostile_weight = hostile, hostile_weight
        self.twins, self.phases = twin_requests(hostile) if phases is not None else {}, phases
        self._hostile_order = rng.sample(sorted(hostile), len(hostile))     # each in turn: a short run sees them all
        self._hostile_sent = 0

    async def run(self, until: float) -> None:
        while time.monotonic() < until:
            kinds = ["stream", "chat", "whole", "churn", "bad", "hostile"]
            kind = self.rng.choices(kinds, [4, 2, 2, 1, 1, self.hostile_weight if self.hostile_requests else 0])[0]
            if kind == "hostile" and self.phases is not None and not self.phases.hostile_now():
                kind = "twin"
            try:
                status = await getattr(self, kind)()
            except httpx.TransportError as e:
                status = f"transport:{type(e).__name__}"
            self.counts[(kind, str(status))] += 1

    def _model(self) -> str:
        return self.rng.choice(["loraplex-demo", *self.adapters, *self.extra])

    async def stream(self) -> int:
        body = {"model": self._model(), "prompt": "The weather today", "stream": True,
                "max_tokens": self.rng.randint(1, 48), "temperature": self.rng.choice([0.0, 0.8])}
        cut = self.rng.random() < 0.3            # the client goes away after a few chunks
        async with self.http.stream("POST", "/v1/completions", json=body) as response:
            chunks = 0
            async for line in response.aiter_lines():
                chunks += line.startswith("data:")
                if cut and chunks >= 3:
                    break
            return response.status_code

    async def chat(self) -> int:
        body = {"model": self._model(), "messages": [{"role": "user", "content": "Tell me something"}],
                "stream": True, "max_tokens": self.rng.randint(1, 32)}
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            async for _ in response.aiter_lines():
                pass
            return response.status_code

    async def whole(self) -> int:
        body = {"model": self._model(), "prompt": "Once upon a time", "max_tokens": self.rng.randint(1, 32),
                "n": self.rng.choice([1, 2])}
        return (await self.http.post("/v1/completions", json=body)).status_code

    async def churn(self) -> int:
        name = self.rng.choice(list(self.extra))
        if self.rng.random() < 0.5:
            body = {"lora_name": name, "lora_path": self.extra[name]}
            return (await self.http.post("/v1/load_lora_adapter", json=body)).status_code
        return (await self.http.post("/v1/unload_lora_adapter", json={"lora_name": name})).status_code

    async def bad(self) -> int:
        content_type, body = self.rng.choice(BAD_BODIES)
        response = await self.http.post("/v1/completions", content=body, headers={"content-type": content_type})
        return response.status_code

    async def hostile(self) -> str:
        """The status, counted under the request's name too (`hostile <name> <status>` in the report)."""
        return await self._next_of(self.hostile_requests, "hostile")

    async def twin(self) -> str:
        """The next hostile request's twin, in a twin phase (`twin <name> <status>`)."""
        return await self._next_of(self.twins, "twin")

    async def _next_of(self, requests: dict[str, tuple[str, dict]], kind: str) -> str:
        name = self._hostile_order[self._hostile_sent % len(self._hostile_order)]
        self._hostile_sent += 1
        route, body = requests[name]
        try:
            status = str((await self.http.post(route, json=body)).status_code)
        except httpx.TransportError as e:
            self.counts[(f"{kind}:{name}", f"transport:{type(e).__name__}")] += 1
            raise
        self.counts[(f"{kind}:{name}", status)] += 1
        return status


async def probe(http: httpx.AsyncClient, until: float, every_s: float, latencies: list[float],
                counts: Counter, phases: Phases | None = None, twin_latencies: list[float] | None = None) -> None:
    """PLAIN every `every_s` seconds, one at a time; its latencies in seconds (those started in a twin phase into
    `twin_latencies`)."""
    while time.monotonic() < until:
        start = time.monotonic()
        into = twin_latencies if phases is not None and not phases.hostile_now() else latencies
        try:
            status = str((await http.post("/v1/completions", json=PLAIN)).status_code)
        except httpx.TransportError as e:
            status = f"transport:{type(e).__name__}"
        into.append(time.monotonic() - start)
        counts[("probe", status)] += 1
        await asyncio.sleep(max(0.0, every_s - (time.monotonic() - start)))


async def traffic(url: str, seconds: float, clients: int, adapters: list[str], extra: dict[str, str],
                  seed: int, hostile: dict[str, tuple[str, dict]], probe_every_s: float,
                  hostile_weight: float = 1.0, phase_seconds: float | None = None
                  ) -> tuple[Counter, list[float], list[float]]:
    """(kind, status) counts of `clients` clients for `seconds`, and the probe's latencies meanwhile: in the hostile
    phases (all of them without `phase_seconds`) and in the twin phases."""
    counts: Counter = Counter()
    latencies: list[float] = []
    twin_latencies: list[float] = []
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        start = time.monotonic()
        until = start + seconds
        phases = Phases(start, phase_seconds) if phase_seconds and hostile else None
        loops = [Client(http, random.Random(seed + i), adapters, extra, counts, hostile, hostile_weight, phases)
                 for i in range(clients)]
        await asyncio.gather(probe(http, until, probe_every_s, latencies, counts, phases, twin_latencies),
                             *(c.run(until) for c in loops))
    return counts, latencies, twin_latencies


def slowdown(warmup: list[float], latencies: list[float]) -> dict[str, float | None]:
    """The probe's latencies against its baseline, the median of the warm-up's second half (the first holds the
    cold server's compilations): median and worst ratio, and the milliseconds."""
    baseline = warmup[len(warmup) // 2:]
    if not baseline or not latencies:
        return {"baseline_p50_ms": None, "p50_ms": None, "worst_ms": None, "p50_ratio": None, "worst_ratio": None}
    base = statistics.median(baseline)
    return {"baseline_p50_ms": round(base * 1e3, 1), "p50_ms": round(statistics.median(latencies) * 1e3, 1),
            "worst_ms": round(max(latencies) * 1e3, 1),
            "p50_ratio": round(statistics.median(latencies) / base, 2), "worst_ratio": round(max(latencies) / base, 2)}


def side_by_side(twin: list[float], hostile: list[float]) -> dict[str, float | None]:
    """The probe's latencies in the hostile phases against the twin phases of the same run: median, 95th percentile
    and worst of each (ms), and each hostile figure over its twin."""
    if not twin or not hostile:
        return {"worst_ratio": None}
    def stats(values: list[float]) -> dict[str, float]:
        ordered = sorted(values)
        return {"p50": statistics.median(ordered), "p95": ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
                "worst": ordered[-1]}
    a, b = stats(twin), stats(hostile)
    return {**{f"twin_{k}_ms": round(v * 1e3, 1) for k, v in a.items()},
            **{f"hostile_{k}_ms": round(v * 1e3, 1) for k, v in b.items()},
            **{f"{k}_ratio": round(b[k] / a[k], 2) for k in a}, "probes": [len(twin), len(hostile)]}


IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def idle_state(url: str, timeout_s: float = 60) -> dict:
    """Wait until no request runs or waits and no KV block is in use; then the gauges and the adapters' places."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        gauges = {name: sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                            if line.startswith(name + "{"))
                  for name in IDLE_GAUGES}
        if not any(gauges.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    adapters = httpx.get(f"{url}/v1/adapters", timeout=10).json()["data"]
    return {"gauges": gauges, "on_gpu": sum(a["residency"] == "gpu" for a in adapters),
            "loading": sum(bool(a["loading"]) for a in adapters)}


def server_errors(counts: Counter) -> dict:
    """5xx answers: in all, and per kind (a hostile request's under its name too)."""
    by_kind: Counter = Counter()
    for (kind, status), n in counts.items():
        if status.startswith("5"):
            by_kind[kind] += n
    return {"total": sum(n for kind, n in by_kind.items() if not kind.startswith(("hostile:", "twin:"))),
            "by_kind": dict(sorted(by_kind.items()))}


def checks(counts: Counter, idle: dict, rss_warm: dict, rss_end: dict, max_loras: int, tolerance: float,
           probe_slowdown: dict, max_slowdown: float) -> dict:
    """What a long-running server must keep true; `probe_slowdown`'s worst_ratio: the hostile neighbours' slow-down
    (side_by_side, or against the warm-up's median where the soak had no twin phases)."""
    errors = server_errors(counts)
    bad_not_4xx = sum(n for (kind, status), n in counts.items() if kind == "bad" and not status.startswith("4"))
    hostile_not_2xx_4xx = sum(n for (kind, status), n in counts.items()
                              if kind == "hostile" and status[:1] not in ("2", "4"))
    twin_not_2xx = sum(n for (kind, status), n in counts.items() if kind == "twin" and status[:1] != "2")
    worst = probe_slowdown["worst_ratio"]
    return {"no_5xx": errors["total"] == 0, "bad_requests_got_4xx": bad_not_4xx == 0,
            "hostile_requests_got_2xx_or_4xx": hostile_not_2xx_4xx == 0,
            "twin_requests_got_2xx": twin_not_2xx == 0,
            "plain_request_slowdown_within": worst is not None and worst <= max_slowdown,
            "idle_requests_zero": not (idle["gauges"]["vllm:num_requests_running"]
                                       or idle["gauges"]["vllm:num_requests_waiting"]),
            "idle_kv_blocks_free": idle["gauges"]["vllm:kv_cache_usage_perc"] == 0,
            "slots_settled": idle["on_gpu"] <= max_loras and idle["loading"] == 0,
            **{f"rss_{side}_within_tolerance": rss_end[side] <= rss_warm[side] * (1 + tolerance)
               for side in ("gateway", "worker")},
            "gateway_shared_within_rings": rss_end["gateway_shared"] <= RINGS_MB}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup-minutes", type=float, default=1.0, help="traffic before the RSS baseline")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=2)
    parser.add_argument("--port", type=int, default=8199)
    parser.add_argument("--rss-tolerance", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--probe-every-s", type=float, default=1.0, help="how often the plain request is timed")
    parser.add_argument("--max-slowdown", type=float, default=2.0,
                        help="the plain request's worst latency in the hostile phases over its worst in the twin "
                             "phases, at most")
    parser.add_argument("--phase-seconds", type=float, default=30.0,
                        help="hostile and twin phases alternate this often (the slow-down is taken between them)")
    parser.add_argument("--hostile-weight", type=float, default=1.0,
                        help="hostile requests' share of the mix, against 4 streams, 2 chats, 2 whole, 1 churn, 1 bad; "
                             "0 leaves them out")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    assets, url = demo_assets(), f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as tmp:
        source = next(iter(assets["adapters"].values()))
        extra = {f"extra-{i}": shutil.copytree(source, Path(tmp) / f"extra-{i}") for i in range(EXTRA_ADAPTERS)}
        extra = {name: str(path) for name, path in extra.items()}
        server = start_server(args.port, args.max_loras, Path(tmp) / "server.log")
        try:
            wait_healthy(url, server)
            adapters = list(assets["adapters"])
            hostile = hostile_requests(extra["extra-0"]) if args.hostile_weight > 0 else {}
            warm, baseline, _ = asyncio.run(traffic(url, 60 * args.warmup_minutes, args.clients, adapters, extra,
                                                    args.seed, hostile, args.probe_every_s, args.hostile_weight))
            rss_warm, samples = rss_mb(server), []
            sampler = threading.Thread(target=sample_rss, args=(server, samples, 60 * args.minutes), daemon=True)
            start = time.monotonic()
            sampler.start()
            counts, latencies, twin_latencies = asyncio.run(traffic(
                url, 60 * args.minutes, args.clients, adapters, extra, args.seed + 1000, hostile, args.probe_every_s,
                args.hostile_weight, args.phase_seconds))
            seconds = time.monotonic() - start
            sampler.join()
            idle = idle_state(url)
            rss_end = rss_mb(server)
            alive = server.poll() is None
        finally:
            server.terminate()
            server.wait(30)
    beside = side_by_side(twin_latencies, latencies)
    probe_slowdown = beside if beside["worst_ratio"] is not None else slowdown(baseline, latencies)
    operations = sum(n for (kind, _), n in counts.items() if not kind.startswith(("hostile:", "twin:")))
    result = {"minutes": seconds / 60, "clients": args.clients, "warmup": _flat(warm), "counts": _flat(counts),
              "operations": operations, "server_errors": server_errors(counts),
              "plain_request_beside_hostile": beside,
              "plain_request_against_warmup": slowdown(baseline, [*latencies, *twin_latencies]),
              "idle": idle, "rss_mb_after_warmup": rss_warm,
              "rss_mb_at_end": rss_end, "rss_mb_every_30_s": samples, "server_alive_at_end": alive,
              "checks": checks(counts, idle, rss_warm, rss_end, args.max_loras, args.rss_tolerance, probe_slowdown,
                               args.max_slowdown)}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    sys.exit(0 if alive and all(result["checks"].values()) else 1)


def _flat(counts: Counter) -> dict[str, int]:
    return {f"{kind} {status}": n for (kind, status), n in sorted(counts.items())}


if __name__ == "__main__":
    main()
