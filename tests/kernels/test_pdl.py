"""kernels/pdl.py: when the step's kernels launch with programmatic dependent launch (the launch itself is
checked on the GPU: tests/gpu/test_engine_gpu.py compares every logit with it on and off)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.kernels import pdl  # noqa: E402


@pytest.fixture
def restore_enabled():
    yield
    pdl.set_enabled(True)


@pytest.mark.parametrize("enabled", [True, False])
def test_cpu_tensors_never_launch_with_pdl(restore_enabled, enabled):
    pdl.set_enabled(enabled)
    assert not pdl.active(torch.device("cpu"))
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}


@pytest.mark.parametrize("capability_ok", [True, False], ids=["hopper", "older"])
@pytest.mark.parametrize("enabled", [True, False])
def test_cuda_launches_with_pdl_when_enabled_on_hopper_or_later(restore_enabled, monkeypatch, enabled, capability_ok):
    monkeypatch.setattr(pdl, "_supported", lambda index: capability_ok)
    pdl.set_enabled(enabled)
    device = torch.device("cuda", 0)
    assert pdl.active(device) == (enabled and capability_ok)
    want = {"PDL": True, "launch_pdl": True} if enabled and capability_ok else {"PDL": False}
    assert pdl.launch_options(device) == want
