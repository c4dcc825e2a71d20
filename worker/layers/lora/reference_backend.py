"""The torch reference LoRA backend (the CPU's): base projection, then kernels/reference.py's shrink and expand
looping over the step's segments on the host; expert LoRA by reference.moe_lora_experts."""
from __future__ import annotations

import torch

from worker.batch import LoRABatchInfo
from worker.kernels import ops, reference
from worker.kernels.reference import MoELoRASlots
from worker.layers.lora.backend import LoRABackend, register


@register
class ReferenceLoRA(LoRABackend):
    name = "reference"
    device_type = "cpu"

    def linear(self, layer, x: torch.Tensor, info: LoRABatchInfo, bias: torch.Tensor | None) -> torch.Tensor:
        y = layer.base(x, bias)
        w = layer.lora
        xa = reference.lora_shrink(x, w.a, info.seg_indptr_host, info.seg_lora_slots_host, info.ranks_host,
                                   w.num_slices)
        reference.lora_expand(layer.lora_rows(y), layer.whole_xa(xa), w.b, info.seg_indptr_host,
                              info.seg_lora_slots_host, info.ranks_host, w.scalings, w.slice_offsets)
        return y

    def experts(self, block, x: torch.Tensor, logits: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
        weights, ids = ops.host_routing(x, logits, block.top_k, block.renormalize, block.float32_weights)
        m = block.experts.matrices()
        gate_up, down = m.gate_up, m.down
        if m.quantized:
            gate_up = reference.fp8_dequantize(gate_up, m.gate_up_scale, m.block).to(x.dtype)
            down = reference.fp8_dequantize(down, m.down_scale, m.block).to(x.dtype)
        return reference.moe_lora_experts(x, gate_up, down, weights, ids, info.token_lora_slots_host,
                                          expert_slots(block, info))


def expert_slots(block, info: LoRABatchInfo) -> MoELoRASlots:
    """The reference's view of block.lora: each projection at its slot's rank (its largest over the adapter's
    modules; zero padding past a projection's own rank adds nothing), 0 where the scaling is 0."""
    w, max_rank = block.lora, block.lora.down_a.shape[2]
    scalings = w.scalings.tolist()                                          # [S][3]
    ranks = [[min(rank, max_rank) if scale else 0 for scale in scalings[s]]
             for s, rank in enumerate(info.ranks_host)]
    return MoELoRASlots(w.gate_up_a, w.gate_up_b, w.down_a, w.down_b, ranks, w.scalings,
                        [bool(flag) for flag in w.shared_outer.tolist()])
