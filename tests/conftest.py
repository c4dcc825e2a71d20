"""Session fixtures shared by the worker and GPU tests."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton reads TRITON_INTERPRET when a kernel is decorated: set before any test module imports a
    # kernel, whichever directories a run names and in whatever order
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.hf_fixtures import build_hf_model, build_hf_moe_model


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny Llama (llama3 rope), Qwen2 (qkv bias, tied embeddings) and Qwen3 (q/k norm) checkpoints, each
    with the adapters of tests.hf_fixtures.ADAPTERS beside it."""
    root = tmp_path_factory.mktemp("hf")
    return {arch: build_hf_model(arch, root) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def hf_moe_models(tmp_path_factory) -> dict[str, Path]:
    """Tiny Qwen3-MoE (norm_topk_prob, q/k norm), Mixtral and Qwen2-MoE (shared expert, qkv bias, a dense layer) checkpoints,
    each with the attention-only adapters of tests.hf_fixtures.MOE_ADAPTERS beside it."""
    root = tmp_path_factory.mktemp("hf_moe")
    return {arch: build_hf_moe_model(arch, root) for arch in ("qwen3_moe", "mixtral", "qwen2_moe")}


@pytest.fixture(scope="session")
def demo():
    """The embedded demo's fast size (worker/demo/): its model, tokenizer and adapters, built once into the cache
    in seconds (the e2e tests' conftest has its own, in a temporary directory)."""
    from worker.demo import FAST, build_demo
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the small model trains faster on one thread than on a shared, oversubscribed pair
    try:
        return build_demo(size=FAST)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tokenizer(demo):
    """The demo's tokenizer, for decoding engine outputs."""
    import tokenizers
    return tokenizers.Tokenizer.from_file(str(demo.model_dir / "tokenizer.json"))
