"""`--load-format dummy`: random weights from config.json alone, for benchmarks at real shapes."""
from __future__ import annotations

import torch
from torch import nn

from worker.models.weight_loader import checkpoint_targets

# tensors a weight scheme computes when it quantizes a drawn weight (layers/weights/fp8.py)
_SCALES = ("weight_scale", "weight_scale_inv", "input_scale", "_scale", "_scale_inv")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """Normal(0, std) for matrices, ones for norm weights, zeros for biases; deterministic in `seed`. Every checkpoint
    tensor the model takes (models/weight_loader.checkpoint_targets) is drawn whole, at the checkpoint's shape, and
    loaded as a checkpoint's would be: through the module's weight scheme (layers/weights/), this rank's share under
    tensor parallelism, so every tensor-parallel size runs the same model. A plain parameter (a norm, an embedding
    not sharded) is drawn in place. FP8 weights are drawn in the compute dtype and quantized by their scheme, which
    computes their scales as a checkpoint's writer would (so scales are not drawn)."""
    dtype = next(model.parameters()).dtype
    for i, (name, (module, tensor_name)) in enumerate(checkpoint_targets(model).items()):
        target = getattr(module, tensor_name, None)
        if name.endswith(_SCALES):
            continue
        if name.endswith("norm.weight"):
            target.fill_(1.0)
        elif name.endswith("bias"):
            target.zero_()
        else:   # drawn where the model lives: 8B parameters take seconds on a GPU, minutes on a CPU
            device = target.device if target is not None else next(model.parameters()).device
            gen = torch.Generator(device=device).manual_seed(seed * 100003 + i)
            shape = module.full_shape(tensor_name) if hasattr(module, "full_shape") else target.shape
            if not hasattr(module, "checkpoint_tensors") and tuple(shape) == tuple(target.shape):
                target.normal_(0.0, std, generator=gen)
            else:
                drawn = (target.dtype if target is not None and target.is_floating_point()
                         and target.element_size() > 1 else dtype)
                whole = torch.empty(shape, dtype=drawn, device=device).normal_(0.0, std, generator=gen)
                module.load_shard(tensor_name, None, whole)
