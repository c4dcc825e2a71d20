"""An engine without a model (no torch): what the stand-ins for worker.engine.Engine share.

Requests wait in arrival order until one of `max_running` running places is free; each step gives every running
request its next token, and a request ends with "length" after max_tokens. Adapters are names only: no tiers (a
registered adapter counts as on the GPU, lora_stats is None), no weights, no KV cache, nothing preempted or
prefix-cached. A subclass says which token is the i-th of a request (`_token`), and adds its pacing and refusals;
it binds EngineInterface's attributes (max_model_len, vocab_size, eos_token_ids, num_kv_blocks) itself.

Subclassed by bench.fast_engine.FastEngine (the gateway benchmarks' worker) and the gateway tests' FakeEngine.
"""
from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass

import msgspec

from worker.engine_interface import EngineInterface
from worker.ipc.messages import AdapterState, LoRAStats, RequestOutput, SamplingParams


@dataclass
class StandInRequest:
    request_id: str
    offset: int                      # sum(prompt_token_ids): output token i is _token(offset + i)
    max_tokens: int
    num_prompt_tokens: int
    lora_name: str | None
    num_generated: int = 0


class StandInEngine(EngineInterface):
    """Requests and adapters by name, one token per running request per step; see the module docstring."""

    def __init__(self, max_running: float = math.inf):
        self._max_running = max_running                  # requests stepped at once; the rest wait
        self._running: dict[str, StandInRequest] = {}
        self._waiting: dict[str, StandInRequest] = {}    # in arrival order
        self._adapters: dict[str, AdapterState] = {}

    @abstractmethod
    def _token(self, index: int) -> int:
        """Output token i of a request whose prompt ids sum to s, for index = s + i."""

    def add_adapter(self, name: str, path: str, *, load_inplace: bool = False, pinned: bool = False,
                    warm: bool = False) -> None:
        previous = self._adapters.get(name)
        version = previous.version + 1 if previous is not None else 1
        self._adapters[name] = AdapterState(name=name, path=path, version=version, residency="gpu", rank=0,
                                            target_modules=[], pinned=pinned)

    def remove_adapter(self, name: str) -> None:
        self._adapters.pop(name, None)

    def adapter_states(self) -> list[AdapterState]:
        running = [r.lora_name for r in self._running.values()]
        waiting = [r.lora_name for r in self._waiting.values()]
        return [msgspec.structs.replace(state, num_running=running.count(name), num_waiting=waiting.count(name))
                for name, state in self._adapters.items()]

    def lora_stats(self) -> LoRAStats | None:
        return None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora_name: str | None = None) -> None:
        self._waiting[request_id] = StandInRequest(request_id, sum(prompt_token_ids), params.max_tokens,
                                                   len(prompt_token_ids), lora_name)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self._running.pop(request_id, None) or self._waiting.pop(request_id, None)
        if request is None:
            return None
        return RequestOutput(request_id, [], finish_reason="abort", num_prompt_tokens=request.num_prompt_tokens)

    def step(self) -> list[RequestOutput]:
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
        return 0.0

    @property
    def num_preemptions(self) -> int:
        return 0

    @property
    def prefix_cache_queries(self) -> int:
        return 0

    @property
    def prefix_cache_hits(self) -> int:
        return 0

    @property
    def num_adapters_loading(self) -> int:
        return 0

    def running_adapter_names(self) -> list[str]:
        return sorted({r.lora_name for r in self._running.values() if r.lora_name is not None})

    def waiting_adapter_names(self) -> list[str]:
        return sorted({r.lora_name for r in self._waiting.values() if r.lora_name is not None})

    def _advance(self, request: StandInRequest) -> RequestOutput:
        token = self._token(request.offset + request.num_generated)
        request.num_generated += 1
        finished = request.num_generated >= request.max_tokens
        if finished:
            del self._running[request.request_id]
        return RequestOutput(request.request_id, [token], finish_reason="length" if finished else None,
                             num_prompt_tokens=request.num_prompt_tokens)
