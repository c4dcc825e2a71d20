"""`AllReduce`: one CUDA process's tensor-parallel all-reduce: a one-shot sum over NVLink peer memory for small
messages, NCCL for the rest.

Every row-parallel projection ends in one all-reduce of [rows, hidden] (a Llama-8B decode step: 64 of
[batch, 4096] bf16, 8 KiB to a few MiB each). NCCL's ring pays a fixed cost per call whatever the size (its
kernel, proxy handshakes, two ring steps); for these messages that cost is the whole time. One-shot instead:

    staged[rank] = x                          # this rank's symmetric buffer, a plain copy
    barrier                                   # every peer's staged copy is written
    out = staged[0] + staged[1] + ...         # peers' buffers read over NVLink, summed in rank order
    barrier                                   # no peer still reads a buffer the next call overwrites

one kernel after the copy, its two barriers on the symmetric memory's signal pads. Each rank reads
(world_size - 1) * nbytes over NVLink and writes nbytes locally: at 2 ranks a [64, 4096] bf16 message is 512 KiB
read per rank. Summing in rank order gives every rank the same bits. Past some size NCCL wins again (its ring
moves 2 * (world_size - 1) / world_size * nbytes a rank, on more SMs than the one-shot kernel's 24 blocks):
`threshold_bytes` is that crossover, measured by bench/all_reduce.py.

The kernel is PyTorch's `symm_mem::one_shot_all_reduce_out` (torch/csrc/distributed/c10d/symm_mem/
CUDASymmetricMemoryOps.cu, since torch 2.6; bf16 and float32 only): plain vector loads from the peers' buffer
pointers, no multimem instruction, so it runs with NVLink multicast off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1 only
stops the rendezvous making a multicast object). It is safe in a CUDA graph: the buffer is allocated and
rendezvoused once, here, before any capture (the op's own rendezvous is then a host-side lookup of the cached
handle), and its barrier is a compare-and-swap 0 -> 1 on the peer's pad and 1 -> 0 on one's own, which leaves
every pad at zero after each call, so a replay starts from the state the capture saw. No host-device sync.
Its sibling `one_shot_all_reduce_copy_out`, which stages x inside the same kernel, is not used: a block's
first threads signal the peers with no `__syncthreads()` after the block's copies, so a peer may read a staged
element another warp has not written yet.

`kernel="triton"` (`KernelConfig.all_reduce_kernel`) sums instead with kernels/one_shot_all_reduce.py: one
launch that stages x, signals the peers with an epoch flag, waits for theirs and sums, its buffer in two halves
used alternately so that no exit barrier is needed. Its symmetric buffer holds flags and two halves of `max_bytes`
(`one_shot_all_reduce.buffer_bytes`); Triton is imported only when it is chosen.

ranks/group.join_group attaches it on CUDA at world size >= 2, after `init_tensor_parallel` and before the
model is built (layers keep the `TensorParallel` they are built with):

    tp = dataclasses.replace(tp, fast_all_reduce=AllReduce(tp.group, device, max_bytes, threshold_bytes, kernel))

The buffer (`max_bytes` plus a signal pad; for "triton" twice `max_bytes`) lives as long as the process; it is
allocated before the memory plan measures what is free, so the plan leaves it out of the KV pool.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)   # what the symm_mem kernel is built for
ALIGNMENT = 4                   # bytes: the kernel's smallest vector; a message must be a whole number of them
OUTPUT_ALIGNMENT = 16           # bytes: its widest vector store, so an output written in place must start there
DEFAULT_MAX_BYTES = 4 << 20     # 256 decode rows x hidden 8192 bf16 (or 512 x 4096): the largest decode step's message
# bench/all_reduce.py on two H200s (NVLink, torch 2.11, NCCL 2.28), per call inside a CUDA graph: one-shot 16.5 us at
# 8 KiB, 31 us at 1 MiB, 72 us at 4 MiB against NCCL's 52.6, 59 and 114 us: one-shot wins up to the buffer's size
DEFAULT_THRESHOLD_BYTES = DEFAULT_MAX_BYTES
KERNELS = ("symm_mem", "triton")    # what sums a one-shot message: torch's symm_mem op, or kernels/one_shot_all_reduce.py


def one_shot_fits(nbytes: int, dtype: torch.dtype, threshold_bytes: int) -> bool:
    """Whether a message of `nbytes` of `dtype` takes the one-shot path: a dtype the kernel sums, not empty, a whole
    number of 4-byte vectors, at most `threshold_bytes`. Every rank decides alike (same shapes, same threshold)."""
    return dtype in ONE_SHOT_DTYPES and 0 < nbytes <= threshold_bytes and nbytes % ALIGNMENT == 0


class AllReduce:
    """x -> x summed over `group`: one-shot through a symmetric buffer up to `threshold_bytes` (capped at
    `max_bytes`, the buffer's size), `dist.all_reduce` above it or where the one-shot op is unavailable."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES,
                 threshold_bytes: int = DEFAULT_THRESHOLD_BYTES, kernel: str = "symm_mem"):
        if device.type != "cuda":
            raise ValueError(f"AllReduce runs on CUDA devices, not {device.type}; use dist.all_reduce there.")
        if kernel not in KERNELS:
            raise ValueError(f"unknown all-reduce kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
        if group.size() < 2:
            raise ValueError("AllReduce needs a group of 2 or more ranks; at world size 1 there is nothing to sum.")
        self.group = group
        self.group_name: str = group.group_name
        self.triton_kernel = None       # kernels/one_shot_all_reduce.OneShotAllReduce where kernel == "triton"
        if kernel == "triton":
            from worker.kernels import one_shot_all_reduce
            opened = open_symmetric_buffer(group, device, one_shot_all_reduce.buffer_bytes(max_bytes, group.size()),
                                           needs_symm_mem_op=False)
            if opened is not None:      # zeroes this rank's flags; every_rank_agrees below is the collective after
                buffer, handle = opened
                self.triton_kernel = one_shot_all_reduce.OneShotAllReduce(
                    buffer, peer_buffer_ptrs(handle, buffer), group.rank(), max_bytes)
        else:
            opened = open_symmetric_buffer(group, device, max_bytes)
        buffer = opened[0] if opened is not None else None
        if not every_rank_agrees(buffer is not None, group, device):
            buffer = self.triton_kernel = None
            logger.warning("one-shot all-reduce unavailable on some rank; every all-reduce goes through NCCL")
        self.buffer = buffer            # [nbytes] uint8, this rank's symmetric memory; None: NCCL only
        self.threshold_bytes = min(threshold_bytes, max_bytes) if buffer is not None else 0

    def uses_one_shot(self, x: torch.Tensor) -> bool:
        return one_shot_fits(x.numel() * x.element_size(), x.dtype, self.threshold_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks: in place through NCCL; through one-shot, into x itself where x is contiguous
        (symm_mem: and 16-byte aligned), else into a new tensor. Callers use the returned tensor."""
        if not self.uses_one_shot(x):
            dist.all_reduce(x, group=self.group)
            return x
        if self.triton_kernel is not None:
            x = x.contiguous()      # x itself, or a copy that becomes the output
            return self.triton_kernel(x, x)
        nbytes = x.numel() * x.element_size()
        staged = self.buffer[:nbytes].view(x.dtype).view(x.shape)      # the front of the symmetric buffer
        staged.copy_(x)
        aligned = x.is_contiguous() and x.data_ptr() % OUTPUT_ALIGNMENT == 0
        out = x if aligned else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out)


def open_symmetric_buffer(group: dist.ProcessGroup, device: torch.device, nbytes: int,
                          needs_symm_mem_op: bool = True) -> tuple[torch.Tensor, object] | None:
    """This rank's [nbytes] uint8 buffer in symmetric memory, rendezvoused with `group` (a collective: every rank
    calls it), and the rendezvous' handle (torch's `_SymmetricMemory`); None, with a warning, where this torch
    lacks symmetric memory (or, with `needs_symm_mem_op`, the one-shot op) or the peers' memory cannot be mapped."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as e:
        logger.warning("torch %s has no symmetric memory (%s); all-reduce stays on NCCL", torch.__version__, e)
        return None
    if needs_symm_mem_op and not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
        logger.warning("torch %s has no symm_mem.one_shot_all_reduce_out; all-reduce stays on NCCL", torch.__version__)
        return None
    try:
        if torch_minor() < (2, 11):
            symm_mem.enable_symm_mem_for_group(group.group_name)   # deprecated (not needed) from 2.11
        buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buffer, group.group_name)
    except (RuntimeError, AttributeError, TypeError) as e:    # no P2P, no driver API, an older API or backend
        logger.warning("symmetric memory rendezvous failed (%s: %s); all-reduce stays on NCCL", type(e).__name__, e)
        return None
    return buffer, handle


def peer_buffer_ptrs(handle, buffer: torch.Tensor) -> list[int]:
    """Every rank's copy of `buffer` as this process addresses it, rank order. `handle.buffer_ptrs` are the peers'
    allocations as mapped here; recent torch gives the start of the whole allocation, which its memory pool may
    share between tensors (torch/csrc/distributed/c10d/symm_mem/CUDASymmetricMemory.cu: "per-handle offsets are
    applied separately"), so the tensor's offset in it, the same on every rank, is added (0 where torch already
    did)."""
    offset = buffer.data_ptr() - handle.buffer_ptrs[handle.rank]
    return [ptr + offset for ptr in handle.buffer_ptrs]


def every_rank_agrees(ok: bool, group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether `ok` holds on every rank of `group` (a collective): one rank on NCCL while another spins in the
    one-shot barrier would hang both."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def torch_minor() -> tuple[int, int]:
    """(major, minor) of the installed torch: "2.11.0+cu128" -> (2, 11)."""
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)
