"""Gateway throughput: streamed tokens per second through the real gateway, with a stand-in worker.

    python -m bench.gateway_throughput --streams 64 --duration 10 --out gateway_throughput.json

Three kinds of processes: the gateway (the real Starlette app under uvicorn, one process, pinned to
one core), its worker running bench.fast_engine.FastEngine (tokens as fast as it can make them, or one
per stream every --step-ms, as a GPU's decode steps come), and client processes, each driving its share
of the SSE streams over keep-alive HTTP/1.1 connections it reads by hand (lighter than httpx, so that the
clients' CPU stays small beside the gateway's). Every stream sends completion requests back to back until
the duration is over. Tokens are counted on the client side from each stream's final usage chunk, and SSE chunks apart:
a stream that keeps up gets one chunk per token, one that falls behind gets the tokens waiting for it
merged into one chunk (gateway.output_collector). The gateway's vllm:generation_tokens_total counts what
the worker sent.

Reported: tokens and chunks per wall-clock second, tokens per chunk, and tokens per CPU second of the
gateway process (its throughput at a full core, whatever else the machine is running).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import platform
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

from bench.fast_engine import STEP_MS_ENV

logger = logging.getLogger("bench.gateway_throughput")

FAST_ENGINE = "bench.fast_engine:FastEngine"
SERVED_NAME = "bench"
PROMPT = "A language model server"
GOAL_TOKENS_PER_S = 60_000         # at 256 and 512 streams on the GPU machine's CPUs (issue 20)
STARTUP_SECONDS = 60


@dataclass
class ClientResult:
    requests: int = 0
    tokens: int = 0              # from the usage chunks
    chunks: int = 0              # SSE events that carry a choice
    finished_at: float = 0.0     # time.monotonic(), shared by the processes of one machine


# gateway process

def serve(model_dir: str, port: int) -> None:
    """The real gateway app, one uvicorn process, with FastEngine as its worker's engine."""
    import uvicorn

    from gateway.app import build_app
    from gateway.config import GatewayConfig
    from gateway.worker_client import WorkerClient
    from worker.config import ModelConfig, WorkerConfig

    config = GatewayConfig(WorkerConfig(ModelConfig(model_dir), device="cpu"), served_model_names=(SERVED_NAME,),
                           uvicorn_log_level="warning")
    app = build_app(config, WorkerClient(config.worker, engine_factory=FAST_ENGINE))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def write_tokenizer(model_dir: Path) -> None:
    """A byte-level BPE trained on the fast demo's corpus, as worker.demo builds it, without torch."""
    from worker.demo import FAST
    from worker.demo.corpus import read_corpus
    from worker.demo.tokenizer import END_OF_TEXT, train_tokenizer

    corpus = read_corpus(FAST.base_bytes, FAST.slice_bytes)
    tokenizer = train_tokenizer(corpus.base, FAST.vocab_size)
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": END_OF_TEXT}))


def start_gateway(model_dir: Path, port: int, log_path: Path, step_ms: float) -> subprocess.Popen:
    command = [sys.executable, "-m", "bench.gateway_throughput", "--serve", "--model-dir", str(model_dir),
               "--port", str(port)]
    env = {**os.environ, STEP_MS_ENV: str(step_ms)}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, cwd=Path(__file__).resolve().parents[1], stdout=log,
                                   stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_SECONDS
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the gateway exited with {process.returncode}:\n{log_path.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the gateway was not healthy within {STARTUP_SECONDS} s:\n{log_path.read_text()}")


def stop_gateway(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


# client processes

def run_client(url: str, num_streams: int, max_tokens: int, start_at: float, stop_at: float,
               cpus: list[int] | None, results: multiprocessing.Queue) -> None:
    """Client process: its ClientResult as a dict, or {"error": traceback}, goes to `results`."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        results.put(asdict(asyncio.run(drive_streams(url, num_streams, max_tokens, start_at, stop_at))))
    except Exception:
        results.put({"error": traceback.format_exc()})


async def drive_streams(url: str, num_streams: int, max_tokens: int, start_at: float,
                        stop_at: float) -> ClientResult:
    result = ClientResult()
    body = json.dumps({"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    address = httpx.URL(url)
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: {address.host}:{address.port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))
    await asyncio.gather(*(stream_until(address.host, address.port, request, stop_at, result)
                           for _ in range(num_streams)))
    result.finished_at = time.monotonic()
    return result


async def stream_until(host: str, port: int, request: bytes, stop_at: float, result: ClientResult) -> None:
    """Streamed completions back to back on one keep-alive connection (a new one if the server closes it)."""
    connection = None
    try:
        while time.monotonic() < stop_at:
            connection = connection or await asyncio.open_connection(host, port)
            events, usage, keep_alive = await one_stream(*connection, request)
            result.requests += 1
            result.chunks += events - 2          # less the usage chunk and [DONE]
            result.tokens += usage["completion_tokens"]
            if not keep_alive:
                connection[1].close()
                connection = None
    finally:
        if connection is not None:
            connection[1].close()


async def one_stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     request: bytes) -> tuple[int, dict, bool]:
    """(number of SSE events, the usage of the final chunk, whether the connection stays open) of one streamed
    completion, read as HTTP/1.1 chunked transfer coding by hand: a lighter client than httpx, so that the
    clients' CPU stays small beside the gateway's."""
    writer.write(request)
    status = await reader.readline()
    if not status.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the gateway answered {status!r}")
    headers = b""
    while (line := await reader.readline()) != b"\r\n":
        headers += line.lower()
    events, tail = 0, b""
    while size := int((await reader.readline()).split(b";", 1)[0], 16):
        data = (await reader.readexactly(size + 2))[:-2]
        # the gateway writes whole events ("data: ...\n\n") one or more to an HTTP chunk; JSON escapes
        # newlines inside strings, so no other "\n\n" exists
        events += data.count(b"\n\n")
        tail = (tail + data)[-8192:]
    await reader.readline()                      # the blank line after the last chunk
    return events, usage_of(tail), b"connection: close" not in headers


def usage_of(tail: bytes) -> dict:
    """The usage object of the last chunk before [DONE]."""
    last = tail.rsplit(b"data: [DONE]", 1)[0].rstrip().rsplit(b"data: ", 1)[1]
    return json.loads(last)["usage"]


# orchestration

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pin(process: subprocess.Popen, gateway_cpu: int | None) -> tuple[list[int] | None, list[int] | None]:
    """Pin the gateway to `gateway_cpu` and its worker to the other cores; (gateway, other) cpu lists."""
    cpus = sorted(os.sched_getaffinity(0))
    if gateway_cpu is None or len(cpus) < 2:
        return None, None
    others = [c for c in cpus if c != gateway_cpu]
    gateway = psutil.Process(process.pid)
    gateway.cpu_affinity([gateway_cpu])
    for child in gateway.children(recursive=True):
        child.cpu_affinity(others)
    return [gateway_cpu], others


def generation_tokens_total(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return int(float(re.search(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", text, re.MULTILINE).group(1)))


def measure(url: str, process: subprocess.Popen, args: argparse.Namespace,
            client_cpus: list[int] | None) -> dict:
    shares = [args.streams // args.clients + (i < args.streams % args.clients) for i in range(args.clients)]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    start_at = time.monotonic() + args.client_startup
    stop_at = start_at + args.duration
    clients = [context.Process(target=run_client, args=(url, share, args.max_tokens, start_at, stop_at,
                                                         client_cpus, results))
               for share in shares]
    for client in clients:
        client.start()
    gateway = psutil.Process(process.pid)
    tokens_before = generation_tokens_total(url)
    time.sleep(max(0.0, start_at - time.monotonic()))
    cpu_before = gateway.cpu_times()
    answers = [results.get(timeout=args.duration + 300) for _ in clients]
    failed = [a["error"] for a in answers if "error" in a]
    if failed:
        raise RuntimeError(f"a client process failed:\n{failed[0]}")
    collected = [ClientResult(**a) for a in answers]
    cpu_after = gateway.cpu_times()
    for client in clients:
        client.join()
    elapsed = max(r.finished_at for r in collected) - start_at
    tokens, chunks = sum(r.tokens for r in collected), sum(r.chunks for r in collected)
    gateway_cpu = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
    return {
        "requests": sum(r.requests for r in collected), "tokens": tokens, "chunks": chunks,
        "tokens_sent_by_worker": generation_tokens_total(url) - tokens_before,
        "elapsed_s": round(elapsed, 3), "tokens_per_s": round(tokens / elapsed, 1),
        "chunks_per_s": round(chunks / elapsed, 1), "tokens_per_chunk": round(tokens / max(chunks, 1), 2),
        "gateway_cpu_s": round(gateway_cpu, 3),
        "tokens_per_gateway_cpu_s": round(tokens / gateway_cpu, 1) if gateway_cpu > 0 else None,
    }


def run(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory(prefix="loraplex-bench-") as tmp:
        model_dir = Path(args.model_dir) if args.model_dir else Path(tmp) / "model"
        if not args.model_dir:
            write_tokenizer(model_dir)
        port = free_port()
        process = start_gateway(model_dir, port, Path(tmp) / "gateway.log", args.step_ms)
        try:
            url = f"http://127.0.0.1:{port}"
            gateway_cpus, other_cpus = pin(process, args.gateway_cpu)
            httpx.post(f"{url}/v1/completions", json={"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 8},
                       timeout=30).raise_for_status()          # warm-up
            measured = measure(url, process, args, other_cpus)
        finally:
            stop_gateway(process)
    offered = args.streams * 1000 / args.step_ms if args.step_ms else None
    return {"streams": args.streams, "clients": args.clients, "max_tokens": args.max_tokens,
            "duration_s": args.duration, "step_ms": args.step_ms, "offered_tokens_per_s": offered, **measured,
            "goal_tokens_per_s": GOAL_TOKENS_PER_S,
            "gateway_cpus": gateway_cpus, "client_and_worker_cpus": other_cpus, "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "command": " ".join(["python -m bench.gateway_throughput",
                                                                      *args.argv])}


def default_clients() -> int:
    return max(2, min(8, (len(os.sched_getaffinity(0)) - 2) // 2))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=64, help="concurrent SSE streams")
    parser.add_argument("--clients", type=int, default=default_clients(),
                        help="client processes sharing the streams (default: one per two cores past the first "
                             "two, from 2 to 8: 7 on 16 cores)")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens per request")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds during which requests start")
    parser.add_argument("--step-ms", type=float, default=0.0,
                        help="each engine step (one token for every stream) takes at least this long, as a GPU "
                             "decode step does; 0: as fast as the worker can go")
    parser.add_argument("--client-startup", type=float, default=2.0, help="seconds allowed for clients to start")
    parser.add_argument("--gateway-cpu", type=int, default=0,
                        help="core the gateway is pinned to (its worker and the clients get the others); "
                             "-1: no pinning")
    parser.add_argument("--model-dir", help="a directory with tokenizer.json; default: a byte-level BPE "
                                            "trained on the demo corpus")
    parser.add_argument("--out", help="write the result as JSON here")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> dict | None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.serve:
        serve(args.model_dir, args.port)
        return None
    args.argv = argv
    args.gateway_cpu = None if args.gateway_cpu < 0 else args.gateway_cpu
    result = run(args)
    logger.info("%d streams: %.0f tokens/s in %.0f chunks/s (%.2f tokens a chunk; %.0f tokens per gateway CPU "
                "second), %d tokens in %.2f s", args.streams, result["tokens_per_s"], result["chunks_per_s"],
                result["tokens_per_chunk"], result["tokens_per_gateway_cpu_s"] or 0, result["tokens"],
                result["elapsed_s"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
