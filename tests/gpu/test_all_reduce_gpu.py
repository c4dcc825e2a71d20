"""The one-shot all-reduce (worker/distributed/all_reduce.py, summed by kernels/one_shot_all_reduce.py's Triton kernel)
on 2 GPUs: 2 ranks spawned with torch.multiprocessing (MASTER_ADDR=127.0.0.1, NVLink multicast off), each summing
the same per-rank inputs through `AllReduce` and through NCCL, eagerly and replayed from a CUDA graph with new
inputs copied in between; and a graph of CHAIN_CALLS calls back to back (two chains of different sizes, interleaved,
each call summing the previous call's sum), replayed CHAIN_REPLAYS times, which takes the Triton kernel's epochs and
buffer halves round many times.

float32: within 1e-6 of NCCL's sum; bf16: the same bits on both ranks, within one rounding to the dtype
of the float32 sum (TOLERANCES).
[512, 8192] is over the threshold and goes through NCCL, every smaller shape through one-shot."""
from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.all_reduce import capture
from worker.distributed.all_reduce import AllReduce

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

WORLD_SIZE = 2
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SHAPES = ((1, 4096), (7, 4096), (32, 4096), (256, 4096), (512, 8192))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
THRESHOLD = 4 << 20        # [256, 4096] float32 (4 MiB) still one-shot; [512, 8192] bf16 (8 MiB) NCCL
REPLAYS = 3                # graph replays, each with new inputs
SCALES = (1, 2, 4)         # one graph holds a call per scale, back to back (powers of two: exact in bf16)
TIMEOUT_S = 420            # a rank stuck in a barrier fails the test instead of hanging it
BF16_RTOL = 2 ** -8 + 2 ** -20   # one rounding to bf16 (unit roundoff 2^-8), over a float32 reference
# dtype -> (rtol, atol) of a sum against the float32 sum of the same inputs
TOLERANCES = {torch.float32: (1e-6, 0.0), torch.bfloat16: (BF16_RTOL, 0.0)}
CHAIN_SHAPES = ((1, 4096), (256, 4096))   # 2 tiles of the Triton kernel (most programs idle), and 512 tiles
CHAIN_CALLS = 16           # calls per chain in one graph: call i returns 2^i times the first sum (exact doublings)
CHAIN_REPLAYS = 8


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_input(rank: int, shape: tuple[int, int], dtype: torch.dtype, draw: int) -> torch.Tensor:
    """Rank `rank`'s input of draw `draw` (0: eager, 1..: graph replays), on the CPU, the same in every process."""
    g = torch.Generator().manual_seed(1000 * draw + 100 * rank + SHAPES.index(shape))
    return torch.randn(shape, generator=g).to(dtype)


def reference(shape: tuple[int, int], dtype: torch.dtype, draw: int, scale: int = 1) -> torch.Tensor:
    """The float32 sum over the ranks of their `dtype` inputs times `scale`."""
    return sum(rank_input(r, shape, dtype, draw).float() * scale for r in range(WORLD_SIZE))


def run_rank(rank: int, port: int, out_dir: str) -> None:
    """Entry point of a spawned rank: saves {key: tensor or flag} to out_dir/rank{rank}.pt."""
    os.environ.update(MULTICAST_OFF, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE)
    try:
        dist.all_reduce(torch.zeros(1, device=device))          # NCCL's communicator, before any capture
        ar = AllReduce(dist.group.WORLD, device, max_bytes=THRESHOLD, threshold_bytes=THRESHOLD)
        results = {"available": ar.buffer is not None}
        for name, dtype in DTYPES.items():
            for shape in SHAPES:
                x = rank_input(rank, shape, dtype, 0).to(device)
                nccl = x.clone()
                dist.all_reduce(nccl)
                results[name, shape, "eager"] = ar(x.clone()).cpu()
                results[name, shape, "nccl"] = nccl.cpu()
                results[name, shape, "one_shot"] = ar.uses_one_shot(x)
                results.update(graph_results(ar, rank, shape, dtype, (name,), device))
            results.update(chain_results(ar, rank, dtype, (name,), device))
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def graph_results(ar: AllReduce, rank: int, shape: tuple[int, int], dtype: torch.dtype, key: tuple,
                  device: torch.device) -> dict:
    """One CUDA graph of a call per scale (each on x * scale), replayed REPLAYS times, new x copied in before each."""
    x = torch.zeros(shape, dtype=dtype, device=device)
    outs: list[torch.Tensor] = []

    def calls():
        outs[:] = [ar(x * scale) for scale in SCALES]

    graph = capture(calls)
    results = {}
    for replay in range(1, REPLAYS + 1):
        x.copy_(rank_input(rank, shape, dtype, replay))
        graph.replay()
        for scale, out in zip(SCALES, outs):
            results[(*key, shape, "graph", replay, scale)] = out.cpu()
    return results


def chain_results(ar: AllReduce, rank: int, dtype: torch.dtype, key: tuple, device: torch.device) -> dict:
    """One CUDA graph of CHAIN_CALLS calls per shape of CHAIN_SHAPES, the two chains interleaved, each call on a
    copy of its chain's previous sum; replayed CHAIN_REPLAYS times with new inputs. Keeps every call's sum."""
    xs = [torch.zeros(shape, dtype=dtype, device=device) for shape in CHAIN_SHAPES]
    sums: list[list[torch.Tensor]] = []

    def calls():
        sums[:] = [[x] for x in xs]
        for _ in range(CHAIN_CALLS):
            for chain in sums:
                chain.append(ar(chain[-1].clone()))

    graph = capture(calls)
    results = {}
    for replay in range(1, CHAIN_REPLAYS + 1):
        for x, shape in zip(xs, CHAIN_SHAPES):
            x.copy_(rank_input(rank, shape, dtype, replay))
        graph.replay()
        for shape, chain in zip(CHAIN_SHAPES, sums):
            results[(*key, shape, "chain", replay)] = torch.stack([s.cpu() for s in chain[1:]])
    return results


def join_within(context: mp.ProcessContext, timeout_s: float) -> bool:
    """Whether every spawned process ended within `timeout_s` (a rank that raised re-raises here)."""
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            return False
    return True


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """Each rank's results, the 2 ranks run once for the module."""
    out_dir = tmp_path_factory.mktemp("all_reduce")
    with pytest.MonkeyPatch.context() as env:
        for key, value in MULTICAST_OFF.items():
            env.setenv(key, value)
        context = mp.spawn(run_rank, args=(free_port(), str(out_dir)), nprocs=WORLD_SIZE, join=False)
        if not join_within(context, TIMEOUT_S):
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish in {TIMEOUT_S} s (a one-shot barrier never met?)")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD_SIZE)]


def assert_sum(result: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    """float32: within 1e-6 relative of `expected`; bf16: within one rounding to the dtype of the
    float32 `expected` (TOLERANCES)."""
    assert result.dtype == dtype and result.shape == expected.shape, what
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(result.float(), expected.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def test_the_one_shot_kernel_is_available(ranks):
    assert [r["available"] for r in ranks] == [True] * WORLD_SIZE


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", DTYPES)
def test_path_is_chosen_by_message_size(ranks, name, shape):
    expected = shape[0] * shape[1] * DTYPES[name].itemsize <= THRESHOLD
    assert [r[name, shape, "one_shot"] for r in ranks] == [expected] * WORLD_SIZE


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", DTYPES)
def test_eager_sum_equals_nccl(ranks, name, shape):
    dtype = DTYPES[name]
    expected = reference(shape, dtype, 0)
    for rank, r in enumerate(ranks):
        nccl = r[name, shape, "nccl"]
        assert_sum(nccl, expected, dtype, f"rank {rank} NCCL")          # the reference itself checked
        assert_sum(r[name, shape, "eager"], nccl.float() if dtype == torch.float32 else expected, dtype,
                   f"rank {rank} eager")
    assert torch.equal(ranks[0][name, shape, "eager"], ranks[1][name, shape, "eager"]), "ranks differ"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", DTYPES)
def test_graph_replays_sum_the_inputs_copied_in_before_each(ranks, name, shape):
    dtype = DTYPES[name]
    for replay in range(1, REPLAYS + 1):
        for scale in SCALES:
            key = (name, shape, "graph", replay, scale)
            expected = reference(shape, dtype, replay, scale)
            for rank, r in enumerate(ranks):
                assert_sum(r[key], expected, dtype, f"rank {rank} replay {replay} scale {scale}")
            assert torch.equal(ranks[0][key], ranks[1][key]), f"ranks differ at replay {replay} scale {scale}"
    first, second = (ranks[0][name, shape, "graph", replay, 1] for replay in (1, 2))
    assert not torch.equal(first, second), "a replay returned the previous replay's sum"


@pytest.mark.parametrize("shape", CHAIN_SHAPES)
@pytest.mark.parametrize("name", DTYPES)
def test_back_to_back_calls_in_a_graph_replayed_many_times_each_sum_the_last(ranks, name, shape):
    """Call i of a chain sums 2 copies of call i-1's sum: 2^i times the first sum, bit for bit (doublings are
    exact), the first within one rounding of the float32 reference."""
    dtype = DTYPES[name]
    for replay in range(1, CHAIN_REPLAYS + 1):
        key = (name, shape, "chain", replay)
        for rank, r in enumerate(ranks):
            chain = r[key]                                   # [CHAIN_CALLS, *shape]
            assert_sum(chain[0], reference(shape, dtype, replay), dtype, f"rank {rank} replay {replay} call 0")
            for i in range(1, CHAIN_CALLS):
                assert torch.equal(chain[i], chain[0] * 2 ** i), f"rank {rank} replay {replay} call {i}"
        assert torch.equal(ranks[0][key], ranks[1][key]), f"ranks differ at replay {replay}"
