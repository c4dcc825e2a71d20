"""The one-shot all-reduce (worker/distributed/all_reduce.py) on 2 GPUs: 2 ranks spawned with
torch.multiprocessing (MASTER_ADDR=127.0.0.1, NVLink multicast off), each summing the same per-rank inputs
through `AllReduce` and through NCCL, eagerly and replayed from a CUDA graph with new inputs copied in between.

float32: within 1e-6 of NCCL's sum; bf16: the same bits on both ranks, within bf16 rounding of the float32 sum.
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

from worker.distributed.all_reduce import AllReduce

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

WORLD_SIZE = 2
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
SHAPES = ((1, 4096), (7, 4096), (32, 4096), (256, 4096), (512, 8192))
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
THRESHOLD = 4 << 20        # [256, 4096] float32 (4 MiB) still one-shot; [512, 8192] bf16 (8 MiB) NCCL
REPLAYS = 3                # graph replays, each with new inputs
SCALES = (1, 2, 4)         # one graph holds a call per scale, back to back (powers of two: exact in bf16)
TIMEOUT_S = 300            # a rank stuck in a barrier fails the test instead of hanging it
BF16_RTOL = 2 ** -8 + 2 ** -20   # one rounding to bf16 (unit roundoff 2^-8), over a float32 reference


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
        results = {}
        for name, dtype in DTYPES.items():
            for shape in SHAPES:
                x = rank_input(rank, shape, dtype, 0).to(device)
                nccl = x.clone()
                dist.all_reduce(nccl)
                results[name, shape, "eager"] = ar(x.clone()).cpu()
                results[name, shape, "nccl"] = nccl.cpu()
                results[name, shape, "one_shot"] = ar.uses_one_shot(x)
                results.update(graph_results(ar, rank, shape, dtype, name, device))
        torch.cuda.synchronize()
        dist.barrier(device_ids=[rank])
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def graph_results(ar: AllReduce, rank: int, shape: tuple[int, int], dtype: torch.dtype, name: str,
                  device: torch.device) -> dict:
    """One CUDA graph of a call per scale (each on x * scale), replayed REPLAYS times, new x copied in before each."""
    x = torch.zeros(shape, dtype=dtype, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for scale in SCALES:                                   # warm-up outside the capture
            ar(x * scale)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [ar(x * scale) for scale in SCALES]
    results = {}
    for replay in range(1, REPLAYS + 1):
        x.copy_(rank_input(rank, shape, dtype, replay))
        graph.replay()
        for scale, out in zip(SCALES, outs):
            results[name, shape, "graph", replay, scale] = out.cpu()
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
    """float32: within 1e-6 relative of `expected`; bf16: within one bf16 rounding of the float32 `expected`."""
    assert result.dtype == dtype and result.shape == expected.shape, what
    rtol = 1e-6 if dtype == torch.float32 else BF16_RTOL
    torch.testing.assert_close(result.float(), expected.float(), rtol=rtol, atol=0, msg=lambda m: f"{what}: {m}")


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
