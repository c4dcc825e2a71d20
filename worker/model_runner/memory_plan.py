"""MemoryPlan: where one worker's device memory goes, decided before the KV pool is allocated.

The worker may use `--gpu-memory-utilization` of the device's memory, counted from what this process
takes (other processes on the GPU are not charged to it, so two servers at 0.4 each both start). Before
the KV pool is sized, the runner measures what everything else needs:

    budget = total * gpu_memory_utilization
           = weights + LoRA slots + MoE buffers          (allocated: their exact bytes)
           + activations                                  (peak of a profiling step at the largest step the
                                                           flags allow, LoRA on, prompt logprobs included)
           + CUDA graphs                                  (peak of a step at the largest graph's shape: the
                                                           graphs' private pool holds that much beside the
                                                           eager pool, plus a fixed allowance per graph)
           + outside torch                                (CUDA context growth, cuBLAS workspaces)
           + KV cache                                     (what is left)

Flags that leave no room for one max-length sequence fail here, naming the flags to change.

The host cache is planned beside it, in lora/host_cache_plan.py.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass


logger = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20
# device memory each captured graph holds in the graphs' pool beyond the largest graph's working set (what
# its side-stream allocations keep, the executable graph): measured on an H200 with the 8B shape at about
# 12 MiB a graph (BENCHMARKS.md, "Memory plan"), rounded up
GRAPH_ALLOWANCE_BYTES = 16 << 20
# memory outside torch's allocator that this process may take after its start (cuBLAS and Triton modules,
# graph executables): ~0.2 GiB measured on an H100/H200. The device's free memory is shared with other
# processes, so a larger drop during startup is taken to be another process starting beside this one
NON_TORCH_CAP_BYTES = 1 << 30


class MemoryPlanError(ValueError):
    """The flags cannot fit the device's memory; the message names what to change."""


@dataclass(frozen=True)
class MemoryPlan:
    total: int            # the device's memory
    budget: int           # total * gpu_memory_utilization
    weights: int
    lora_slots: int
    moe_buffers: int
    activations: int
    graphs: int
    non_torch: int
    kv: int               # bytes the KV pool may take

    @property
    def used(self) -> int:
        return (self.weights + self.lora_slots + self.moe_buffers + self.activations + self.graphs
                + self.non_torch + self.kv)

    def summary(self) -> str:
        parts = [("weights", self.weights), ("LoRA slots", self.lora_slots), ("MoE buffers", self.moe_buffers),
                 ("activations", self.activations), ("CUDA graphs", self.graphs), ("outside torch", self.non_torch),
                 ("KV cache", self.kv)]
        return (f"memory plan: {self.budget / GiB:.2f} GiB of {self.total / GiB:.2f} GiB = "
                + " + ".join(f"{name} {size / GiB:.2f}" for name, size in parts) + " GiB")


@dataclass(frozen=True)
class MemoryLimits:
    """What the flags allow; named in the error when they cannot fit."""
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_loras: int


def plan_memory(*, total: int, free_at_start: int, free_now: int, torch_reserved: int, weights: int,
                lora_slots: int, moe_buffers: int, activations: int, graphs: int, kv_bytes_per_token: int,
                limits: MemoryLimits) -> MemoryPlan:
    """The plan, from measurements taken after the model, slots and buffers exist and the profiling steps
    ran (with the allocator's cache emptied): `free_at_start` / `free_now` the device's free bytes before the
    model and now, `torch_reserved` what torch's allocator holds now. The free memory's drop beyond torch's
    allocator is the memory outside torch, up to NON_TORCH_CAP_BYTES (beyond it, another process).

    Raises MemoryPlanError when the KV pool could not hold one max_model_len sequence, either within the
    budget or within what the device has free (another process may hold memory)."""
    budget = int(total * limits.gpu_memory_utilization)
    non_torch = min(max(0, free_at_start - free_now - torch_reserved), NON_TORCH_CAP_BYTES)
    kv = budget - torch_reserved - non_torch - activations - graphs
    kv = min(kv, free_now - activations - graphs)    # what the device can actually give
    need = kv_bytes_per_token * limits.max_model_len
    plan = MemoryPlan(total, budget, weights, lora_slots, moe_buffers, activations, graphs, non_torch, max(kv, 0))
    if kv < need:
        raise MemoryPlanError(
            f"The KV cache cannot hold one sequence of --max-model-len {limits.max_model_len} "
            f"({need / GiB:.2f} GiB needed, {max(kv, 0) / GiB:.2f} GiB left; {plan.summary()}). "
            f"Raise --gpu-memory-utilization (now {limits.gpu_memory_utilization}) if the device has room, or "
            f"lower --max-model-len, --max-num-batched-tokens ({limits.max_num_batched_tokens}, sizes the "
            f"activations), --max-num-seqs ({limits.max_num_seqs}, sizes the CUDA graphs) or --max-loras "
            f"({limits.max_loras}, sizes the LoRA slots).")
    return plan
