"""The batch limits a server gets when --max-num-seqs or --max-num-batched-tokens is not given: vLLM's, for the
device at hand.

vLLM 0.33.0 (vllm/engine/arg_utils.py, EngineArgs.get_batch_defaults and
_set_default_max_num_seqs_and_batched_tokens_args), for its OpenAI server:

    device                                              max_num_seqs      max_num_batched_tokens
    GPU with >= 160 GiB (B200, B300)                    1024              16384
    GPU with >= 70 GiB, not an A100, not a GB10 (12.1)  1024              8192      (H100, H200)
    any other GPU                                       256               2048
    CPU                                                 128 * world       2048 * world   (world: the ranks)

then a defaulted token budget is capped at max_num_seqs * max_model_len, and a defaulted max_num_seqs at the token
budget (so `--max-num-batched-tokens 64` alone allows 64 sequences at most). The memory plan sizes activations and
CUDA graphs for these limits, and fails as vLLM's KV check does when the KV cache cannot hold one max_model_len
sequence (model_runner/memory_plan.py); the scheduler preempts when the running sequences outgrow the KV cache.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from worker.config import SchedulerConfig

GiB = 1 << 30


@dataclass(frozen=True)
class DeviceFacts:
    """What vLLM's defaults depend on."""
    kind: str                            # "cuda" | "cpu"
    total_memory: int = 0                # bytes (a GPU's)
    name: str = ""                       # torch.cuda.get_device_name
    capability: tuple[int, int] = (0, 0)

    @classmethod
    def of(cls, device) -> DeviceFacts:
        """The facts of a torch.device."""
        if device.type != "cuda":
            return cls(device.type)
        import torch
        properties = torch.cuda.get_device_properties(device)
        return cls("cuda", properties.total_memory, properties.name, (properties.major, properties.minor))


def batch_defaults(device: DeviceFacts, world_size: int) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) as vLLM's OpenAI server defaults them on `device`."""
    if device.kind == "cpu":
        return 128 * world_size, 2048 * world_size
    if device.total_memory >= 160 * GiB:
        return 1024, 16384
    if device.total_memory >= 70 * GiB and "a100" not in device.name.lower() and device.capability != (12, 1):
        return 1024, 8192
    return 256, 2048


def resolve_batch_limits(config: SchedulerConfig, device: DeviceFacts, world_size: int,
                         max_model_len: int) -> SchedulerConfig:
    """`config` with each limit left unset given vLLM's default, capped as vLLM caps it: a defaulted token budget at
    max_num_seqs * max_model_len, then a defaulted max_num_seqs at the token budget."""
    seqs, tokens = batch_defaults(device, world_size)
    max_num_seqs = config.max_num_seqs if config.max_num_seqs is not None else seqs
    if config.max_num_batched_tokens is None:
        tokens = min(tokens, max_num_seqs * max_model_len)
    else:
        tokens = config.max_num_batched_tokens
    if config.max_num_seqs is None:
        max_num_seqs = min(max_num_seqs, tokens)
    if tokens < max_num_seqs:
        raise ValueError(f"max_num_batched_tokens ({tokens}) must be greater than or equal to max_num_seqs "
                         f"({max_num_seqs}).")
    return dataclasses.replace(config, max_num_seqs=max_num_seqs, max_num_batched_tokens=tokens)
