"""`--load-format dummy`: random weights from config.json alone, for benchmarks at real shapes."""
from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Normal(0, std) for matrices, ones for norm weights, zeros for biases; deterministic in `seed`. A parameter
    that holds this rank's shard of a larger tensor (its module's `full_shape` says so) gets its share of the whole
    tensor drawn as an unsharded model draws it, so every tensor-parallel size runs the same model."""
    modules = dict(model.named_modules())
    for i, (name, param) in enumerate(model.named_parameters()):
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith("bias"):
            param.zero_()
        else:   # drawn where the parameter lives: 8B parameters take seconds on a GPU, minutes on a CPU
            gen = torch.Generator(device=param.device).manual_seed(seed * 100003 + i)
            module_name, _, param_name = name.rpartition(".")
            module = modules[module_name]
            shape = module.full_shape(param_name) if hasattr(module, "full_shape") else param.shape
            if tuple(shape) == tuple(param.shape):
                param.normal_(0.0, std, generator=gen)
            else:
                whole = torch.empty(shape, dtype=param.dtype, device=param.device).normal_(0.0, std, generator=gen)
                module.load_shard(param_name, None, whole)
