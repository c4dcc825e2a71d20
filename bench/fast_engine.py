"""A stand-in worker engine that emits tokens as fast as it can, or at a GPU's pace: no model, no torch.

Each step gives every request its next token; a request ends with "length" after max_tokens. With
$LORAPLEX_FAST_ENGINE_STEP_MS set, a step takes at least that long (it sleeps out the rest), as a decode step
on a GPU does, so the gateway is offered streams / step tokens per second instead of all it can take.
Tokens cycle through ids of the model directory's tokenizer.json that decode on their own to
printable text, so each token reaches the client as one SSE chunk and counts can be compared
exactly. Adapters are names only: no tiers (a registered adapter counts as on the GPU, lora_stats
is None) and no weights.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import tokenizers

from worker.config import WorkerConfig
from worker.engine_interface import EngineInterface
from worker.ipc.messages import AdapterState, LoRAStats, RequestOutput, SamplingParams

MAX_MODEL_LEN = 1 << 20
STEP_MS_ENV = "LORAPLEX_FAST_ENGINE_STEP_MS"


@dataclass
class FastRequest:
    request_id: str
    max_tokens: int
    num_prompt_tokens: int
    offset: int                      # where in the token cycle this request starts
    num_generated: int = 0


class FastEngine(EngineInterface):
    max_model_len = MAX_MODEL_LEN
    num_kv_blocks = 0

    def __init__(self, config: WorkerConfig):
        tokenizer = tokenizers.Tokenizer.from_file(str(Path(config.model.path) / "tokenizer.json"))
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids: list[int] = []
        self._token_ids = printable_token_ids(tokenizer)
        self._requests: dict[str, FastRequest] = {}
        self._adapters: dict[str, AdapterState] = {}
        self._step_s = float(os.environ.get(STEP_MS_ENV) or 0) / 1000
        self._next_step = 0.0                   # time.monotonic() before which a paced step does not end

    def add_adapter(self, name: str, path: str, *, load_inplace: bool = False, pinned: bool = False,
                    warm: bool = False) -> None:
        previous = self._adapters.get(name)
        version = previous.version + 1 if previous is not None else 1
        self._adapters[name] = AdapterState(name=name, path=path, version=version, residency="gpu", rank=0,
                                            target_modules=[], pinned=pinned)

    def remove_adapter(self, name: str) -> None:
        self._adapters.pop(name, None)

    def adapter_states(self) -> list[AdapterState]:
        return list(self._adapters.values())

    def lora_stats(self) -> LoRAStats | None:
        return None

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora_name: str | None = None) -> None:
        self._requests[request_id] = FastRequest(request_id, params.max_tokens, len(prompt_token_ids),
                                                 sum(prompt_token_ids))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        return RequestOutput(request_id, [], finish_reason="abort", num_prompt_tokens=request.num_prompt_tokens)

    def step(self) -> list[RequestOutput]:
        outputs = [self._advance(request) for request in list(self._requests.values())]
        if self._step_s:
            now = time.monotonic()
            if now < self._next_step:
                time.sleep(self._next_step - now)
            self._next_step = max(now, self._next_step) + self._step_s
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return len(self._requests)

    @property
    def num_waiting(self) -> int:
        return 0

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

    def running_adapter_names(self) -> list[str]:
        return []

    def waiting_adapter_names(self) -> list[str]:
        return []

    def _advance(self, request: FastRequest) -> RequestOutput:
        token = self._token_ids[(request.offset + request.num_generated) % len(self._token_ids)]
        request.num_generated += 1
        finished = request.num_generated >= request.max_tokens
        if finished:
            del self._requests[request.request_id]
        return RequestOutput(request.request_id, [token], finish_reason="length" if finished else None,
                             num_prompt_tokens=request.num_prompt_tokens)


def printable_token_ids(tokenizer: tokenizers.Tokenizer) -> list[int]:
    """Ids that are not special and decode alone to non-empty printable text."""
    special = set(tokenizer.get_added_tokens_decoder())
    ids = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if token_id not in special and text and text.isprintable() and "\ufffd" not in text:
            ids.append(token_id)
    return ids
