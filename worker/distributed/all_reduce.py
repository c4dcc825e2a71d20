"""`AllReduce`: one CUDA process's tensor-parallel all-reduce: a one-shot sum over NVLink peer memory for small
messages, NCCL for the rest.

Every row-parallel projection ends in one all-reduce of [rows, hidden] (a Llama-8B decode step: 64 of
[batch, 4096] bf16, 8 KiB to a few MiB each). NCCL's ring pays a fixed cost per call whatever the size (its
kernel, proxy handshakes, two ring steps); for these messages that cost is the whole time. One-shot instead:

    staged[rank][half] = x                    # this rank's symmetric buffer, a plain copy
    flag every peer: epoch e staged           # then wait until every peer has flagged e
    out = staged[0][half] + staged[1][half] + ...   # peers' buffers read over NVLink, summed in rank order

in one kernel. Each rank reads (world_size - 1) * nbytes over NVLink and writes nbytes locally: at 2 ranks a
[64, 4096] bf16 message is 512 KiB read per rank. Summing in rank order gives every rank the same bits. Past some
size NCCL wins again (its ring moves 2 * (world_size - 1) / world_size * nbytes a rank, on more SMs than the
one-shot kernel's 32 programs): `threshold_bytes` is that crossover, measured by bench/all_reduce.py.

The kernel is kernels/one_shot_all_reduce.py's, one Triton launch: it stages x into this rank's half of the
symmetric buffer, signals each peer with an epoch flag, waits for theirs and sums, the buffer in two halves used
alternately so that no exit barrier is needed. It uses plain loads from the peers' buffer pointers, no multimem
instruction, so it runs with NVLink multicast off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1 only stops the rendezvous
making a multicast object). It is safe in a CUDA graph: the buffer is allocated and rendezvoused once, here,
before any capture, and the epoch is a device counter the kernel advances itself, so each replay takes the next
epoch and no flag is ever reset. No host-device sync. It loads any float dtype and sums in float32, rounding once
to the message's dtype: bf16 and float32 messages of whole 4-byte vectors take the one-shot path (ONE_SHOT_DTYPES,
ALIGNMENT: what the two-GPU tests and benchmarks have run), anything else NCCL.
Triton and symmetric memory are imported only when an AllReduce is built (on CUDA at world size >= 2).

ranks/group.join_group attaches it on CUDA at world size >= 2, after `init_tensor_parallel` and before the
model is built (layers keep the `TensorParallel` they are built with):

    tp = dataclasses.replace(tp, fast_all_reduce=AllReduce(tp.group, device, max_bytes, threshold_bytes))

The buffer (`one_shot_all_reduce.buffer_bytes`: the flags and two halves of `max_bytes`) lives as long as the
process; it is allocated before the memory plan measures what is free, so the plan leaves it out of the KV pool.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

ONE_SHOT_DTYPES = (torch.bfloat16, torch.float32)   # the dtypes measured and tested on two GPUs (the kernel sums in
                                                     # float32, rounded once)
ALIGNMENT = 4                   # bytes: a message must be a whole number of 4-byte vectors
DEFAULT_MAX_BYTES = 4 << 20     # 256 decode rows x hidden 8192 bf16 (or 512 x 4096): the largest decode step's message
# bench/all_reduce.py on two H200s (NVLink, torch 2.11, NCCL 2.28), [rows, 4096] bf16 per call inside a CUDA graph
# (BENCHMARKS.md): one-shot 5.1 us at 8 KiB, 13.6 at 1 MiB, 23.6 at 2 MiB, 42.7 at 4 MiB against NCCL's 18.2, 26.2,
# 39.2 and 41.0 us: one-shot wins well up to 2 MiB and about ties at the buffer's size
DEFAULT_THRESHOLD_BYTES = DEFAULT_MAX_BYTES


def one_shot_fits(nbytes: int, dtype: torch.dtype, threshold_bytes: int) -> bool:
    """Whether a message of `nbytes` of `dtype` takes the one-shot path: a dtype the kernel sums, not empty, a whole
    number of 4-byte vectors, at most `threshold_bytes`. Every rank decides alike (same shapes, same threshold)."""
    return dtype in ONE_SHOT_DTYPES and 0 < nbytes <= threshold_bytes and nbytes % ALIGNMENT == 0


class AllReduce:
    """x -> x summed over `group`: one-shot through a symmetric buffer (kernels/one_shot_all_reduce.py) up to
    `threshold_bytes` (capped at `max_bytes`, what the buffer holds), `dist.all_reduce` above it or where
    symmetric memory is unavailable on any rank."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, max_bytes: int = DEFAULT_MAX_BYTES,
                 threshold_bytes: int = DEFAULT_THRESHOLD_BYTES):
        if device.type != "cuda":
            raise ValueError(f"AllReduce runs on CUDA devices, not {device.type}; use dist.all_reduce there.")
        if group.size() < 2:
            raise ValueError("AllReduce needs a group of 2 or more ranks; at world size 1 there is nothing to sum.")
        self.group = group
        self.kernel = None              # kernels/one_shot_all_reduce.OneShotAllReduce; None: NCCL only
        from worker.kernels import one_shot_all_reduce
        opened = open_symmetric_buffer(group, device, one_shot_all_reduce.buffer_bytes(max_bytes, group.size()))
        if opened is not None:          # zeroes this rank's flags; every_rank_agrees below is the collective after
            buffer, handle = opened
            self.kernel = one_shot_all_reduce.OneShotAllReduce(buffer, peer_buffer_ptrs(handle, buffer),
                                                               group.rank(), max_bytes)
        if not every_rank_agrees(self.kernel is not None, group, device):
            self.kernel = None
            logger.warning("one-shot all-reduce unavailable on some rank; every all-reduce goes through NCCL")
        self.buffer = opened[0] if self.kernel is not None else None   # [nbytes] uint8, this rank's symmetric memory
        self.threshold_bytes = min(threshold_bytes, max_bytes) if self.kernel is not None else 0

    def uses_one_shot(self, x: torch.Tensor) -> bool:
        return one_shot_fits(x.numel() * x.element_size(), x.dtype, self.threshold_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks: in place through NCCL; through one-shot, into x itself where x is contiguous,
        else into a contiguous copy. Callers use the returned tensor."""
        if not self.uses_one_shot(x):
            dist.all_reduce(x, group=self.group)
            return x
        x = x.contiguous()      # x itself, or a copy that becomes the output
        return self.kernel(x, x)


def open_symmetric_buffer(group: dist.ProcessGroup, device: torch.device,
                          nbytes: int) -> tuple[torch.Tensor, object] | None:
    """This rank's [nbytes] uint8 buffer in symmetric memory, rendezvoused with `group` (a collective: every rank
    calls it), and the rendezvous' handle (torch's `_SymmetricMemory`); None, with a warning, where this torch
    lacks symmetric memory or the peers' memory cannot be mapped."""
    try:
        import torch.distributed._symmetric_memory as symmetric_memory
    except ImportError as e:
        logger.warning("torch %s has no symmetric memory (%s); all-reduce stays on NCCL", torch.__version__, e)
        return None
    try:
        if torch_minor() < (2, 11):
            symmetric_memory.enable_symm_mem_for_group(group.group_name)   # deprecated (not needed) from 2.11
        buffer = symmetric_memory.empty(nbytes, dtype=torch.uint8, device=device)
        handle = symmetric_memory.rendezvous(buffer, group.group_name)
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
