"""Decode-step time with a quarter of the batch constrained by a JSON schema, against the same batch unconstrained.

    python -m bench.structured_step --model bench/configs/llama-3.1-8b --out structured.json

Dummy weights (--load-format dummy) of the model's shape; the grammars are compiled for a stand-in tokenizer of
the model's vocabulary size (make_grammar_tokenizer: every printable ASCII character, then random strings), so
the matchers fill real masks of that size. Constrained rows follow a schema with an open string, which they
cannot leave but by the one `"` token, so they stay constrained for the whole timing. Each run times the wall
time of Engine.step() after every request is prefilled; "sync" is the unconstrained batch with async
scheduling off, the bound a constrained step would fall to if it gave up the overlap entirely.
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
import string
import tempfile
import time
from pathlib import Path

import torch

from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams, StructuredOutput
from worker.arch import ArchConfig

logger = logging.getLogger(__name__)
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "note": {"type": "string"}},
          "required": ["id", "note"]}
BATCHES = (8, 32, 64)
PROMPT_LEN = 128


def make_grammar_tokenizer(vocab_size: int, out: str | Path, eos_token_id: int, seed: int = 0) -> Path:
    """A word-level tokenizer (xgrammar reads its strings raw) of `vocab_size` tokens: the printable ASCII
    characters, then distinct random strings of 2 to 8 letters, digits, spaces and `.-_:,`. No long token holds
    a quote, brace or bracket, so inside SCHEMA's open string only the one-character `"` token (one in
    `vocab_size`) can end it: the constrained rows stay in the string, and constrained, while they are timed."""
    from tokenizers import Tokenizer, models

    rng = random.Random(seed)
    alphabet = string.ascii_letters + string.digits + " .-_:,"
    vocab = {c: i for i, c in enumerate(string.printable)}
    while len(vocab) < vocab_size:
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
        vocab.setdefault(word, len(vocab))
    names = {i: w for w, i in vocab.items()}
    names[eos_token_id] = "</s>"
    vocab = {w: i for i, w in names.items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    Tokenizer(models.WordLevel(vocab=vocab, unk_token=names[0])).save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": names[0]}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def build_engine(model: str, tokenizer: str, max_seqs: int, async_scheduling: bool = True,
                 device: str = "cuda", dtype: str = "bfloat16", kv_bytes: int = 6 << 30) -> Engine:
    return Engine(WorkerConfig(
        ModelConfig(model, dtype=dtype, load_format="dummy", max_model_len=4096, tokenizer=tokenizer),
        cache=CacheConfig(kv_cache_memory_bytes=kv_bytes), lora=LoRAConfig(max_loras=1, max_lora_rank=16),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=4096),
        device=device, async_scheduling=async_scheduling))


def start_requests(engine: Engine, batch: int, num_constrained: int, prompt_len: int = PROMPT_LEN) -> list[str]:
    """`batch` requests, the first `num_constrained` constrained by SCHEMA; steps until each has a token, then 5
    decode steps. None may finish before it is aborted (ignore_eos, max_tokens to the context's end)."""
    max_tokens = engine.max_model_len - prompt_len
    free = SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True,
                                 structured=StructuredOutput("json", json.dumps(SCHEMA)))
    request_ids = [f"r{i}" for i in range(batch)]
    for i, request_id in enumerate(request_ids):
        engine.add_request(request_id, list(range(100 + i, 100 + i + prompt_len)),
                           constrained if i < num_constrained else free)
    started: set[str] = set()
    while len(started) < batch:
        for out in engine.step():
            if out.finished:
                raise RuntimeError(f"request {out.request_id} ended while starting: {out.finish_reason} {out.error}")
            started.add(out.request_id)
    for _ in range(5):
        engine.step()
    return request_ids


def time_steps(engine: Engine, batch: int, num_constrained: int, steps: int) -> dict:
    request_ids = start_requests(engine, batch, num_constrained)
    wall = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - t0)
    assert engine.num_running == batch, "a request stopped before the timing ended"
    for request_id in request_ids:
        engine.abort_request(request_id)
    return {"batch": batch, "constrained": num_constrained, "step_ms_median": 1e3 * statistics.median(wall),
            "step_ms_mean": 1e3 * statistics.fmean(wall)}


def ratios(runs: dict) -> dict:
    """Per batch: the quarter-constrained step over the unconstrained one, and sync over async."""
    out = {}
    for name, run in runs.items():
        base = runs.get(f"free_b{run['batch']}")
        if base is not None and name != f"free_b{run['batch']}":
            out[f"{name}_over_free"] = run["step_ms_median"] / base["step_ms_median"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="bench/configs/llama-3.1-8b")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    arch = ArchConfig.from_dir(args.model)
    results: dict = {"device": torch.cuda.get_device_name(), "schema": SCHEMA, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = str(make_grammar_tokenizer(arch.vocab_size, Path(tmp) / "tokenizer", arch.eos_token_ids[0]))
        for async_scheduling in (True, False):
            engine = build_engine(args.model, tokenizer, max(args.batches), async_scheduling)
            for batch in args.batches:
                kinds = {"free": 0, "quarter": batch // 4} if async_scheduling else {"sync": 0}
                for kind, num_constrained in kinds.items():
                    run = time_steps(engine, batch, num_constrained, args.steps)
                    results["runs"][f"{kind}_b{batch}"] = run
                    logger.info("%s b%d: %s", kind, batch, run)
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    results["ratios"] = ratios(results["runs"])
    print(json.dumps(results, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
