"""The peers' published workloads as named presets, with the server flags each one assumes.

Adapters are named `lora-0` .. `lora-(N-1)`, as `python -m bench.make_adapters --num N` writes them.
Lengths are inclusive ranges. SGLang's `--dataset-name random` with its default range ratio 0 draws
lengths uniformly in [1, L], so its "random L/L" runs are written as (1, L) here.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from bench.workloads import Workload, adapter_names


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    workload: Workload
    server_args: str                    # loraplex/vLLM flags it assumes, besides the model and adapters
    adapter_rank: int = 16
    adapter_targets: str | None = None  # comma-separated; None: make_adapters' default, all seven projections

    def make_adapters_args(self) -> str:
        """The bench.make_adapters flags that write this preset's adapters (add --config and --out)."""
        targets = f" --targets {self.adapter_targets}" if self.adapter_targets else ""
        return f"--num {len(self.workload.adapters)} --rank {self.adapter_rank}{targets}"


def _slora(num_adapters: int) -> Preset:
    return Preset(
        f"slora-{num_adapters}",
        f"S-LoRA's scaling run: {num_adapters} adapters, power-law popularity alpha=1, Poisson arrivals at "
        "2 req/s for 5 minutes, input and output lengths uniform in [8, 512].",
        Workload(num_prompts=600, input_len=(8, 512), output_len=(8, 512), adapters=adapter_names("lora", num_adapters),
                 adapter_choice="zipf", zipf_alpha=1.0, request_rate=2.0, arrival="poisson"),
        server_args=f"--max-loras 32 --max-cpu-loras {max(num_adapters, 32)}", adapter_rank=8,
        adapter_targets="q_proj,k_proj,v_proj,o_proj")


def _chat(shared: bool) -> Preset:
    """Prefix caching, 32 adapters chosen uniformly; each preset run as is and with --no-enable-prefix-caching.
    Shared: each adapter's requests begin with its own 1,000-token system prompt, then a unique user turn;
    Poisson arrivals, for TTFT. Not shared: prompts as long with nothing in common, sent 64 at a time so the
    server is saturated and its throughput shows what prefix caching costs when it never hits."""
    workload = Workload(num_prompts=640, input_len=(32, 256), output_len=(64, 256), adapters=adapter_names("lora", 32),
                        adapter_choice="uniform", request_rate=8.0, arrival="poisson", shared_prefix_len=1000)
    if shared:
        return Preset("chat-shared-prefix",
                      "Chat traffic with a shared system prompt per adapter: 32 adapters chosen uniformly, 640 "
                      "requests, Poisson at 8 req/s, each prompt its adapter's 1,000-token system prompt and a unique "
                      "32-256 token user turn, output 64-256; compare TTFT with --no-enable-prefix-caching.",
                      workload, server_args="--max-loras 32 --max-cpu-loras 32 --enable-prompt-tokens-details")
    return Preset("chat-no-shared-prefix",
                  "The overhead check of prefix caching: chat-shared-prefix's lengths with no prefix in common "
                  "(1,032-1,256 unique tokens per prompt), 64 requests in flight; compare throughput with "
                  "--no-enable-prefix-caching.",
                  dataclasses.replace(workload, input_len=(1032, 1256), shared_prefix_len=0, request_rate=math.inf,
                                      max_concurrency=64),
                  server_args="--max-loras 32 --max-cpu-loras 32")


PRESETS: dict[str, Preset] = {p.name: p for p in [
    Preset(
        "sglang-single-adapter",
        "SGLang's LoRA online-latency run: 480 prompts, Poisson at 8 req/s, random 256/256, every request on "
        "the same adapter (its server allows one adapter per batch).",
        Workload(num_prompts=480, input_len=(1, 256), output_len=(1, 256), adapters=adapter_names("lora", 1),
                 adapter_choice="identical", request_rate=8.0, arrival="poisson"),
        server_args="--max-loras 1", adapter_rank=4),
    Preset(
        "sglang-multi-adapter",
        "SGLang's multi-adapter run: 200 prompts, Poisson at 4 req/s, random 512/512, 6 adapters chosen "
        "uniformly. Its '3 per batch' is the server's --max-loras-per-batch 3, the size of the GPU adapter "
        "pool; loraplex and vLLM spell that limit --max-loras 3.",
        Workload(num_prompts=200, input_len=(1, 512), output_len=(1, 512), adapters=adapter_names("lora", 6),
                 adapter_choice="uniform", request_rate=4.0, arrival="poisson"),
        server_args="--max-loras 3"),
    Preset(
        "overlap-loading",
        "Adapter-loading stress: 16 adapters over 8 GPU slots, each request on the next adapter in turn, 16 "
        "requests in flight, fixed 512 in / 128 out, so every batch needs adapters that are not resident.",
        Workload(num_prompts=256, input_len=(512, 512), output_len=(128, 128), adapters=adapter_names("lora", 16),
                 adapter_choice="distinct", max_concurrency=16),
        server_args="--max-loras 8 --max-cpu-loras 16"),
    _slora(5),
    _slora(8),
    _slora(100),
    _slora(1000),
    _chat(shared=True),
    _chat(shared=False),
    Preset(
        "moe-expert-adapters",
        "Mixture-of-experts serving with expert LoRA: 16 rank-16 adapters on attention and every expert over 8 "
        "GPU slots, chosen uniformly, Poisson arrivals at 4 req/s, random 256/128.",
        Workload(num_prompts=160, input_len=(1, 256), output_len=(1, 128), adapters=adapter_names("lora", 16),
                 adapter_choice="uniform", request_rate=4.0, arrival="poisson"),
        server_args="--max-loras 8 --max-cpu-loras 16", adapter_targets="q_proj,k_proj,v_proj,o_proj,experts"),
]}
