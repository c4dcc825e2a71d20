"""KernelChoices: WorkerConfig.kernels resolved for one device, held by the layers that launch kernels.

models/builder.build_model resolves it once, before any CUDA-graph capture, and hands it to every layer it
builds; no layer reads a global or has its choices written onto it afterwards. On the CPU everything is off:
the layers run the torch references (kernels/reference.py) and need no Triton.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from worker.config import KernelConfig


@dataclass(frozen=True, eq=False)
class KernelChoices:
    gemv_row_limit: int = 0            # projections of at most this many rows run kernels/gemv.py (0: none)
    skinny_row_limit: int = 0          # larger ones up to this many kernels/skinny_gemm.py (0: none); cuBLAS above
    fp8_gemv_row_limit: int = 0        # FP8 projections of at most this many rows run kernels/fp8_gemv.py (0: none)
    fp8_skinny_row_limit: int = 0      # larger ones up to this many kernels/fp8_skinny.py; W8A8 above
    programmatic_launch: bool = False  # Triton kernels launch with PDL (kernels/pdl.py); True only where the
                                       # device has it
    skinny_counters: torch.Tensor | None = None   # [skinny_gemm.NUM_COUNTERS] int32, the arrival counters every
                                                  # skinny_gemm launch on the device shares (None: no skinny GEMM)
    # the LoRA backend (layers/lora/backend.py: KernelConfig.lora_backend chosen for the device), set by
    # models/builder.build_model; what every projection and sparse MoE block asks for its LoRA part
    lora: Any = None   # a layers/lora/backend.LoRABackend (layers/ sits above kernels/: named, not imported)
    # the model's weight format (layers/weights/format.WeightFormat: which weight scheme each projection holds,
    # resolved for the device), set by models/builder.build_model; None: every projection unquantized
    weights: Any = None

    def linear_scheme(self, names, router: bool = False):
        """The weight scheme of a projection packing the checkpoint modules `names` (None: unquantized)."""
        return None if self.weights is None else self.weights.linear(names, router)

    def experts_scheme(self, name: str, modules: tuple[str, ...]):
        """The weight scheme of the experts `name` ("model.layers.3.mlp.experts"), each expert's checkpoint
        modules named `modules` ("gate_proj", "up_proj", "down_proj"; None: unquantized)."""
        return None if self.weights is None else self.weights.experts(name, modules)

    @staticmethod
    def fp8_capable(config: KernelConfig, device: torch.device) -> bool:
        """Whether FP8 weights stay E4M3 and multiply on FP8 tensor cores (SM89+; KernelConfig.fp8_kernels)."""
        return (config.fp8_kernels and device.type == "cuda"
                and torch.cuda.get_device_capability(device) >= (8, 9))

    @classmethod
    def resolve(cls, config: KernelConfig, device: torch.device) -> KernelChoices:
        """The choices of `config` that `device` can run; the skinny GEMM's counters are allocated here."""
        if device.type != "cuda":
            return cls()
        from worker.kernels import fp8_gemv, fp8_skinny, gemv, pdl, skinny_gemm   # Triton; imported here so CPU
        for name, rows, limit in (("gemv_row_limit", config.gemv_row_limit, gemv.MAX_ROWS),   # installs need none
                                  ("skinny_row_limit", config.skinny_row_limit, skinny_gemm.MAX_ROWS),
                                  ("fp8_gemv_row_limit", config.fp8_gemv_row_limit, fp8_gemv.MAX_ROWS),
                                  ("fp8_skinny_row_limit", config.fp8_skinny_row_limit, fp8_skinny.MAX_ROWS)):
            if rows > limit:
                raise ValueError(f"KernelConfig.{name}={rows} is above what the kernel takes ({limit})")
        return cls(gemv_row_limit=config.gemv_row_limit, skinny_row_limit=config.skinny_row_limit,
                   fp8_gemv_row_limit=config.fp8_gemv_row_limit, fp8_skinny_row_limit=config.fp8_skinny_row_limit,
                   programmatic_launch=pdl.active(device, config.programmatic_launch),
                   skinny_counters=skinny_gemm.new_counters(device) if config.skinny_row_limit else None)
