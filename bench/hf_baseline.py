"""The HF transformers + PEFT baseline: bench.serve's workload as offline batches of mixed adapters.

    python -m bench.hf_baseline --model bench/configs/llama-3.1-8b --load-format dummy \\
        --lora-dir /tmp/adapters --preset sglang-multi-adapter --batch-size 8

Requests are taken in order, `--batch-size` at a time; each batch is one
`model.generate(..., adapter_names=[...])` call (PEFT's mixed-adapter batch, "__base__" for the base
model), greedy, left-padded, running to the longest max_tokens of the batch. This is the baseline
S-LoRA and Punica compare against. Arrival times are ignored: every request is there at the start.

Records have bench.serve's fields, timed per decode step as if the batch streamed: a request is sent
when its batch starts, its first token comes at the batch's first step, its ITLs are the step gaps up
to its own max_tokens, and its E2E latency ends at its own last token. generate returns whole
batches, so the summary adds batch latency statistics (`mean_batch_latency_ms`, ...), the tokens the
batches generated (rows past their own max_tokens included), and the peak GPU memory.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

from bench.report import RequestRecord, format_summary, stats_ms, summarize, write_result
from bench.serve import add_workload_arguments, workload_from_args
from bench.workloads import RequestSpec

logger = logging.getLogger("bench.hf_baseline")
BASE_ADAPTER = "__base__"       # PEFT's name for "no adapter" in adapter_names
IGNORED_WORKLOAD_FIELDS = ("request_rate", "arrival", "max_concurrency")   # every request is there at the start
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class StepClock(StoppingCriteria):
    """Records when each decode step's tokens are ready; never stops generation."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def load_model(model_dir: str, load_format: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The base model; `dummy`: random weights from config.json, built on the meta device first."""
    if load_format == "dummy":
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.to_empty(device=device)
        model.init_weights()        # random weights, and the rotary buffers to_empty left unset
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    return model.eval()


def attach_adapters(model: torch.nn.Module, adapters: dict[str, str]) -> torch.nn.Module:
    """A PeftModel holding every adapter under its name, in the base model's dtype."""
    from peft import PeftModel

    (first, first_path), *rest = adapters.items()
    model = PeftModel.from_pretrained(model, first_path, adapter_name=first, autocast_adapter_dtype=False,
                                      low_cpu_mem_usage=True)
    for name, path in rest:
        model.load_adapter(path, adapter_name=name, autocast_adapter_dtype=False, low_cpu_mem_usage=True)
    return model.eval()


@torch.inference_mode()
def generate_batch(model: torch.nn.Module, prompts: list[list[int]], adapters: list[str | None],
                   max_new_tokens: int, pad_id: int) -> tuple[torch.Tensor, float, list[float], float]:
    """One mixed-adapter batch: (new tokens [batch, max_new_tokens], start, step times, end)."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)     # [batch, width], left-padded
    attention_mask = torch.zeros_like(input_ids)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention_mask[row, width - len(prompt):] = 1
    clock = StepClock(device)
    extra = {"adapter_names": [a or BASE_ADAPTER for a in adapters]} if hasattr(model, "peft_config") else {}
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=pad_id, stopping_criteria=StoppingCriteriaList([clock]), **extra)
    new_tokens = out[:, width:].cpu()
    return new_tokens, start, clock.times, time.perf_counter()


def batch_records(specs: list[RequestSpec], start: float, steps: list[float],
                  run_start: float) -> list[RequestRecord]:
    """bench.serve's records for the requests of one batch, from its step times."""
    records = []
    for spec in specs:
        own = steps[:spec.output_len]
        records.append(RequestRecord(
            spec.adapter, spec.output_len, spec.prompt_len, send_time=start - run_start, ttft=own[0] - start,
            itls=[b - a for a, b in zip(own, own[1:])], e2el=own[-1] - start, output_tokens=spec.output_len))
    return records


def run(model: torch.nn.Module, specs: list[RequestSpec], batch_size: int,
        pad_id: int) -> tuple[list[RequestRecord], float, list[float], int]:
    """All batches back to back: (records, duration, batch latencies, tokens generated by all rows)."""
    records, latencies, generated = [], [], 0
    run_start = time.perf_counter()
    for first in range(0, len(specs), batch_size):
        batch = specs[first:first + batch_size]
        longest = max(s.output_len for s in batch)
        tokens, start, steps, end = generate_batch(model, [s.prompt for s in batch], [s.adapter for s in batch],
                                                   longest, pad_id)
        if tokens.shape[1] != longest or len(steps) != longest:
            raise RuntimeError(f"generate made {tokens.shape[1]} tokens in {len(steps)} steps, not {longest}")
        generated += tokens.numel()
        latencies.append(end - start)
        records += batch_records(batch, start, steps, run_start)
        logger.info("batch %d/%d: %d requests, %d steps, %.2f s", first // batch_size + 1,
                    math.ceil(len(specs) / batch_size), len(batch), longest, end - start)
    return records, time.perf_counter() - run_start, latencies, generated


def tokenized(specs: list[RequestSpec], model_dir: str) -> list[RequestSpec]:
    """Text prompts (from a JSONL file) turned into token ids with the model directory's tokenizer."""
    if all(not isinstance(s.prompt, str) for s in specs):
        return specs
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for s in specs:
        ids = tokenizer.encode(s.prompt) if isinstance(s.prompt, str) else s.prompt
        out.append(RequestSpec(ids, len(ids), s.output_len, s.adapter))
    return out


def adapter_paths(names: set[str], modules: list[str] | None, lora_dir: str | None) -> dict[str, str]:
    """name -> PEFT directory for every adapter the workload uses: --lora-paths first, then --lora-dir."""
    given = dict(module.split("=", 1) for module in modules or [])
    paths = {name: given.get(name) or (str(Path(lora_dir) / name) if lora_dir else None) for name in sorted(names)}
    missing = [name for name, path in paths.items() if path is None]
    if missing:
        raise SystemExit(f"no path for adapters {missing}: pass --lora-paths NAME=PATH or --lora-dir DIR")
    return paths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench.hf_baseline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", required=True, help="model directory (config.json only, with --load-format dummy)")
    add("--load-format", choices=("auto", "dummy"), default="auto", help="dummy: random weights")
    add("--lora-dir", help="adapters of the workload are read from DIR/<name>")
    add("--lora-paths", nargs="+", metavar="NAME=PATH", help="adapter directories by name")
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on cuda, float32 on cpu")
    add("--batch-size", type=int, default=8)
    add("--pad-token-id", type=int, default=0)
    add_workload_arguments(parser)
    add("--seed", type=int, default=0)
    add("--no-warmup", action="store_true", help="skip the untimed two-token first batch")
    add("--out", help="result JSON path (default: bench-hf-<preset>-<time>.json); plots go beside it")
    add("--no-plots", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    workload = workload_from_args(args)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    specs = tokenized(workload.requests(args.seed), args.model)
    model = load_model(args.model, args.load_format, dtype, device)
    names = {s.adapter for s in specs if s.adapter is not None}
    if names:
        model = attach_adapters(model, adapter_paths(names, args.lora_paths, args.lora_dir))
    if not args.no_warmup:
        first = specs[:args.batch_size]
        generate_batch(model, [s.prompt for s in first], [s.adapter for s in first], 2, args.pad_token_id)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    records, duration, latencies, generated = run(model, specs, args.batch_size, args.pad_token_id)
    summary = summarize(records, duration)
    summary.update(stats_ms(latencies, "batch_latency"), batch_size=args.batch_size, num_batches=len(latencies),
                   total_generated_tokens=generated,
                   peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None)
    logger.info("\n%s", format_summary(summary, f"HF + PEFT baseline: {args.preset or 'custom'}"))
    settings = {"backend": "hf-peft", "preset": args.preset, "model": args.model, "load_format": args.load_format,
                "device": str(device), "dtype": str(dtype).removeprefix("torch."), "seed": args.seed,
                **{k: v for k, v in dataclasses.asdict(workload).items() if k not in IGNORED_WORKLOAD_FIELDS}}
    return write_result(records, summary, settings, args.out, f"bench-hf-{args.preset or 'custom'}",
                        not args.no_plots)


if __name__ == "__main__":
    main()
