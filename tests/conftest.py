"""Session fixtures shared by the worker and GPU tests."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.hf_fixtures import build_hf_model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny Llama (llama3 rope), Qwen2 (qkv bias, tied embeddings) and Qwen3 (q/k norm) checkpoints, each
    with the adapters of tests.hf_fixtures.ADAPTERS beside it."""
    root = tmp_path_factory.mktemp("hf")
    return {arch: build_hf_model(arch, root) for arch in ("llama", "qwen2", "qwen3")}
