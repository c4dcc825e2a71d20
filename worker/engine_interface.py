"""EngineInterface: what worker.__main__.Worker uses of an engine, so stand-ins can take the real one's place.

worker.engine.Engine meets it by shape; bench.fast_engine.FastEngine and the gateway tests' FakeEngine
subclass it through bench.stand_in_engine.StandInEngine. Imports nothing heavy: the worker process loads the engine module by name only after spawn.
"""
from __future__ import annotations

from abc import abstractmethod
from typing import Protocol

from worker.ipc.messages import AdapterState, LoRAStats, RequestOutput, SamplingParams


class EngineInterface(Protocol):
    """An engine the worker process serves: requests and adapters in, token outputs and stats out."""

    max_model_len: int              # longest prompt + output a request may have
    vocab_size: int                 # token ids the model knows
    eos_token_ids: list[int]        # tokens that end a request unless ignore_eos
    num_kv_blocks: int              # size of the KV cache, in blocks

    @abstractmethod
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora_name: str | None = None) -> None:
        """Queue a request; ValueError, or an error with a `status_code`, if it cannot be served."""

    @abstractmethod
    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now; its final "abort" output, or None if it is unknown."""

    @abstractmethod
    def step(self) -> list[RequestOutput]:
        """One step of every running request; the outputs it produced."""

    def launch_delay(self) -> float:
        """Seconds the worker loop may take in messages before the next step() without the device waiting for
        it; 0.0 (this default): step now."""
        return 0.0

    @abstractmethod
    def has_unfinished(self) -> bool:
        """Whether any request is running or waiting."""

    def has_background_work(self) -> bool:
        """Whether, with no request unfinished, work still goes on that idle_poll files (adapter reads started at
        registration); False (this default): none, so an idle worker sleeps until a message comes."""
        return False

    def idle_poll(self) -> list[RequestOutput]:
        """File the background work that finished while no request is unfinished; the outputs it produced."""
        return []

    @property
    @abstractmethod
    def num_adapters_loading(self) -> int:
        """Adapters whose read from disk into host memory is queued or running."""

    @property
    @abstractmethod
    def num_running(self) -> int:
        """Requests being stepped."""

    @property
    @abstractmethod
    def num_waiting(self) -> int:
        """Requests queued behind the running ones."""

    @property
    @abstractmethod
    def kv_cache_usage(self) -> float:
        """The fraction of KV blocks in use, 0 to 1."""

    @property
    @abstractmethod
    def num_preemptions(self) -> int:
        """Requests preempted (their KV dropped, to be recomputed) since the engine started."""

    @property
    @abstractmethod
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache since the engine started (0: no prefix cache)."""

    @property
    @abstractmethod
    def prefix_cache_hits(self) -> int:
        """Of those, the tokens found cached."""

    @abstractmethod
    def running_adapter_names(self) -> list[str]:
        """Adapters resident on the GPU and those of the running requests, sorted."""

    @abstractmethod
    def waiting_adapter_names(self) -> list[str]:
        """Adapters of the waiting requests, sorted."""

    @abstractmethod
    def add_adapter(self, name: str, path: str, *, load_inplace: bool = False, pinned: bool = False,
                    warm: bool = False) -> None:
        """Register an adapter directory under `name`; an error with a `status_code` if refused."""

    @abstractmethod
    def remove_adapter(self, name: str) -> None:
        """Unregister `name`; an error with a `status_code` if it is unknown."""

    def settle_adapters(self) -> None:
        """Wait until what the adapters registered so far need before serving is done (their host memory
        page-locked); engines without adapter tiers have nothing to wait for."""

    @abstractmethod
    def adapter_states(self) -> list[AdapterState]:
        """Where each registered adapter stands: tier, slot, rank, load times, requests."""

    @abstractmethod
    def lora_stats(self) -> LoRAStats | None:
        """Counters of the adapter tiers; None from an engine without tiers."""
