"""Programmatic dependent launch (PDL) between the decode path's kernels.

A kernel in a stream normally starts only once the kernel before it has ended, so every boundary costs the
launch, the new programs' start-up and the first loads' latency with the memory bus idle. With PDL (Hopper
and later) a kernel launched with the attribute may start while the one before it still runs: as soon as
every program of that one has called `launch_dependents()` (or ended). The kernels here follow two rules:

- every kernel of the chain calls `launch_dependents()` first, so the next one launches once this one's last
  programs are running (not before: they would hold SM resources this one's later programs need);
- a kernel launched with the attribute calls `wait()` before its first load of anything an earlier kernel
  wrote and before its first store (its output may be memory an earlier kernel still reads: the allocator
  reuses freed blocks in stream order). `wait()` returns once the kernel before has ended and its writes are
  visible; that kernel waited for its own predecessor the same way, so everything earlier has ended too.

Kernels of other kinds (torch ops, cuBLAS, copies) before or after a PDL kernel keep their full dependency:
the attribute only lets a kernel overlap the kernel just before it in the same stream, and CUDA-graph capture
keeps those edges. Weight rows are not prefetched into L2 before the wait (slower: BENCHMARKS.md, Tried and dropped).

Each kernel wrapper takes `programmatic_launch` (default True; the layers pass KernelConfig's choice) and
launches with PDL where `active()` says the device has it. Under the Triton interpreter (CPU) the kernels
compile the calls out: `active()` is False there.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def active(device: torch.device, enabled: bool = True) -> bool:
    """Whether kernels on `device` launch with PDL when `enabled` (the PDL constexpr they take): CUDA devices
    of compute capability 9.0 (Hopper) and later."""
    if not enabled or device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device, enabled: bool = True) -> dict:
    """Extra launch keywords: the PDL constexpr, and the launch attribute when active."""
    on = active(device, enabled)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()
