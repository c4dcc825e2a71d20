"""Engines over the tiny Llama for the adapter tests, stepped until done, and the greedy tokens of a request
run alone, which every output is checked against. Disk reads run inline (at submit) unless a test needs the
thread pool, so what happens in which step is deterministic."""
from __future__ import annotations

import concurrent.futures

import torch

from worker.config import CacheConfig, LoRAConfig, ModelConfig, SchedulerConfig, WorkerConfig
from worker.engine import Engine
from worker.ipc.messages import SamplingParams


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class InlineExecutor(concurrent.futures.Executor):
    """Runs each disk read when it is submitted; the engine still files it at its next poll."""

    def submit(self, fn, /, *args, **kwargs):
        future = concurrent.futures.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as e:
            future.set_exception(e)
        return future


class ManualExecutor(concurrent.futures.Executor):
    """Holds each read until the test runs it."""

    def __init__(self):
        self.held: list[tuple[concurrent.futures.Future, object, tuple]] = []

    def submit(self, fn, /, *args, **kwargs):
        future = concurrent.futures.Future()
        self.held.append((future, fn, args))
        return future

    def run_all(self):
        for future, fn, args in self.held:
            future.set_result(fn(*args))
        self.held = []


def make_engine(model_dir, adapters: dict[str, str] | None = None, *, overlap: bool = True, max_loras: int = 2,
                max_cpu_loras: int | None = None, policy: str = "lru", lora_dirs=(), threads: bool = False,
                max_lora_rank: int = 16, read_threads: int = 4, async_scheduling: bool = True, **sched) -> Engine:
    lora = LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras,
                      enable_lora_overlap_loading=overlap, lora_eviction_policy=policy, lora_dirs=tuple(lora_dirs),
                      lora_read_threads=read_threads)
    engine = Engine(WorkerConfig(ModelConfig(str(model_dir)), cache=CacheConfig(block_size=4, num_gpu_blocks_override=256),
                                 lora=lora, scheduler=SchedulerConfig(**sched), device="cpu",
                                 async_scheduling=async_scheduling))
    if not threads:
        engine.adapters.reader.executor = InlineExecutor()
    for name, path in (adapters or {}).items():
        engine.add_adapter(name, path)
    return engine


def run(engine: Engine, arrivals: dict[int, list[tuple]] | None = None, max_steps: int = 500) -> dict[str, list]:
    """Step until done; `arrivals`: step -> [(request id, prompt, params, adapter)] added before that step."""
    arrivals = arrivals or {}
    outputs: dict[str, list] = {}
    for step in range(max_steps):
        for request_id, ids, params, adapter in arrivals.get(step, []):
            engine.add_request(request_id, ids, params, adapter)
        if step > max(arrivals, default=0) and not engine.has_unfinished():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("requests did not finish")


def tokens(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


_ALONE: dict = {}


def alone(model_dir, path: str | None, ids: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of one request run alone in a fresh engine."""
    key = (path, tuple(ids), max_tokens)
    if key not in _ALONE:
        engine = make_engine(model_dir, {"x": path} if path else None)
        engine.add_request("alone", ids, greedy(max_tokens), "x" if path else None)
        _ALONE[key] = tokens(run(engine)["alone"])
    return _ALONE[key]


def residency(engine: Engine) -> dict[str, str]:
    return {s.name: s.residency for s in engine.adapter_states()}
