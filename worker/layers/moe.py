"""The sparse mixture-of-experts block: a router, fused experts, and Qwen2-MoE's optional shared expert.

Experts are stored as transformers 5 holds them in memory: `gate_up_proj [E, 2I, H]` (gate rows first) and
`down_proj [E, H, I]`. Routing and the expert sum run through kernels/reference.py on every device for now
(the Triton MoE kernels come next), so MoE models run eagerly on the GPU (model_runner/runner.py).
"""
from __future__ import annotations

import torch
from torch import nn

from worker.batch import ForwardBatch
from worker.kernels.reference import moe_experts, moe_route
from worker.layers.kernel_choices import KernelChoices
from worker.layers.linear import Linear


class FusedExperts(nn.Module):
    """Every expert's gate/up and down weights in two parameters."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)         # [E, H, I]

    def load_expert(self, param: str, expert: int, part: str, tensor: torch.Tensor) -> None:
        """One expert's checkpoint matrix into place; part: "gate" [I, H], "up" [I, H] or "down" [H, I]."""
        i = self.down_proj.shape[2]
        target = {"gate": self.gate_up_proj[expert, :i], "up": self.gate_up_proj[expert, i:],
                  "down": self.down_proj[expert]}[part]
        if target.shape != tensor.shape:
            raise ValueError(f"{param} expert {expert} {part}: checkpoint shape {tuple(tensor.shape)} != "
                             f"model shape {tuple(target.shape)}")
        target.copy_(tensor)


class SparseMoE(nn.Module):
    """y = sum over the top-k experts of weight * expert(x), plus sigmoid(shared_expert_gate(x)) *
    shared_expert(x) when there is a shared expert.

    `renormalize`: divide the top-k weights by their sum (Mixtral always; Qwen when norm_topk_prob).
    `float32_weights`: multiply by the float32 routing weights (Mixtral) instead of casting them to the
    hidden dtype first (Qwen), as Hugging Face does for each family. `shared_expert`: a module called as
    `shared_expert(x, batch) -> (y, deferred LoRA delta or None)`.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 float32_weights: bool, dtype: torch.dtype, kernels: KernelChoices,
                 shared_expert: nn.Module | None = None):
        super().__init__()
        self.top_k, self.renormalize, self.float32_weights = top_k, renormalize, float32_weights
        self.gate = Linear(hidden_size, [num_experts], False, dtype, kernels)      # the router; never LoRA
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, dtype)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (Linear(hidden_size, [1], False, dtype, kernels)
                                   if shared_expert is not None else None)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, None]:
        """x: [num_tokens, hidden] -> (the block's output [num_tokens, hidden], None: no deferred delta)."""
        logits = self.gate(x)                                                   # [num_tokens, num_experts]
        weights, ids = moe_route(logits, self.top_k, self.renormalize)          # [num_tokens, top_k] each
        if not self.float32_weights:
            weights = weights.to(x.dtype)
        out = moe_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        if self.shared_expert is not None:
            shared, delta = self.shared_expert(x, batch)                        # [num_tokens, hidden]
            if delta is not None:
                shared = (shared.float() + delta).to(shared.dtype)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out, None
