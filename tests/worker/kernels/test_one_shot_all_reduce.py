"""kernels/one_shot_all_reduce.py, one rank's logic with two ranks simulated in one process: two buffers, and each
call of rank 0 made after rank 1's staging and flags are written by hand (what rank 1's kernel would have done
by then), then rank 1's call, which finds rank 0's flags written by rank 0's kernel. Each launch runs alone, so
no spin ever waits on a launch still to come. Under the Triton interpreter on the CPU (whose atomics ignore
scope; the system-scope ordering itself is checked on two GPUs by tests/gpu/test_all_reduce_gpu.py), compiled on
one GPU where there is one.

Checked against the float32 reference, exactly: the sum on both ranks, this call's half holding x (the previous
call's half untouched), the peer's flags holding the epoch, the epoch counters advancing by one per call."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.kernels import one_shot_all_reduce as k  # after TRITON_INTERPRET is set

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
WORLD_SIZE = 2
MAX_BYTES = 2 * k.NUM_PROGRAMS * k.BLOCK * 4      # two tiles per program in float32
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
NUMELS = (1, 3000, k.BLOCK * k.NUM_PROGRAMS + 5, MAX_BYTES // 4)   # one element, a tail, past one tile a program
CALLS = 3


class TwoRanks:
    """Both ranks' buffers and kernel sides in this process."""

    def __init__(self):
        nbytes = k.buffer_bytes(MAX_BYTES, WORLD_SIZE)
        self.buffers = [torch.full((nbytes,), 0xAB, dtype=torch.uint8, device=DEVICE) for _ in range(WORLD_SIZE)]
        ptrs = [b.data_ptr() for b in self.buffers]
        self.sides = [k.OneShotAllReduce(b, ptrs, rank, MAX_BYTES) for rank, b in enumerate(self.buffers)]

    def flags(self, rank: int) -> torch.Tensor:
        """[WORLD_SIZE, NUM_PROGRAMS] int64: rank's flags, row src written by rank src."""
        return self.buffers[rank][:k.flags_bytes(WORLD_SIZE)].view(torch.int64)[:WORLD_SIZE * k.NUM_PROGRAMS] \
            .view(WORLD_SIZE, k.NUM_PROGRAMS)

    def half(self, rank: int, epoch: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The half of rank's buffer that call `epoch` stages into, its first numel elements of dtype."""
        start = k.flags_bytes(WORLD_SIZE) + epoch % 2 * self.sides[rank].half_bytes
        return self.buffers[rank][start:start + numel * dtype.itemsize].view(dtype)


def draw(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("in_place", [False, True], ids=["out", "in_place"])
@pytest.mark.parametrize("numel", NUMELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_each_call_sums_both_ranks_through_alternating_halves(dtype, numel, in_place):
    ranks = TwoRanks()
    assert torch.equal(ranks.flags(0), torch.zeros_like(ranks.flags(0)))     # zeroed by the constructor
    for epoch in range(1, CALLS + 1):
        xs = [draw(numel, dtype, 10 * epoch + rank) for rank in range(WORLD_SIZE)]
        expected = k.reference(xs)
        ranks.half(1, epoch, dtype, numel).copy_(xs[1])          # rank 1 has staged and signalled
        ranks.flags(0)[1] = epoch
        outs = []
        for rank in range(WORLD_SIZE):
            x = xs[rank].clone()
            out = x if in_place else torch.empty_like(x)
            assert ranks.sides[rank](x, out) is out
            outs.append(out)
            if rank == 0:
                assert torch.equal(ranks.flags(1)[0], torch.full((k.NUM_PROGRAMS,), epoch, device=DEVICE))
                assert torch.equal(ranks.half(0, epoch, dtype, numel), xs[0])
        for rank, out in enumerate(outs):
            assert torch.equal(out, expected), f"rank {rank} call {epoch}"
            assert torch.equal(ranks.sides[rank].epochs, torch.full((k.NUM_PROGRAMS,), epoch, device=DEVICE))
        if epoch > 1:       # the other half still holds the previous call's staging
            previous = draw(numel, dtype, 10 * (epoch - 1))
            assert torch.equal(ranks.half(0, epoch - 1, dtype, numel), previous)


def test_reference_is_the_float32_sum_rounded_once():
    xs = [torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([2.0 ** -8], dtype=torch.bfloat16),
          torch.tensor([2.0 ** -8], dtype=torch.bfloat16)]
    # summed in bf16, 1 + 2^-8 rounds (to even) back to 1 twice; in float32 the sum 1 + 2^-7 is a bf16 number
    assert torch.equal(k.reference(xs), torch.tensor([1.0 + 2.0 ** -7], dtype=torch.bfloat16))


def test_a_buffer_too_small_for_two_halves_is_refused():
    buffer = torch.zeros(k.buffer_bytes(MAX_BYTES, WORLD_SIZE) - 1, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="bytes"):
        k.OneShotAllReduce(buffer, [buffer.data_ptr(), buffer.data_ptr()], 0, MAX_BYTES)


def test_a_message_past_max_bytes_is_refused():
    ranks = TwoRanks()
    x = torch.zeros(MAX_BYTES // 4 + 1, device=DEVICE)
    with pytest.raises(ValueError, match="exceeds"):
        ranks.sides[0](x, x)
