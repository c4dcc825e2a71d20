"""Without a CUDA device, kernel tests run the Triton kernels in the interpreter on CPU tensors.

Triton reads TRITON_INTERPRET when a kernel is decorated, so it is set here, when pytest imports this
conftest, before any test module imports a kernel module.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
