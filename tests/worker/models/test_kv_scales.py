"""FP8 KV-cache scales read from each spelling quantization tools write (models/kv_scales.py): loaded into every
layer's attention with --kv-cache-dtype fp8, dropped with auto, per-head scales refused."""
from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import save_file

from worker.config import KernelConfig
from worker.distributed.tensor_parallel import TensorParallel
from worker.models.builder import build_model
from worker.models.kv_scales import kv_scale_target

CPU = torch.device("cpu")
K = (0.25, 0.0625)                  # layer 0, layer 1 (float32 values)
V = (0.5, 0.125)


def spelled(style: str) -> dict[str, torch.Tensor]:
    """The two layers' scales as `style` names and shapes them."""
    tensors = {}
    for layer in range(2):
        pre = f"model.layers.{layer}.self_attn"
        k, v = torch.tensor([K[layer]]), torch.tensor([V[layer]])
        if style == "compressed-tensors":
            tensors |= {f"{pre}.k_scale": k, f"{pre}.v_scale": v}
        elif style == "modelopt":
            tensors |= {f"{pre}.k_proj.k_scale": k.reshape(()), f"{pre}.v_proj.v_scale": v.reshape(())}
        elif style == "output_scale":
            tensors |= {f"{pre}.k_proj.output_scale": k, f"{pre}.v_proj.output_scale": v}
    return tensors


def checkpoint_with(hf_models, tmp_path, tensors: dict[str, torch.Tensor]):
    """The tiny Llama checkpoint with `tensors` in a second safetensors file beside its weights."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(hf_models["llama"] / name, model_dir / name)
    if tensors:
        save_file(tensors, str(model_dir / "kv_scales.safetensors"))
    return model_dir


def build(model_dir, kv_cache_dtype: str, tp: TensorParallel = TensorParallel()):
    return build_model(model_dir, torch.float32, CPU, "auto", 64, KernelConfig(), tp=tp, kv_cache_dtype=kv_cache_dtype)


def scales(model) -> list[tuple[float, float]]:
    return [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in model.layers]


@pytest.mark.parametrize("style", ["compressed-tensors", "modelopt", "output_scale"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3"])
def test_each_spelling_sets_each_layers_k_and_v_scale(hf_models, tmp_path, style, kv_cache_dtype):
    model = build(checkpoint_with(hf_models, tmp_path, spelled(style)), kv_cache_dtype)
    assert scales(model) == list(zip(K, V))


def test_a_legacy_kv_scale_serves_k_and_v(hf_models, tmp_path):
    tensors = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(K[i]) for i in range(2)}
    assert scales(build(checkpoint_with(hf_models, tmp_path, tensors), "fp8")) == [(K[0], K[0]), (K[1], K[1])]


def test_every_tensor_parallel_rank_takes_the_same_scalar(hf_models, tmp_path):
    model_dir = checkpoint_with(hf_models, tmp_path, spelled("compressed-tensors"))
    for rank in range(2):
        model = build(model_dir, "fp8", TensorParallel(rank=rank, world_size=2))
        assert model.layers[0].self_attn.attn.num_kv_heads == 1 and scales(model) == list(zip(K, V))


def test_auto_ignores_the_scales_per_head_ones_included(hf_models, tmp_path):
    tensors = spelled("compressed-tensors") | {"model.layers.0.self_attn.k_scale": torch.full((2, 1, 1), 0.25)}
    assert scales(build(checkpoint_with(hf_models, tmp_path, tensors), "auto")) == [(1.0, 1.0)] * 2


def test_per_head_scales_are_refused_with_fp8(hf_models, tmp_path):
    tensors = spelled("compressed-tensors") | {"model.layers.1.self_attn.v_scale": torch.full((2, 1, 1), 0.5)}
    with pytest.raises(ValueError, match=r"'model.layers.1.self_attn.v_scale' holds per-head KV-cache scales "
                                         r"\(shape \(2, 1, 1\)\).*--kv-cache-dtype auto"):
        build(checkpoint_with(hf_models, tmp_path, tensors), "fp8")


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_a_scale_that_is_not_positive_and_finite_is_refused(hf_models, tmp_path, value):
    tensors = {"model.layers.0.self_attn.k_scale": torch.tensor([value])}
    with pytest.raises(ValueError, match="must be positive and finite"):
        build(checkpoint_with(hf_models, tmp_path, tensors), "fp8")


def test_a_scale_for_a_layer_the_model_lacks_has_no_place(hf_models, tmp_path):
    tensors = {"model.layers.7.self_attn.k_scale": torch.tensor([0.5])}
    with pytest.raises(ValueError, match="'model.layers.7.self_attn.k_scale' has no place in LlamaForCausalLM"):
        build(checkpoint_with(hf_models, tmp_path, tensors), "fp8")


def test_without_checkpoint_scales_fp8_runs_at_1_with_a_warning(hf_models, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="worker.models.kv_scales"):
        model = build(checkpoint_with(hf_models, tmp_path, {}), "fp8")
    assert scales(model) == [(1.0, 1.0)] * 2
    assert "k_scale = v_scale = 1.0 in every layer" in caplog.text


@pytest.mark.parametrize("name, target", [
    ("model.layers.3.self_attn.k_scale", (3, "k")),
    ("model.layers.3.self_attn.v_scale", (3, "v")),
    ("model.layers.12.self_attn.k_proj.k_scale", (12, "k")),
    ("model.layers.12.self_attn.v_proj.v_scale", (12, "v")),
    ("model.layers.0.self_attn.k_proj.output_scale", (0, "k")),
    ("model.layers.0.self_attn.v_proj.output_scale", (0, "v")),
    ("model.layers.5.self_attn.kv_scale", (5, "kv")),
    ("model.layers.5.self_attn.k_proj.weight_scale", None),       # an FP8 weight's scale: not the KV cache's
    ("model.layers.5.self_attn.k_proj.input_scale", None),
    ("model.layers.5.self_attn.q_proj.output_scale", None),
    ("model.layers.5.self_attn.v_proj.k_scale", None),
])
def test_kv_scale_names(name, target):
    assert kv_scale_target(name) == target
