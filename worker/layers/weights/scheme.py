"""How a projection holds its base weight: a weight scheme (unquantized today; FP8 per-channel and block-wise
next). The layer keeps the shapes and the tensor-parallel geometry (which rows or columns of the checkpoint's
tensor this rank holds); the scheme says which checkpoint tensors it takes, creates their parameters, copies this
rank's share of each into place, and multiplies. The weight loader and `--load-format dummy` go through it, so a
checkpoint tensor the scheme names (`weight_scale`, ...) has a place, and one it does not name is refused.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from worker.layers.linear import Linear
    from worker.layers.sparse_moe import FusedExperts


@dataclass(frozen=True)
class ExpertMatrices:
    """Every expert's base weights as the expert kernels read them: in the compute dtype (scales None), or in
    float8_e4m3fn with float32 scales that multiply, per output row ([E, rows]) or per (block_n x block_k) block
    ([E, ceil(rows / block_n), ceil(cols / block_k)]) when `block` is set."""
    gate_up: torch.Tensor                         # [E, 2I, H]: gate rows, then up rows
    down: torch.Tensor                            # [E, H, I]
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    block: tuple[int, int] | None = None          # (block_n, block_k) of block-wise scales; None: per output row

    @property
    def quantized(self) -> bool:
        return self.gate_up_scale is not None


class LinearScheme(ABC):
    """The base weight of a `Linear` (layers/linear.py): y = x @ W^T (+ bias), W as the scheme holds it."""

    @abstractmethod
    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        """Register the parameters of this rank's share on `layer` (its `slice_offsets[-1]` output rows and
        `in_features` columns)."""

    @abstractmethod
    def checkpoint_tensors(self) -> tuple[str, ...]:
        """The names of the checkpoint tensors a projection takes, besides its bias: ("weight",), ..."""

    @abstractmethod
    def full_shape(self, layer: Linear, name: str) -> tuple[int, ...]:
        """The shape of the whole checkpoint tensor `name` of which `layer` holds a share."""

    @abstractmethod
    def load(self, layer: Linear, name: str, shard: int | None, tensor: torch.Tensor) -> None:
        """Copy this rank's share of the checkpoint tensor `name` (of fused slice `shard`; None: every slice, or an
        unfused projection) into place."""

    def finish(self, layer: Linear) -> None:
        """After every checkpoint tensor is loaded (or drawn by --load-format dummy): settle the weight into the
        form it multiplies in. Nothing to do by default."""

    @abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None,
              beside_lora: bool = False) -> torch.Tensor:
        """x: [num_tokens, in_features] -> x @ W^T (+ bias): [num_tokens, out_features]. beside_lora: LoRA kernels
        run on a second stream meanwhile (kernels/ops.linear)."""


class ExpertsScheme(ABC):
    """The base weights of a sparse MoE block's experts (`FusedExperts`, layers/sparse_moe.py): gate_up_proj
    [E, 2I, H] and down_proj [E, H, I] as the scheme holds them."""

    @abstractmethod
    def create_weights(self, experts: FusedExperts, dtype: torch.dtype) -> None:
        """Register the parameters of this rank's share of every expert on `experts`."""

    @abstractmethod
    def checkpoint_tensors(self) -> tuple[str, ...]:
        """The fused checkpoint tensors the experts take: ("gate_up_proj", "down_proj"), ..."""

    @abstractmethod
    def full_shape(self, experts: FusedExperts, name: str) -> tuple[int, ...]:
        """The shape of the whole fused checkpoint tensor `name`."""

    @abstractmethod
    def load(self, experts: FusedExperts, name: str, tensor: torch.Tensor) -> None:
        """Copy this rank's share of a whole fused checkpoint tensor into place."""

    @abstractmethod
    def load_expert(self, experts: FusedExperts, expert: int, part: str, tensor: torch.Tensor,
                    tensor_name: str = "weight") -> None:
        """Copy this rank's share of one expert's checkpoint tensor (part "gate", "up" or "down"; tensor_name
        "weight", or one the scheme takes beside it: "weight_scale", ...) into place."""

    def finish(self, experts: FusedExperts) -> None:
        """After every checkpoint tensor is loaded: settle the weights into the form they multiply in."""

    @abstractmethod
    def matrices(self, experts: FusedExperts) -> ExpertMatrices:
        """The experts' weights as the expert kernels read them."""
