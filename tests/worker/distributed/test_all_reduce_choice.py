"""The host side of the tensor-parallel all-reduce, on the CPU: which messages take the one-shot path
(worker/distributed/all_reduce.py), that KernelConfig names no one-shot kernel to choose, that nothing CUDA-only
is imported with it (nor by joining a gloo group), and that
`TensorParallel.all_reduce` is unchanged at world size 1 and over gloo (2 ranks spawned with torch.multiprocessing,
MASTER_ADDR=127.0.0.1) unless a fast all-reduce is attached, whose result it then returns."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.worker.distributed.tp_ranks import free_port
from worker.config import KernelConfig
from worker.distributed.all_reduce import AllReduce, one_shot_fits
from worker.distributed.tensor_parallel import SINGLE, init_tensor_parallel

ROOT = Path(__file__).resolve().parents[3]
MiB = 1 << 20


@pytest.mark.parametrize("nbytes, dtype, threshold, expected", [
    (1 * 4096 * 2, torch.bfloat16, MiB, True),          # one decode row of Llama-8B
    (128 * 4096 * 2, torch.bfloat16, MiB, True),        # exactly at the threshold
    (128 * 4096 * 2 + 4, torch.bfloat16, MiB, False),   # one vector past it
    (512 * 8192 * 2, torch.bfloat16, 4 * MiB, False),
    (256 * 4096 * 4, torch.float32, 4 * MiB, True),
    (4096 * 2, torch.float16, MiB, False),              # one-shot for the dtypes run on two GPUs: bf16, float32
    (4095 * 2, torch.bfloat16, MiB, False),             # not a whole number of 4-byte vectors
    (4096 * 8, torch.float64, MiB, False),              # a float32 sum would round it: NCCL
    (4096 * 4, torch.int32, MiB, False),
    (0, torch.bfloat16, MiB, False),
    (4096 * 2, torch.bfloat16, 0, False),               # threshold 0: every message through NCCL
])
def test_one_shot_only_for_small_messages_of_a_summable_dtype(nbytes, dtype, threshold, expected):
    assert one_shot_fits(nbytes, dtype, threshold) is expected


def test_all_reduce_refuses_a_cpu_device():
    with pytest.raises(ValueError, match="CUDA"):
        AllReduce(None, torch.device("cpu"))


def test_the_one_shot_kernel_is_not_a_choice():
    """One kernel sums one-shot messages (kernels/one_shot_all_reduce.py); KernelConfig sets only the size."""
    assert [f.name for f in dataclasses.fields(KernelConfig) if "all_reduce" in f.name] == ["one_shot_all_reduce_bytes"]
    with pytest.raises(TypeError):
        AllReduce(None, torch.device("cuda", 0), kernel="triton")


def test_joining_a_gloo_group_imports_no_triton():
    """Both ranks of a CPU group, each a fresh interpreter: join_group returns the plain group (no fast
    all-reduce) and neither Triton nor symmetric memory is imported."""
    code = ("import sys, torch; from worker.ranks.group import join_group; "
            "tp = join_group({rank}, 2, 'tcp://127.0.0.1:{port}', torch.device('cpu'), 4 << 20); "
            "assert tp.fast_all_reduce is None; torch.distributed.destroy_process_group(); "
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith(('triton.', "
            "'torch.distributed._symmetric_memory'))))")
    port = free_port()
    ranks = [subprocess.Popen([sys.executable, "-c", code.format(rank=rank, port=port)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], [err for _, err in outputs]
    assert [out.strip() for out, _ in outputs] == ["[]", "[]"]


def test_importing_it_imports_neither_triton_nor_symmetric_memory():
    code = ("import sys, worker.distributed.all_reduce, worker.distributed.tensor_parallel; "
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith(('triton.', "
            "'torch.distributed._symmetric_memory'))))")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_world_size_1_returns_its_input_untouched_and_never_calls_the_fast_path():
    calls = []
    tp = dataclasses.replace(SINGLE, fast_all_reduce=lambda x: calls.append(x) or x * 0)
    x = torch.arange(6.0).reshape(2, 3)
    for t in (SINGLE, tp):
        assert t.all_reduce(x) is x
    assert torch.equal(x, torch.arange(6.0).reshape(2, 3)) and calls == []
    assert tp == SINGLE                      # the attached callable is no part of the group's identity


def gloo_rank(rank: int, port: int) -> None:
    """Entry point of a spawned rank: the plain all-reduce sums in place; an attached one is used instead."""
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    tp = init_tensor_parallel(rank, 2, "gloo", f"tcp://127.0.0.1:{port}")
    try:
        x = torch.full((2, 3), rank + 1.0)
        assert tp.all_reduce(x) is x and torch.equal(x, torch.full((2, 3), 3.0))

        calls = []

        def summed_copy(t: torch.Tensor) -> torch.Tensor:
            calls.append(tuple(t.shape))
            out = t.clone()
            dist.all_reduce(out, group=tp.group)
            return out

        fast = dataclasses.replace(tp, fast_all_reduce=summed_copy)
        x = torch.full((4, 5), rank + 1.0)
        y = fast.all_reduce(x)
        assert calls == [(4, 5)]
        assert torch.equal(y, torch.full((4, 5), 3.0)) and torch.equal(x, torch.full((4, 5), rank + 1.0))
        assert (fast.rank, fast.world_size, fast.group) == (tp.rank, tp.world_size, tp.group)
    finally:
        dist.destroy_process_group()


def test_gloo_all_reduce_is_unchanged_unless_a_fast_one_is_attached():
    mp.spawn(gloo_rank, args=(free_port(),), nprocs=2, join=True)

