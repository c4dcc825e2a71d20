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

Before the wait a projection only reads its weights (no kernel writes them): `prefetch_l2` pulls the first
part of its rows into L2 while the previous kernel finishes. Kernels of other kinds (torch ops, cuBLAS,
copies) before or after a PDL kernel keep their full dependency: the attribute only lets a kernel overlap
the kernel just before it in the same stream, and CUDA-graph capture keeps those edges.

`ENABLED` is process-wide (one engine per worker process; WorkerConfig.programmatic_launch sets it). Under
the Triton interpreter (CPU) the kernels compile the calls out: `active()` is False there.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

ENABLED = True
PREFETCH_BYTES = 2048      # per weight row, by a projection's programs before their wait


def set_enabled(enabled: bool) -> None:
    global ENABLED
    ENABLED = enabled


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def active(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL now (the PDL constexpr they take)."""
    if not ENABLED or device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(device: torch.device) -> dict:
    """Extra launch keywords: the PDL constexpr, and the launch attribute when active."""
    on = active(device)
    return {"PDL": on, "launch_pdl": True} if on else {"PDL": False}


def row_prefetch_bytes(weight: torch.Tensor, row_elements: int) -> int:
    """Bytes prefetch_l2 asks for per row of a row-major weight whose programs read `row_elements` of a row
    from a 16-byte aligned start: PREFETCH_BYTES or less, a multiple of 16; 0 (nothing) when the rows do not
    start 16-byte aligned."""
    elem = weight.element_size()
    if (weight.stride(0) * elem) % 16 or weight.data_ptr() % 16:
        return 0
    return min(PREFETCH_BYTES, row_elements * elem) // 16 * 16


@triton.jit
def launch_dependents(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def prefetch_l2(row_ptrs, mask, num_bytes, PDL: tl.constexpr):
    """Ask L2 for num_bytes (a multiple of 16; 16-byte aligned rows) from each of row_ptrs where mask holds:
    one bulk prefetch per row, no registers or shared memory held, nothing waited on."""
    if PDL:
        size = tl.where(mask, num_bytes, 0).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [row_ptrs, size], dtype=tl.int32, is_pure=False, pack=1)
