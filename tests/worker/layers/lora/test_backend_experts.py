"""The two LoRA backends' `experts` on one sparse MoE block, on the CPU: TritonLoRA's (fused_moe with a MoELoRAStep,
run by the Triton interpreter once the block holds the runner's workspaces) against ReferenceLoRA's
(reference.moe_lora_experts), for token mixes of adapters, a shared-outer slot, zero scalings and base-only tokens,
on the per-token (1-2 tokens) and the sorted path; and a block without its workspaces falls back to the reference.

Tolerance: the kernel tests' (tests/worker/kernels/test_moe_lora_kernels.py): one rounding into the output dtype,
relative to the largest output (fp32: 1e-5, float32 sums of at most H + I + 2R products in another order).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from tests.worker.kernels.test_moe_lora_kernels import _assert_close, _cpu_shape, _fused_moe_case  # noqa: E402
from worker.batch import LoRABatchInfo  # noqa: E402
from worker.kernels.choices import KernelChoices  # noqa: E402
from worker.layers.lora.reference_backend import ReferenceLoRA  # noqa: E402
from worker.layers.lora.triton_backend import TritonLoRA  # noqa: E402
from worker.layers.sparse_moe import SparseMoE  # noqa: E402

MIXES = {"T1-adapter": [0], "T2-base-and-shared-outer": [-1, 2], "T5-mixed": [3, 1, -1, 2, 0],
         "T6-one-adapter-and-base": [1, 1, -1, 1, -1, 1]}


def block_and_step(slots: list[int], float32_weights: bool):
    """A SparseMoE block holding the case's experts and slot pool, and the step's (x, logits, LoRABatchInfo)."""
    gen = torch.Generator().manual_seed(len(slots))
    shape = _cpu_shape(16)
    x, logits, gate_up, down, w, ranks, ws, lora_ws = _fused_moe_case(shape, slots, torch.float32, gen)
    block = SparseMoE(shape.hidden, shape.experts, shape.top_k, shape.inter, True, float32_weights, torch.float32,
                      dataclasses.replace(KernelChoices(), lora=TritonLoRA()))
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
    block.lora = w
    block.attach_workspaces(ws, lora_ws)
    used = [int(ranks[s]) for s in slots if s >= 0]
    info = LoRABatchInfo(num_segments=0, seg_indptr=torch.zeros(1, dtype=torch.int32),
                         seg_lora_slots=torch.zeros(0, dtype=torch.int32), ranks=ranks, max_rank=max(used, default=0),
                         token_lora_slots=torch.tensor(slots, dtype=torch.int32), ranks_host=ranks.tolist(),
                         token_lora_slots_host=list(slots))
    return block, x, logits, info


@pytest.mark.parametrize("float32_weights", [False, True], ids=["qwen", "mixtral"])
@pytest.mark.parametrize("slots", MIXES.values(), ids=MIXES.keys())
def test_triton_experts_equal_the_reference_backends(slots, float32_weights):
    block, x, logits, info = block_and_step(slots, float32_weights)
    expected = ReferenceLoRA().experts(block, x, logits, info)
    _assert_close(TritonLoRA().experts(block, x, logits, info), expected.float(), torch.float32)


def test_a_block_without_the_runners_workspaces_runs_the_reference():
    block, x, logits, info = block_and_step(MIXES["T5-mixed"], False)
    expected = ReferenceLoRA().experts(block, x, logits, info)
    block.attach_workspaces(None, None)
    assert torch.equal(TritonLoRA().experts(block, x, logits, info), expected)
