"""One-shot all-reduce in one Triton kernel: stage, signal, wait and sum over NVLink peer memory in a single launch.

What distributed/all_reduce.py's `AllReduce` sums its one-shot messages with (PyTorch's own one-shot op, a copy
kernel then two barriers inside its kernel, made TP=2 serving steps 4-7% slower; BENCHMARKS.md). As vLLM's
custom all-reduce does, every rank writes its input into its own buffer, tells each peer so with a flag holding
the call's number (its epoch), waits for the peers' flags, then reads every rank's buffer and sums in rank order.
Epochs only grow, so no flag is ever reset, and buffers alternate between two halves, so no barrier is
needed on the way out.

Memory: each rank's buffer is symmetric memory (PyTorch's allocation and rendezvous, distributed/all_reduce.py),
which every peer has mapped; `buffer_ptrs[r]` is rank r's buffer as this process addresses it. Its layout, the same
on every rank (`buffer_bytes`):

    [flags: world_size x NUM_PROGRAMS int64 | half 0: half_bytes | half 1: half_bytes]
    flags[src * NUM_PROGRAMS + p]: the last epoch rank src's program p finished staging (written by rank src)

The flags live in this buffer rather than in the allocation's signal pad: a signal pad belongs to the whole
allocation, which PyTorch's memory pool may share between several symmetric tensors (and its barrier ops use the
pad's first slots with a 0/1 protocol); the buffer is this kernel's alone. The owner zeroes them before any peer
can signal (`OneShotAllReduce.__init__`, then a collective).

The epoch is device memory the kernel advances itself (`epochs[p]`, one counter per program, each read and
written by its program only): a CUDA-graph replay runs the kernel again, so each replay takes the next epoch. A
host-side Python int passed at launch would be captured into the graph: every replay would wait for the same
epoch, which the flags already hold from the replay before, and would sum a peer's half before the peer wrote it.
A separate in-graph increment would cost a second launch per call. The grid is always NUM_PROGRAMS programs
(those past the message's tiles only signal and wait), so every program's counter advances on every call and all
of them, on every rank, hold the same epoch: the number of calls so far (every rank makes the same calls).

Why no exit barrier: call e stages into half (e mod 2). Rank A's program p starts call e + 2 (the same half as
call e) only after A's kernel of call e + 1 ended, in which A's program p saw every peer B's flag reach e + 1.
B's program p writes e + 1 in B's kernel of call e + 1, which B's stream starts only after B's kernel of call e
has ended: every read of call e, by every program of B, has returned. Reads of call e + 1 are in the other half.
A flag that A's program p waits on for call e holds e or e + 1 (B cannot signal e + 2 before A signals e + 1),
hence the wait is for `flag >= e`. Preconditions: each rank makes its calls on one stream (or ordered ones), none
launched with programmatic dependent launch, and all NUM_PROGRAMS programs of every rank can be resident at once
(a program spins until the peers' programs of the same index have staged).

Ordering: a program's threads store their tiles, meet at a block barrier, then one thread stores the epoch into
each peer's flag with release semantics at system scope (it covers the whole block's stores after the barrier);
the waiting thread reads its flags with acquire semantics at system scope, then the block meets again before
any thread reads a peer's tiles (the pattern of vLLM's custom all-reduce and PyTorch's symmetric-memory barrier).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

NUM_PROGRAMS = 32        # programs per call: each stages, signals, waits for and sums its own run of tiles
BLOCK = 2048             # elements per tile (8 per thread at 8 warps: a 16-byte vector of bf16)
NUM_WARPS = 8
ALIGNMENT = 128          # bytes: where the flags end and each half starts, so tiles load as 16-byte vectors


def flags_bytes(world_size: int) -> int:
    """Bytes at the front of each buffer for the flags: world_size x NUM_PROGRAMS int64, rounded up."""
    return _round_up(world_size * NUM_PROGRAMS * 8, ALIGNMENT)


def buffer_bytes(max_bytes: int, world_size: int) -> int:
    """Bytes of the symmetric buffer each rank allocates to sum messages of up to `max_bytes`: flags, then two
    halves of `max_bytes` rounded up to ALIGNMENT."""
    return flags_bytes(world_size) + 2 * _round_up(max_bytes, ALIGNMENT)


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@triton.jit
def _data(buffer_ptrs, rank, half_offset, like_ptr):
    """Rank `rank`'s current half as a pointer of `like_ptr`'s type, 16-byte aligned (the host checks the
    buffers; the hint lets the tiles load as vectors)."""
    address = tl.load(buffer_ptrs + rank) + half_offset
    return tl.multiple_of(address.to(tl.pointer_type(like_ptr.dtype.element_ty)), 16)


@triton.jit
def _flags(buffer_ptrs, rank):
    return tl.load(buffer_ptrs + rank).to(tl.pointer_type(tl.int64))


@triton.jit(do_not_specialize=["tiles_per_program"])
def _one_shot_all_reduce_kernel(x_ptr, out_ptr, buffer_ptrs, epochs_ptr, n, tiles_per_program, half_bytes,
                                FLAGS_BYTES: tl.constexpr, RANK: tl.constexpr, WORLD_SIZE: tl.constexpr,
                                BLOCK: tl.constexpr):
    """Semantics (every rank r runs it on its own x_r, the same n on every rank):
        out[i] = round(sum_{r in 0..WORLD_SIZE-1, in order} float32(x_r[i]))   for i < n

    Grid: NUM_PROGRAMS programs; program p owns tiles [p*tiles_per_program, (p+1)*tiles_per_program) of BLOCK
    elements (those past n masked off). Per program p, e = epochs[p] + 1 (this call's epoch), h = half e mod 2:
        buffer[RANK].half[h][my tiles] = x                       # staged, this rank's memory
        block barrier
        for every peer q: buffer[q].flags[RANK, p] = e           # release, system scope
        for every peer q: spin until buffer[RANK].flags[q, p] >= e   # acquire, system scope
        block barrier
        out[my tiles] = sum over r in rank order of (x if r == RANK else buffer[r].half[h][my tiles])
        epochs[p] = e
    out may be x itself (each element is read before it is written, by the same program).
    """
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    epoch = tl.load(epochs_ptr + pid, volatile=True) + 1
    half_offset = FLAGS_BYTES + (epoch % 2) * half_bytes
    first = pid * tiles_per_program
    end = tl.minimum(first + tiles_per_program, tl.cdiv(n, BLOCK))
    staged = _data(buffer_ptrs, RANK, half_offset, x_ptr)
    for tile in range(first, end):
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(staged + offs, tl.load(x_ptr + offs, mask=mask), mask=mask)
    tl.debug_barrier()
    for peer in tl.static_range(WORLD_SIZE):
        if peer != RANK:
            tl.atomic_xchg(_flags(buffer_ptrs, peer) + RANK * num_programs + pid, epoch, sem="release", scope="sys")
    my_flags = _flags(buffer_ptrs, RANK)
    for peer in tl.static_range(WORLD_SIZE):
        if peer != RANK:
            while tl.atomic_add(my_flags + peer * num_programs + pid, 0, sem="acquire", scope="sys") < epoch:
                pass
    tl.debug_barrier()
    for tile in range(first, end):
        offs = tile * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for r in tl.static_range(WORLD_SIZE):
            if r == RANK:
                acc += tl.load(x_ptr + offs, mask=mask).to(tl.float32)
            else:
                peer_half = _data(buffer_ptrs, r, half_offset, x_ptr)
                acc += tl.load(peer_half + offs, mask=mask, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(epochs_ptr + pid, epoch)


class OneShotAllReduce:
    """This rank's side of the kernel: the peers' buffer pointers and the epoch counters, on the device.

    `buffer_ptrs[r]`: rank r's buffer (`buffer_bytes(max_bytes, world_size)` bytes, 16-byte aligned) as this
    process addresses it; `buffer_ptrs[rank]` is `buffer`, this rank's own. Construction zeroes this rank's flags
    and waits for it: every rank must construct its side before any rank's first call (a collective after it
    does; distributed/all_reduce.py)."""

    def __init__(self, buffer: torch.Tensor, buffer_ptrs: list[int], rank: int, max_bytes: int):
        world_size = len(buffer_ptrs)
        if buffer.numel() * buffer.element_size() < buffer_bytes(max_bytes, world_size):
            raise ValueError(f"the symmetric buffer holds {buffer.numel() * buffer.element_size()} bytes; "
                             f"{buffer_bytes(max_bytes, world_size)} are needed for messages of {max_bytes}")
        if buffer_ptrs[rank] != buffer.data_ptr() or any(p % 16 for p in buffer_ptrs):
            raise ValueError("buffer_ptrs[rank] must be this rank's buffer and every buffer 16-byte aligned")
        self.rank = rank
        self.world_size = world_size
        self.max_bytes = max_bytes
        self.half_bytes = _round_up(max_bytes, ALIGNMENT)
        self.buffer_ptrs = torch.tensor(buffer_ptrs, dtype=torch.int64, device=buffer.device)   # [world_size]
        self.epochs = torch.zeros(NUM_PROGRAMS, dtype=torch.int64, device=buffer.device)  # [NUM_PROGRAMS] calls so far
        buffer.view(torch.uint8)[:flags_bytes(world_size)].zero_()
        if buffer.is_cuda:
            torch.cuda.synchronize(buffer.device)

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out = x summed over the ranks (every rank calls with the same shape and dtype); x, out contiguous, of
        at most max_bytes; out may be x. Returns out."""
        n = x.numel()
        if not (x.is_contiguous() and out.is_contiguous() and out.shape == x.shape and out.dtype == x.dtype):
            raise ValueError("the one-shot kernel sums a contiguous x into a contiguous out of its shape and dtype")
        if n * x.element_size() > self.max_bytes:
            raise ValueError(f"a message of {n * x.element_size()} bytes exceeds the buffer's {self.max_bytes}")
        tiles_per_program = triton.cdiv(triton.cdiv(n, BLOCK), NUM_PROGRAMS)
        _one_shot_all_reduce_kernel[(NUM_PROGRAMS,)](
            x, out, self.buffer_ptrs, self.epochs, n, tiles_per_program, self.half_bytes,
            FLAGS_BYTES=flags_bytes(self.world_size), RANK=self.rank, WORLD_SIZE=self.world_size, BLOCK=BLOCK,
            num_warps=NUM_WARPS)
        return out


def reference(inputs: list[torch.Tensor]) -> torch.Tensor:
    """The kernel's result from every rank's input (`inputs[r]`: rank r's x): the float32 sum in rank order,
    rounded once to x's dtype."""
    total = torch.zeros(inputs[0].shape, dtype=torch.float32, device=inputs[0].device)
    for x in inputs:
        total += x.float()
    return total.to(inputs[0].dtype)
