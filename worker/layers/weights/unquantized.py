"""Unquantized weights: the checkpoint's tensors in the compute dtype (bf16, fp16, fp32), multiplied as they are."""
from __future__ import annotations

import torch
from torch import nn

from worker.kernels import ops
from worker.layers.weights.scheme import ExpertMatrices, ExpertsScheme, LinearScheme


class UnquantizedLinear(LinearScheme):
    """`weight` [out_features, in_features]."""

    def create_weights(self, layer, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.slice_offsets[-1], layer.in_features, dtype=dtype),
                                    requires_grad=False)

    def checkpoint_tensors(self) -> tuple[str, ...]:
        return ("weight",)

    def full_shape(self, layer, name: str) -> tuple[int, ...]:
        return layer.full_rows(), layer.full_in_features()

    def load(self, layer, name: str, shard: int | None, tensor: torch.Tensor) -> None:
        layer.copy_share(layer.weight, tensor, shard, columns=True)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None, beside_lora: bool = False) -> torch.Tensor:
        return ops.linear(x, layer.weight, bias, layer.kernels, beside_lora)


class UnquantizedExperts(ExpertsScheme):
    """`gate_up_proj` [E, 2I, H] (gate rows first) and `down_proj` [E, H, I], as transformers 5 holds them."""

    def create_weights(self, experts, dtype: torch.dtype) -> None:
        e, h, i = experts.num_experts, experts.hidden_size, experts.intermediate_shard[1]
        experts.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
        experts.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)

    def checkpoint_tensors(self) -> tuple[str, ...]:
        return ("gate_up_proj", "down_proj")

    def full_shape(self, experts, name: str) -> tuple[int, ...]:
        e, h, i = experts.num_experts, experts.hidden_size, experts.full_intermediate_size
        return (e, 2 * i, h) if name == "gate_up_proj" else (e, h, i)

    def load(self, experts, name: str, tensor: torch.Tensor) -> None:
        target = getattr(experts, name)
        if name == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)                                 # [E, I, H] each
            i = target.shape[1] // 2
            target[:, :i].copy_(gate.narrow(1, *experts.intermediate_shard))
            target[:, i:].copy_(up.narrow(1, *experts.intermediate_shard))
        else:
            target.copy_(tensor.narrow(2, *experts.intermediate_shard))

    def load_expert(self, experts, expert: int, part: str, tensor: torch.Tensor, tensor_name: str = "weight") -> None:
        if tensor_name != "weight":
            raise ValueError(f"unquantized experts take no checkpoint tensor {tensor_name!r}")
        i = experts.intermediate_shard[1]
        target = {"gate": experts.gate_up_proj[expert, :i], "up": experts.gate_up_proj[expert, i:],
                  "down": experts.down_proj[expert]}[part]
        target.copy_(tensor.narrow(1 if part == "down" else 0, *experts.intermediate_shard))

    def matrices(self, experts) -> ExpertMatrices:
        return ExpertMatrices(experts.gate_up_proj, experts.down_proj)
