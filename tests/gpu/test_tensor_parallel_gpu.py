"""Tensor parallelism on two GPUs (NCCL; skipped with fewer): the engine at --tensor-parallel-size 2 gives the
tokens of the single-process run, eager and with CUDA graphs (collectives captured), with adapters mixed in the
batch and more adapters than slots, LoRA sharded as by default and fully sharded; its steps make no host-device
sync.

Each tensor-parallel engine runs in a process of its own (`in_process`), as a server does: one process group per
process (a second group in one process cannot rendezvous symmetric memory again).

Sharding changes the order of the sums, so two runs may part where a request's two best tokens are (nearly)
tied; `assert_same_or_tied` accepts a parting only there and compares nothing after it."""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import signal
import sys
import tempfile
import time
import traceback

import psutil
import pytest
import torch

from tests.gpu.test_lora_loading_gpu import ROWS
from tests.hf_fixtures import ADAPTERS, adapter_dir
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]
for _name, _value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                      ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_name, _value)          # multicast stays off, in every process started from here
TIE = 1e-3        # logprob margin under which two tokens count as tied
SYNC_DEBUG_SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sync_debug_site")


def make_engine(model_dir, device: str, dtype: str, tp: int, enforce_eager: bool = True,
                max_num_seqs: int = 4, fully_sharded_loras: bool = False) -> Engine:
    engine = Engine(WorkerConfig(
        ModelConfig(str(model_dir), dtype=dtype), cache=CacheConfig(num_gpu_blocks_override=256),
        lora=LoRAConfig(max_loras=2, fully_sharded_loras=fully_sharded_loras),
        # a 128-token budget: 16 graphs to capture instead of 88 (ROWS' prompts take 85 tokens)
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=128),
        device=device, enforce_eager=enforce_eager, tensor_parallel_size=tp))
    for spec in ADAPTERS:
        engine.add_adapter(spec.name, str(adapter_dir(model_dir, spec.name)))
    return engine


def run(engine: Engine, tag: str = "r") -> dict[str, list]:
    """Request id -> [(token, {top token: logprob})] of 16 greedy steps over ROWS."""
    gen = torch.Generator().manual_seed(11)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
    for i, (n, adapter) in enumerate(ROWS):
        engine.add_request(f"{tag}{i}", torch.randint(2, 320, (n,), generator=gen).tolist(), params, adapter)
    steps: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            for token, lp in zip(out.new_token_ids, out.new_logprobs or [None] * len(out.new_token_ids)):
                steps.setdefault(out.request_id, []).append((token, dict(lp.top) if lp else {}))
    return steps


def tp2_run(model_dir, dtype: str, enforce_eager: bool, max_num_seqs: int = 4, no_sync: bool = False,
            fully_sharded_loras: bool = False) -> dict:
    """One TP=2 engine's run (in its own process): ROWS as `run` gives them; with `no_sync`, a warm-up run first,
    then the measured run under torch's sync debug mode set to error on every rank."""
    if no_sync:     # the follower ranks start with SYNC_DEBUG_SITE on their path: SIGUSR2 sets their mode
        os.environ["LORAPLEX_TEST_SYNC_DEBUG_DIR"] = tempfile.mkdtemp(prefix="sync-debug-")
        sys.path.insert(0, SYNC_DEBUG_SITE)
    engine = make_engine(model_dir, "cuda", dtype, 2, enforce_eager, max_num_seqs, fully_sharded_loras)
    try:
        if not no_sync:
            return run(engine)
        run(engine, "warm")
        torch.cuda.set_sync_debug_mode("error")
        followers_error_on_sync()
        try:
            return run(engine)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        engine.followers.close()


def followers_error_on_sync(timeout_s: float = 60.0) -> None:
    """Set torch's sync debug mode to "error" in this process's follower ranks (sync_debug_site/sitecustomize.py),
    waiting until each says it did."""
    folder = os.environ["LORAPLEX_TEST_SYNC_DEBUG_DIR"]
    followers = signal_followers(os.getpid(), signal.SIGUSR2)
    assert len(followers) == 1, followers                  # TP=2: one follower rank
    paths = [os.path.join(folder, str(pid)) for pid in followers]
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(path) for path in paths):
        assert time.monotonic() < deadline, f"a follower rank did not set its sync debug mode in {timeout_s} s"
        time.sleep(0.01)
    for path in paths:
        with open(path) as f:
            result = f.read()
        assert result == "ok", f"follower {os.path.basename(path)}: {result}"


def _call(conn, fn, args, dump_after: float) -> None:
    faulthandler.dump_traceback_later(dump_after)        # a hang shows where rank 0 waits (stderr)
    try:
        conn.send(("ok", fn(*args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()


IN_PROCESS_TIMEOUT_S = float(os.environ.get("TP_TEST_TIMEOUT_S", 150))


def signal_followers(pid: int, signum: int) -> list[int]:
    """Send `signum` to the follower ranks started under process `pid` (its descendants running
    worker.ranks.follower), and to no other process on the host; their process ids."""
    signalled = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            if "worker.ranks.follower" in child.cmdline():
                child.send_signal(signum)
                signalled.append(child.pid)
        except psutil.NoSuchProcess:
            pass                # exited meanwhile
    return signalled


def in_process(fn, *args, timeout: float = IN_PROCESS_TIMEOUT_S):
    """fn(*args) in a fresh spawned process; its result, or its traceback as a failure. A run that hangs has
    rank 0's stacks dumped to stderr shortly before the timeout, and the followers' (SIGUSR1) at it: run pytest
    with -s, or its capture holds them, and lost if an outer timeout kills pytest first (TP_TEST_TIMEOUT_S
    shortens the wait)."""
    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_call, args=(theirs, fn, args, max(timeout - 10, timeout / 2)))
    proc.start()
    theirs.close()
    try:
        if not ours.poll(timeout):
            signal_followers(proc.pid, signal.SIGUSR1)
            time.sleep(2)
            pytest.fail(f"{fn.__name__} gave no result in {timeout} s (stacks on stderr)")
        status, value = ours.recv()
    except EOFError:
        pytest.fail(f"{fn.__name__}'s process exited with code {proc.join(30) or proc.exitcode}")
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert status == "ok", value
    return value


def assert_same_or_tied(got: dict[str, list], expected: dict[str, list]) -> None:
    assert got.keys() == expected.keys()
    parted = 0
    for rid, ref in expected.items():
        tokens, ref_tokens = [t for t, _ in got[rid]], [t for t, _ in ref]
        assert len(tokens) == len(ref_tokens)
        for i, (a, b) in enumerate(zip(tokens, ref_tokens)):
            if a != b:
                top = ref[i][1]
                assert b in top and a in top and abs(top[a] - top[b]) < TIE, \
                    f"{rid} parts at step {i} ({a} vs {b}) where the tokens are not tied: {top}"
                parted += 1
                break
    assert parted <= len(expected) // 3, f"{parted} of {len(expected)} requests parted at ties"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_fp32_tp2_tokens_equal_the_single_process_run(hf_models, arch, enforce_eager):
    model = hf_models[arch]
    expected = run(make_engine(model, "cpu", "float32", 1))
    assert_same_or_tied(in_process(tp2_run, model, "float32", enforce_eager), expected)


def test_bf16_tp2_graphs_equal_tp2_eager_one_sequence_at_a_time(hf_models):
    """One sequence per step: the graphs (collectives captured) compute what the eager steps compute."""
    eager, graphs = (in_process(tp2_run, hf_models["llama"], "bfloat16", e, 1) for e in (True, False))
    assert [[t for t, _ in v] for v in graphs.values()] == [[t for t, _ in v] for v in eager.values()]


@pytest.mark.parametrize("fully_sharded", [False, True], ids=["default-lora", "fully-sharded-lora"])
def test_tp2_steps_make_no_host_device_sync(hf_models, fully_sharded):
    tokens = in_process(tp2_run, hf_models["llama"], "bfloat16", False, 4, True, fully_sharded)
    assert len(tokens) == len(ROWS)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_fp32_tp2_fully_sharded_loras_tokens_equal_the_single_process_run(hf_models, arch, enforce_eager):
    """--fully-sharded-loras: xa gathered (qkv, gate_up) and summed (o, down) between shrink and expand, in the
    graphs too."""
    model = hf_models[arch]
    expected = run(make_engine(model, "cpu", "float32", 1))
    assert_same_or_tied(in_process(tp2_run, model, "float32", enforce_eager, 4, False, True), expected)
