"""LoRA backends: what LoRA does in a forward pass, one object chosen by name when the model is built.

A backend owns everything LoRA adds to the base model's work: which kernels compute the delta, on which stream,
whether the delta is added in place or left to the next kernel (layers/lora/deferred.py), and how rows are
grouped by adapter. The layers hold the base weights and their tensor-parallel shards and ask the backend for
the LoRA part; the models never see it. A new way of running LoRA (say, the expand inside the base GEMM) is one
subclass in a new `<name>_backend.py` module of this package, `@register`ed under its name and chosen with
`--kernel-config '{"lora_backend": "<name>"}'`; its kernels live under kernels/.

Semantics every backend computes, for each token row t of segment s of LoRABatchInfo (slot w = seg_lora_slots[s],
rank r = ranks[w]; w = -1: no adapter):
    y[t, slice i] += scalings[w, i] * (x[t] @ A[w, i, :r]^T) @ B[w, slice i, :r]^T
and for a sparse MoE block, per (token, expert) pair of its routing, the same on the expert's gate, up and down.
"""
from __future__ import annotations

import importlib
import pkgutil
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from worker.batch import LoRABatchInfo
from worker.layers.lora.deferred import Deferred

if TYPE_CHECKING:
    from worker.layers.linear import Linear
    from worker.layers.sparse_moe import SparseMoE


class LoRABackend(ABC):
    name: ClassVar[str]
    device_type: ClassVar[str]       # the devices it runs on ("cpu", "cuda")

    @abstractmethod
    def linear(self, layer: Linear, x: torch.Tensor, info: LoRABatchInfo,
               bias: torch.Tensor | None) -> torch.Tensor | Deferred:
        """layer's base projection of x ([num_tokens, in_features], with `bias`) plus its LoRA delta over `info`'s
        segments, or the two apart (`Deferred`) when the backend leaves the add to the next kernel: never for a
        row-parallel shard at world size > 1, whose delta joins the partial sum before the all-reduce."""

    @abstractmethod
    def experts(self, block: SparseMoE, x: torch.Tensor, logits: torch.Tensor, info: LoRABatchInfo) -> torch.Tensor:
        """The routed experts' weighted sum ([num_tokens, hidden]) of a sparse MoE block for router `logits`, with
        each token's adapter on every expert it visits; rows without an adapter compute exactly what the block
        computes without LoRA (kernels/ops.sparse_experts)."""


BACKENDS: dict[str, type[LoRABackend]] = {}   # name -> class, filled by @register as each *_backend module loads


def register(cls: type[LoRABackend]) -> type[LoRABackend]:
    BACKENDS[cls.name] = cls
    return cls


def choose_backend(name: str, device: torch.device) -> LoRABackend:
    """The backend `name` ("auto": the one made for `device`), refused by name where it cannot run."""
    _import_backends()
    if name == "auto":
        name = "triton" if device.type == "cuda" else "reference"
    cls = BACKENDS.get(name)
    if cls is None:
        raise ValueError(f"KernelConfig.lora_backend={name!r} is not a LoRA backend; choose one of "
                         f"{sorted(BACKENDS) + ['auto']}")
    if cls.device_type != device.type:
        raise ValueError(f"the {name!r} LoRA backend runs on {cls.device_type}, not on {device.type}")
    return cls()


def _import_backends() -> None:
    """Import every `*_backend` module of this package, so each registers its class: a new backend is a new file."""
    import worker.layers.lora as package
    for module in pkgutil.iter_modules(package.__path__):
        if module.name.endswith("_backend"):
            importlib.import_module(f"{package.__name__}.{module.name}")
