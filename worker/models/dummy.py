"""`--load-format dummy`: random weights from config.json alone, for benchmarks at real shapes."""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Normal(0, std) for matrices, ones for norm weights, zeros for biases; deterministic in `seed`."""
    for i, (name, param) in enumerate(model.named_parameters()):
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:   # drawn where the parameter lives: 8B parameters take seconds on a GPU, minutes on a CPU
            gen = torch.Generator(device=param.device).manual_seed(seed * 100003 + i)
            param.normal_(0.0, std, generator=gen)
