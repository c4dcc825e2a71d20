"""Late launch on a GPU (worker/launch_pacer.py): steps made device-bound (a spin kernel of SPIN_MS behind each
launch) are paced once their durations are known, every paced launch still queues behind the step before it, the
wait stays below one step, and the tokens are those of unpaced steps."""
from __future__ import annotations

import functools
import statistics
import time
from collections import defaultdict

import pytest
import torch

from tests.hf_fixtures import ADAPTERS, adapter_dir
from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams

pytestmark = pytest.mark.gpu
SPIN_MS = 5.0
MAX_PACED_PERIOD_RATIO = 1.25     # a paced run's mean step period over an unpaced run's
ROWS = [(7, None), (23, "r4-qv"), (5, "r8-all"), (40, None), (11, "r16-mlp-rs")]


def make_engine(model_dir, late_launch: bool) -> Engine:
    engine = Engine(WorkerConfig(
        ModelConfig(str(model_dir), dtype="bfloat16"), cache=CacheConfig(num_gpu_blocks_override=512),
        lora=LoRAConfig(max_loras=4, max_lora_rank=16, enable_lora_overlap_loading=False),
        scheduler=SchedulerConfig(max_num_seqs=16), device="cuda", late_launch=late_launch))
    for spec in ADAPTERS:
        engine.add_adapter(spec.name, str(adapter_dir(model_dir, spec.name)))
    execute = engine.runner.execute
    cycles = spin_cycles(SPIN_MS)

    def slow_execute(batch, prev=None):       # a device-bound step, as a large model's
        handle = execute(batch, prev)
        torch.cuda._sleep(cycles)
        return handle
    engine.runner.execute = slow_execute
    return engine


@functools.cache
def spin_cycles(ms: float) -> int:
    """torch.cuda._sleep's argument for a spin of `ms` milliseconds on this device (measured once: both engines
    spin alike)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    return int(10**7 * ms / start.elapsed_time(end))


def serve(engine: Engine) -> tuple[dict[str, list[int]], list[float], list[float]]:
    """Tokens per request, and each launch_delay with the wall time of the step after it, as the worker loop
    (worker.__main__.Worker.serve) waits them."""
    gen = torch.Generator().manual_seed(3)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    for i, (n, adapter) in enumerate(ROWS):
        engine.add_request(f"r{i}", torch.randint(2, 320, (n,), generator=gen).tolist(), params, adapter)
    tokens, delays, periods = defaultdict(list), [], []
    last = time.monotonic()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        delay = engine.launch_delay()
        delays.append(delay)
        time.sleep(delay)
        now = time.monotonic()
        periods.append(now - last)
        last = now
    return tokens, delays, periods


def test_paced_steps_queue_behind_the_running_one_and_give_the_same_tokens(hf_models):
    expected, unpaced, steps = serve(make_engine(hf_models["llama"], late_launch=False))
    assert not any(unpaced)
    engine = make_engine(hf_models["llama"], late_launch=True)
    tokens, delays, periods = serve(engine)
    paced = [d for d in delays if d > 0]
    assert len(paced) > len(delays) // 2
    assert max(paced) < SPIN_MS * 1e-3
    summary = engine._pacer._summary
    # the device never waited for a launch (the pacer's own count, from the device's timings): the last delay has
    # no step after it
    assert summary._launches >= len(paced) - 1 and summary._late == 0
    # past the first steps, paced steps come about as often as unpaced ones: two runs' wall clocks on a shared host
    # differ by a few percent, a launch that waited out a whole extra step would add over half (a SPIN_MS step,
    # under SPIN_MS of delay)
    assert statistics.mean(periods[8:]) < MAX_PACED_PERIOD_RATIO * statistics.mean(steps[8:])
    assert tokens == expected
