"""PEFT adapter parsing: supported configs load with the right scalings; every unsupported case is refused
with a message naming the field and value, and nothing is left registered."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_fixtures import ADAPTERS, adapter_dir, peft_lora
from worker.config import LoRAConfig, ModelConfig, WorkerConfig
from worker.engine import Engine
from worker.lora.adapter import AdapterError, read_adapter
from worker.arch import ArchConfig
from worker.models.builder import lora_targets


@pytest.fixture(scope="module")
def engine(hf_models):
    return Engine(WorkerConfig(ModelConfig(str(hf_models["llama"])), lora=LoRAConfig(max_lora_rank=16),
                               device="cpu"))


def _copy_adapter(hf_models, tmp_path, name="r8-all"):
    dst = tmp_path / "adapter"
    shutil.copytree(adapter_dir(hf_models["llama"], name), dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(changes)
    (path / "adapter_config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("spec", ADAPTERS, ids=lambda s: s.name)
def test_scalings_follow_peft_rules(hf_models, spec):
    targets = lora_targets(ArchConfig.from_dir(hf_models["llama"]))
    adapter = read_adapter(spec.name, adapter_dir(hf_models["llama"], spec.name), targets, 16, torch.float32)
    assert set(adapter.spec.target_modules) == set(spec.targets)
    peft = peft_lora(hf_models["llama"], spec)      # PEFT's tensors, with the scalings PEFT's rules give
    assert adapter.modules.keys() == peft.keys()
    for (layer, target), m in adapter.modules.items():
        a, _, scaling = peft[(layer, target)]
        assert m.rank == (spec.rank_pattern or {}).get(target, spec.r) == a.shape[0]
        assert m.scaling == pytest.approx(scaling)
    assert adapter.spec.rank == spec.r


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save=['lm_head']"),
    ({"bias": "all"}, "bias='all'"),
    ({"r": 32}, "LoRA rank 32 is greater than max_lora_rank 16"),
    ({"target_modules": ["q_proj", "c_attn"]}, "'c_attn'"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
    ({"r": -4}, "r and rank_pattern must be positive integers, got [-4"),
    ({"r": 0}, "r and rank_pattern must be positive integers, got [0"),
    ({"r": "four"}, "r and rank_pattern must be positive integers, got ['four'"),
    ({"r": 8.5}, "r and rank_pattern must be positive integers, got [8.5"),
    ({"rank_pattern": {"q_proj": True}}, "r and rank_pattern must be positive integers"),
    ({"lora_alpha": 1e308}, "(lora_alpha / r) can reach 2.5e+307; its magnitude must be at most 65504"),
    ({"lora_alpha": "16"}, "lora_alpha and alpha_pattern must be finite numbers, got ['16'"),
    ({"lora_alpha": float("nan")}, "lora_alpha and alpha_pattern must be finite numbers, got [nan"),
    ({"alpha_pattern": {"q_proj": float("inf")}}, "lora_alpha and alpha_pattern must be finite numbers"),
])
def test_unsupported_config_is_refused_by_name(engine, hf_models, tmp_path, change, message):
    path = _copy_adapter(hf_models, tmp_path)
    _edit_config(path, **change)
    with pytest.raises(AdapterError) as err:
        engine.add_adapter("bad", str(path))
    assert message in str(err.value)
    assert "bad" not in engine.adapters.registry.refs


def test_files_linked_from_outside_a_lora_dir_are_neither_found_nor_loaded_there(hf_models, tmp_path):
    """One rule for a runtime load named by path and one found by name: the directory and its files lie inside
    a root, symlinks followed; a directory has one name there, its real path from the root."""
    root, outside = tmp_path / "root", _copy_adapter(hf_models, tmp_path)
    (root / "linked-files").mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (root / "linked-files" / name).symlink_to(outside / name)
    (root / "linked-weights").mkdir()
    shutil.copy(outside / "adapter_config.json", root / "linked-weights")
    (root / "linked-weights" / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    (root / "linked-dir").symlink_to(outside)
    shutil.copytree(outside, root / "team" / "inside")
    (root / "alias").symlink_to(root / "team" / "inside")
    config = LoRAConfig(lora_dirs=(str(root),))
    assert config.find_adapter_dir("team/inside") == str(root / "team" / "inside")
    assert config.may_read(root / "team" / "inside") and config.may_read(root / "alias")
    for linked in ("linked-files", "linked-weights", "linked-dir"):
        assert config.find_adapter_dir(linked) is None and not config.may_read(root / linked)
    assert not config.may_read(outside) and LoRAConfig().may_read(outside)
    for spelling in ("team/inside", "team/inside/", "team//inside", "alias"):
        assert config.adapter_name_of(config.find_adapter_dir(spelling)) == "team/inside"


def test_tensor_of_wrong_shape_is_refused(engine, hf_models, tmp_path):
    path = _copy_adapter(hf_models, tmp_path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    key = next(k for k in tensors if "q_proj.lora_B" in k)
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match=r"do not fit the base model"):
        engine.add_adapter("bad", str(path))
    assert "bad" not in engine.adapters.registry.refs


def test_weights_for_a_layer_the_model_lacks_are_refused(engine, hf_models, tmp_path):
    path = _copy_adapter(hf_models, tmp_path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    tensors = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="layer 7, but the base model has 2 layers"):
        engine.add_adapter("bad", str(path))


def test_embedding_lora_is_refused(engine, hf_models, tmp_path):
    path = _copy_adapter(hf_models, tmp_path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(8, 320)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="embed_tokens.lora_embedding_A"):
        engine.add_adapter("bad", str(path))


@pytest.mark.parametrize("remove, message", [
    ("adapter_config.json", "adapter_config.json is missing"),
    ("adapter_model.safetensors", "adapter_model.safetensors is missing"),
])
def test_missing_files_are_refused(engine, hf_models, tmp_path, remove, message):
    path = _copy_adapter(hf_models, tmp_path)
    (path / remove).unlink()
    with pytest.raises(AdapterError, match=message) as err:
        engine.add_adapter("bad", str(path))
    assert err.value.status_code == 404


def test_unreadable_files_are_refused(engine, hf_models, tmp_path):
    path = _copy_adapter(hf_models, tmp_path)
    (path / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(AdapterError, match="adapter_model.safetensors .* is unreadable"):
        engine.add_adapter("bad", str(path))
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="adapter_config.json .* is unreadable"):
        engine.add_adapter("bad", str(path))


def test_missing_directory_is_refused(engine, tmp_path):
    with pytest.raises(AdapterError, match="directory does not exist"):
        engine.add_adapter("bad", str(tmp_path / "nowhere"))


def test_duplicate_name_needs_load_inplace(engine, hf_models):
    path = str(adapter_dir(hf_models["llama"], "r4-qv"))
    engine.add_adapter("dup", path)
    with pytest.raises(AdapterError, match="has already been loaded"):
        engine.add_adapter("dup", path)
    engine.add_adapter("dup", path, load_inplace=True)
    engine.remove_adapter("dup")
    with pytest.raises(AdapterError, match="cannot be found"):
        engine.remove_adapter("dup")
