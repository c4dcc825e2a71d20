"""Stand-ins for worker.engine.Engine in gateway tests: no model, no torch, deterministic tokens.

FakeEngine emits one token per step for every running request: output token i of a request is
(sum(prompt) + i) % VOCAB_SIZE. It honours max_tokens, max_num_seqs (the rest wait), aborts and
adapters by name; errors carry a `status_code` like worker.lora.adapter.AdapterError. Each running
request holds one KV block; nothing is preempted. It has no adapter tiers: a registered adapter counts
as on the GPU, and lora_stats is None.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec

from worker.config import WorkerConfig
from worker.engine_interface import EngineInterface
from worker.ipc.messages import AdapterState, LoRAStats, RequestOutput, SamplingParams

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


@dataclass
class FakeRequest:
    request_id: str
    first_token: int
    max_tokens: int
    num_prompt_tokens: int
    lora_name: str | None
    num_generated: int = 0


class FakeEngine(EngineInterface):
    max_model_len = MAX_MODEL_LEN
    vocab_size = VOCAB_SIZE
    eos_token_ids = EOS_TOKEN_IDS
    num_kv_blocks = NUM_KV_BLOCKS

    def __init__(self, config: WorkerConfig):
        self._max_running = config.scheduler.max_num_seqs
        self._running: dict[str, FakeRequest] = {}
        self._waiting: dict[str, FakeRequest] = {}
        self._adapters: dict[str, AdapterState] = {}

    def add_adapter(self, name: str, path: str, *, load_inplace: bool = False, pinned: bool = False,
                    warm: bool = False) -> None:
        previous = self._adapters.get(name)
        if previous is not None and not load_inplace:
            raise FakeAdapterError(f"The lora adapter '{name}' has already been loaded.", 400)
        version = previous.version + 1 if previous is not None else 1
        self._adapters[name] = AdapterState(name=name, path=path, version=version, residency="gpu", rank=0,
                                            target_modules=[], pinned=pinned)

    def remove_adapter(self, name: str) -> None:
        if self._adapters.pop(name, None) is None:
            raise FakeAdapterError(f"The lora adapter '{name}' cannot be found.", 404)

    def adapter_states(self) -> list[AdapterState]:
        running = [r.lora_name for r in self._running.values()]
        waiting = [r.lora_name for r in self._waiting.values()]
        return [msgspec.structs.replace(state, num_running=running.count(name), num_waiting=waiting.count(name))
                for name, state in self._adapters.items()]

    def lora_stats(self) -> LoRAStats | None:
        return None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora_name: str | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError("The prompt is empty.")
        if lora_name is not None and lora_name not in self._adapters:
            raise FakeAdapterError(f"The lora adapter '{lora_name}' cannot be found.", 404)
        self._waiting[request_id] = FakeRequest(request_id, sum(prompt_token_ids) % VOCAB_SIZE,
                                                params.max_tokens, len(prompt_token_ids), lora_name)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self._running.pop(request_id, None) or self._waiting.pop(request_id, None)
        if request is None:
            return None
        return RequestOutput(request_id, [], finish_reason="abort", num_prompt_tokens=request.num_prompt_tokens)

    def step(self) -> list[RequestOutput]:
        time.sleep(STEP_SECONDS)
        while self._waiting and len(self._running) < self._max_running:
            request_id = next(iter(self._waiting))
            self._running[request_id] = self._waiting.pop(request_id)
        return [self._advance(request) for request in list(self._running.values())]

    def has_unfinished(self) -> bool:
        return bool(self._running or self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_cache_usage(self) -> float:
        return len(self._running) / NUM_KV_BLOCKS    # one block per running request

    @property
    def num_preemptions(self) -> int:
        return 0

    @property
    def prefix_cache_queries(self) -> int:
        return 0

    @property
    def prefix_cache_hits(self) -> int:
        return 0

    def running_adapter_names(self) -> list[str]:
        return sorted({r.lora_name for r in self._running.values() if r.lora_name is not None})

    def waiting_adapter_names(self) -> list[str]:
        return sorted({r.lora_name for r in self._waiting.values() if r.lora_name is not None})

    def _advance(self, request: FakeRequest) -> RequestOutput:
        token = (request.first_token + request.num_generated) % VOCAB_SIZE
        request.num_generated += 1
        finished = request.num_generated >= request.max_tokens
        if finished:
            del self._running[request.request_id]
        return RequestOutput(request.request_id, [token], finish_reason="length" if finished else None,
                             num_prompt_tokens=request.num_prompt_tokens)


class FailingEngine:
    """An engine whose construction fails, as a model that cannot load would."""

    def __init__(self, config: WorkerConfig):
        raise RuntimeError(STARTUP_ERROR)
