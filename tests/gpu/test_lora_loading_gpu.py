"""Adapter loads on the GPU: copies on the side stream change no token, and steps with copies in flight
make no host-device sync."""
from __future__ import annotations

import pytest
import torch

from tests.hf_fixtures import ADAPTERS, adapter_dir
from worker.lora.adapter import inspect_adapter, read_adapter
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams

pytestmark = pytest.mark.gpu
ROWS = [(7, None), (23, "r4-qv"), (5, "r8-all"), (11, "r16-mlp-rs"), (17, "r8-all"), (9, "r4-qv"), (13, None)]


def make_engine(model_dir, device: str, dtype: str, overlap: bool, enforce_eager: bool = True,
                max_num_seqs: int = 4) -> Engine:
    engine = Engine(WorkerConfig(
        ModelConfig(str(model_dir), dtype=dtype), cache=CacheConfig(num_gpu_blocks_override=256),
        lora=LoRAConfig(max_loras=2, enable_lora_overlap_loading=overlap),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        device=device, enforce_eager=enforce_eager))
    for spec in ADAPTERS:
        engine.add_adapter(spec.name, str(adapter_dir(model_dir, spec.name)))
    return engine


def run(engine: Engine, tag: str = "r") -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(11)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    for i, (n, adapter) in enumerate(ROWS):
        engine.add_request(f"{tag}{i}", torch.randint(2, 320, (n,), generator=gen).tolist(), params, adapter)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "blocking"])
@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_fp32_tokens_equal_the_cpu_run_whatever_the_loading(hf_models, overlap, enforce_eager):
    """Three adapters through two slots: every request waits for, or evicts, some load."""
    llama = hf_models["llama"]
    expected = run(make_engine(llama, "cpu", "float32", overlap=True))
    assert run(make_engine(llama, "cuda", "float32", overlap, enforce_eager)) == expected


def test_bf16_tokens_are_the_same_with_overlap_on_and_off(hf_models):
    """One sequence per step, so both modes run the same steps and only when the copies run differs (beside
    the steps, or inside them): every bf16 token is the same. (With several sequences per step the modes batch
    requests differently, and a request's bf16 rounding may then depend on its step's row count: steps of 1-2
    rows take the GEMV, larger ones cuBLAS (or the skinny kernel). The fp32 test above covers that traffic.)"""
    llama = hf_models["llama"]
    runs = [run(make_engine(llama, "cuda", "bfloat16", overlap, enforce_eager=False, max_num_seqs=1))
            for overlap in (True, False)]
    assert runs[0] == runs[1]


def test_steps_make_no_sync_while_adapter_copies_are_in_flight(hf_models):
    engine = make_engine(hf_models["llama"], "cuda", "bfloat16", overlap=True, enforce_eager=False)
    run(engine, "warm")                      # compiles and captures
    for spec in ADAPTERS:                    # new versions: cold again, so the next run loads each of them
        engine.add_adapter(spec.name, str(adapter_dir(hf_models["llama"], spec.name)), load_inplace=True)
    loads_before = engine.lora_stats().gpu.loads
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(engine)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.lora_stats().gpu.loads - loads_before >= len(ADAPTERS)


def test_a_copy_waits_for_the_steps_that_read_its_slot_and_runs_beside_the_others(hf_models):
    """GPULoRAPool.start_load orders a copy after the latest step that read its slot (record_use), and
    after nothing else: a copy into a slot the step in flight does not read completes while that step
    still runs. The 'step' is a kernel held back by a device-side sleep, then reading slot 0."""
    engine = make_engine(hf_models["llama"], "cuda", "bfloat16", overlap=True)
    pool = engine.runner.lora_pool
    first = torch.full((pool.layout.num_bytes,), 1, dtype=torch.uint8).pin_memory()
    second = torch.full_like(first, 2).pin_memory()
    pool.start_load(0, first, 8, "first")
    pool.wait_for([0])
    pool.slots[0].sum(dtype=torch.int64)   # loads the reduction's kernel now: with CUDA's lazy module loading, a
    torch.cuda.synchronize()               # first launch behind the sleep below can hold the host until it ends
    pool.finished_loads()
    torch.cuda._sleep(200_000_000)                        # ~0.1 s of device time before the read
    seen = pool.slots[0].sum(dtype=torch.int64)           # the step in flight reads slot 0
    pool.record_use([0])
    pool.start_load(1, second, 8, "beside")               # slot 1: nobody reads it
    pool.start_load(0, second, 8, "after")                # slot 0: must wait for the read
    finished: list = []
    while "beside" not in [load.key for load in finished]:   # completes while the sleeping step still runs
        finished += pool.finished_loads()
    assert not torch.cuda.current_stream().query() and "after" not in [load.key for load in finished]
    torch.cuda.synchronize()
    assert seen.item() == pool.layout.num_bytes           # the read saw the first adapter's bytes, all ones
    assert bool((pool.slots[0] == 2).all()) and bool((pool.slots[1] == 2).all())


def test_entries_are_page_locked_at_their_own_size_and_land_in_their_slot_as_packed(hf_models):
    """The host cache's entries (each adapter at its own rank and projections, in memory page-locked with
    cudaHostRegister) written into a GPU slot by one copy and the device-side layout (lora/expansion.py) equal the
    whole slot packed on the CPU, byte for byte; a slot that held a larger adapter keeps nothing of it."""
    llama = hf_models["llama"]
    engine = make_engine(llama, "cuda", "float32", overlap=True)
    pool, packer = engine.runner.lora_pool, engine.adapters.packer
    for spec in sorted(ADAPTERS, key=lambda a: -a.r):
        path = str(adapter_dir(llama, spec.name))
        found = inspect_adapter(spec.name, path, pool.layout.targets, pool.max_rank)
        entry = packer(found)
        assert entry.packed.is_pinned() and entry.packed.numel() == packer.entry_bytes(found) <= pool.layout.num_bytes
        pool.start_load(0, entry.packed, entry.rank, spec.name, entry.layout)
        pool.wait_for([0])
        want = pool.layout.pack(read_adapter(spec.name, path, pool.layout.targets, pool.max_rank, torch.float32))
        assert torch.equal(pool.slots[0].cpu(), want), spec.name
    assert packer.buffers.registered_bytes > 0
