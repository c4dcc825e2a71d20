"""Stand-ins for worker.engine.Engine in gateway tests: no model, no torch, deterministic tokens.

FakeEngine emits one token per step for every running request: output token i of a request is
(sum(prompt) + i) % VOCAB_SIZE. It honours max_tokens, max_num_seqs (the rest wait; unset: the CPU's default, as
the engine resolves it), aborts and adapters by name; errors carry a `status_code` like
worker.lora.adapter.AdapterError. Each running request holds one KV block. The rest (nothing preempted, no adapter
tiers) is bench/stand_in_engine.py's.
"""
from __future__ import annotations

import time

from bench.stand_in_engine import StandInEngine
from worker.batch_defaults import DeviceFacts, resolve_batch_limits
from worker.config import WorkerConfig
from worker.ipc.messages import RequestOutput, SamplingParams

VOCAB_SIZE = 1000
MAX_MODEL_LEN = 4096
EOS_TOKEN_IDS = [2]
NUM_KV_BLOCKS = 64
STEP_SECONDS = 0.001        # a forward pass, so a long request leaves the loop time to react
STARTUP_ERROR = "fake engine refused to start: no accelerator here"


class FakeAdapterError(Exception):
    def __init__(self, message: str, status_code: int):
        super().__init__(message)
        self.status_code = status_code


class FakeEngine(StandInEngine):
    """StandInEngine with max_num_seqs running places, tokens counted up from the prompt's sum, a short step,
    one KV block per running request, and the real engine's refusals."""
    max_model_len = MAX_MODEL_LEN
    vocab_size = VOCAB_SIZE
    eos_token_ids = EOS_TOKEN_IDS
    num_kv_blocks = NUM_KV_BLOCKS

    def __init__(self, config: WorkerConfig):
        limits = resolve_batch_limits(config.scheduler, DeviceFacts("cpu"), 1, MAX_MODEL_LEN)
        super().__init__(max_running=limits.max_num_seqs)

    def add_adapter(self, name: str, path: str, *, load_inplace: bool = False, pinned: bool = False,
                    warm: bool = False) -> None:
        if name in self._adapters and not load_inplace:
            raise FakeAdapterError(f"The lora adapter '{name}' has already been loaded.", 400)
        super().add_adapter(name, path, load_inplace=load_inplace, pinned=pinned, warm=warm)

    def remove_adapter(self, name: str) -> None:
        if name not in self._adapters:
            raise FakeAdapterError(f"The lora adapter '{name}' cannot be found.", 404)
        super().remove_adapter(name)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora_name: str | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("The prompt is empty.")
        if lora_name is not None and lora_name not in self._adapters:
            raise FakeAdapterError(f"The lora adapter '{lora_name}' cannot be found.", 404)
        super().add_request(request_id, prompt_token_ids, params, lora_name)

    def step(self) -> list[RequestOutput]:
        time.sleep(STEP_SECONDS)
        return super().step()

    @property
    def kv_cache_usage(self) -> float:
        return len(self._running) / NUM_KV_BLOCKS    # one block per running request

    def _token(self, index: int) -> int:
        return index % VOCAB_SIZE


class FailingEngine:
    """An engine whose construction fails, as a model that cannot load would."""

    def __init__(self, config: WorkerConfig):
        raise RuntimeError(STARTUP_ERROR)
