"""Fixtures of the adapter tests: the tiny Llama checkpoint and adapters with distinct weights."""
from __future__ import annotations

import shutil

import pytest
from safetensors.torch import load_file, save_file

from tests.hf_fixtures import ADAPTERS, adapter_dir

NUM_VARIANTS = 7


@pytest.fixture(scope="module")
def llama(hf_models):
    return hf_models["llama"]


@pytest.fixture(scope="module")
def variants(llama, tmp_path_factory) -> dict[str, str]:
    """NUM_VARIANTS adapters with distinct weights: the fixtures' adapters with lora_B scaled."""
    root = tmp_path_factory.mktemp("variants")
    paths = {}
    for i in range(NUM_VARIANTS):
        source = adapter_dir(llama, ADAPTERS[i % len(ADAPTERS)].name)
        path = root / f"v{i}"
        shutil.copytree(source, path)
        tensors = load_file(str(path / "adapter_model.safetensors"))
        scaled = {k: t * (1.0 + 0.4 * (i // len(ADAPTERS) + 1)) if "lora_B" in k else t for k, t in tensors.items()}
        save_file(scaled, str(path / "adapter_model.safetensors"))
        paths[f"v{i}"] = str(path)
    return paths
