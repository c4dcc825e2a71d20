"""kernels/pdl.py: when the step's kernels launch with programmatic dependent launch (the launch itself is
checked on the GPU: tests/gpu/test_engine_gpu.py compares every logit with it on and off)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.kernels import pdl  # noqa: E402


@pytest.mark.parametrize("enabled", [True, False])
def test_cpu_tensors_never_launch_with_pdl(enabled):
    assert not pdl.active(torch.device("cpu"), enabled)
    assert pdl.launch_options(torch.device("cpu"), enabled) == {"PDL": False}


@pytest.mark.parametrize("capability_ok", [True, False], ids=["hopper", "older"])
@pytest.mark.parametrize("enabled", [True, False])
def test_cuda_launches_with_pdl_when_enabled_on_hopper_or_later(monkeypatch, enabled, capability_ok):
    monkeypatch.setattr(pdl, "_supported", lambda index: capability_ok)
    device = torch.device("cuda", 0)
    assert pdl.active(device, enabled) == (enabled and capability_ok)
    want = {"PDL": True, "launch_pdl": True} if enabled and capability_ok else {"PDL": False}
    assert pdl.launch_options(device, enabled) == want


def test_kernels_launch_with_pdl_unless_told_not_to(monkeypatch):
    """The wrappers' default is the engine's usual choice (on where the device has it)."""
    monkeypatch.setattr(pdl, "_supported", lambda index: True)
    assert pdl.active(torch.device("cuda", 0))
    assert pdl.launch_options(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
