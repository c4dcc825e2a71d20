"""Time to first token through the gateway alone: the real gateway with the stand-in worker of
bench/gateway_throughput.py (bench.fast_engine.FastEngine, which answers at once), one streamed completion at a
time, for a short prompt and a long one. What it measures is the host's share of a TTFT: HTTP, validation,
tokenization, the rings to the worker and back, the SSE chunk; a GPU server's TTFT adds the steps.

    python -m bench.gateway_ttft --words 20 1000 --requests 30 --out gateway_ttft.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench.gateway_throughput import SERVED_NAME, free_port, start_gateway, stop_gateway, write_tokenizer

WORDS = "the quick brown fox jumps over a lazy dog while the server answers every request in order".split()


def prompt(num_words: int, seed: int) -> str:
    """A prompt of `num_words` words, different for each seed (no two requests alike)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def time_to_first_token(client: httpx.Client, text: str) -> float:
    """Seconds from sending a streamed completion to its first chunk with text; the stream is read to its end."""
    body = {"model": SERVED_NAME, "prompt": text, "max_tokens": 4, "stream": True}
    start, first = time.perf_counter(), None
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: ") and '"text"' in line:
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("the stream ended without a text chunk")
    return first


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--words", type=int, nargs="+", default=[20, 1000], help="prompt lengths in words")
    parser.add_argument("--requests", type=int, default=30, help="requests per length (the first 5 not counted)")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, port = Path(tmp) / "model", free_port()
        write_tokenizer(model_dir)
        gateway = start_gateway(model_dir, port, Path(tmp) / "gateway.log", step_ms=0.0)
        try:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                for words in args.words:
                    ttfts = [time_to_first_token(client, prompt(words, i)) for i in range(args.requests)]
                    counted = ttfts[5:] or ttfts
                    results[words] = {"ttft_p50_ms": 1e3 * statistics.median(counted),
                                      "ttft_min_ms": 1e3 * min(counted), "requests": len(counted)}
                    print(f"{words} words: TTFT p50 {results[words]['ttft_p50_ms']:.2f} ms, "
                          f"min {results[words]['ttft_min_ms']:.2f} ms")
        finally:
            stop_gateway(gateway)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
