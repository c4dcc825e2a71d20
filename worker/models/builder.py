"""Architecture name -> model class, and building a model from a directory."""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch
from torch import nn

from worker.config import KernelConfig
from worker.distributed.tensor_parallel import SINGLE, TensorParallel
from worker.kernels.choices import KernelChoices
from worker.layers.lora.backend import choose_backend
from worker.layers.weights.format import read_weight_format
from worker.models.dummy import init_dummy_weights
from worker.models.kv_scales import log_kv_scales
from worker.arch import ArchConfig
from worker.lora.targets import LoRATargets
from worker.models.llama import LlamaForCausalLM
from worker.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from worker.models.weight_loader import finish_loading, load_weights

logger = logging.getLogger(__name__)

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
}


def resolve_kernels(config: KernelConfig, device: torch.device, model_config: dict | None = None,
                    quantization: str | None = None) -> KernelChoices:
    """`config` resolved for `device`: the kernel choices (kernels/choices.py) with the LoRA backend it names
    (layers/lora/backend.py) and the weight format of the model whose config.json is `model_config`
    (layers/weights/format.py; None: unquantized), what every layer of a model is built with."""
    weights = read_weight_format(model_config or {}, quantization)
    return dataclasses.replace(KernelChoices.resolve(config, device),
                               lora=choose_backend(config.lora_backend, device),
                               weights=weights.for_device(KernelChoices.fp8_capable(config, device)))


def model_class(architecture: str) -> type[nn.Module]:
    cls = MODEL_CLASSES.get(architecture)
    if cls is None:
        raise ValueError(f"Model architecture {architecture!r} is not supported; "
                         f"supported architectures: {sorted(MODEL_CLASSES)}")
    return cls


def lora_targets(cfg: ArchConfig) -> LoRATargets:
    """The LoRA targets of the model `cfg` describes (lora/targets.py), without building it."""
    return model_class(cfg.architecture).lora_targets(cfg)


def build_model(path: str | Path, dtype: torch.dtype, device: torch.device, load_format: str,
                max_positions: int, kernels: KernelConfig, seed: int = 0, tp: TensorParallel = SINGLE,
                quantization: str | None = None, kv_cache_dtype: str = "auto") -> nn.Module:
    """The model of the checkpoint directory `path` on `device`, its layers built with `kernels` resolved for
    the device (kernels/choices.py, with the LoRA backend of layers/lora/backend.py and the weight format of
    layers/weights/format.py: config.json's quantization_config, or `quantization`; before any CUDA-graph
    capture), this rank's share of it under `tp`. With an FP8 `kv_cache_dtype` (config.KV_CACHE_DTYPES) the
    checkpoint's KV-cache scales are loaded into the attention layers (models/kv_scales.py); with auto they are
    ignored."""
    raw = json.loads((Path(path) / "config.json").read_text())
    cfg = ArchConfig.from_dict(raw)
    cls = model_class(cfg.architecture)
    choices = resolve_kernels(kernels, device, raw, quantization)
    if choices.weights.groups:
        logger.info("weights: %s%s", choices.weights.describe(),
                    "" if choices.weights.fp8_kernels else ", dequantized to the compute dtype at load")
    with torch.device(device):
        model = cls(cfg, dtype, max_positions, choices, tp)
    with torch.no_grad():
        if load_format == "dummy":
            init_dummy_weights(model, seed)
        elif load_format == "auto":
            load_weights(model, Path(path), kv_cache_scales=kv_cache_dtype != "auto")
        else:
            raise ValueError(f"--load-format {load_format!r} is not supported (auto, dummy)")
        finish_loading(model)
    if kv_cache_dtype != "auto":
        log_kv_scales(model)
    return model.eval()
