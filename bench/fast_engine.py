"""A stand-in worker engine that emits tokens as fast as it can, or at a GPU's pace: no model, no torch.

Each step gives every request its next token; a request ends with "length" after max_tokens. With
$LORAPLEX_FAST_ENGINE_STEP_MS set, a step takes at least that long (it sleeps out the rest), as a decode step
on a GPU does, so the gateway is offered streams / step tokens per second instead of all it can take.
Tokens cycle through ids of the model directory's tokenizer.json that decode on their own to
printable text, so each token reaches the client as one SSE chunk and counts can be compared
exactly. The rest (requests, adapters by name, no tiers) is bench/stand_in_engine.py's.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import tokenizers

from bench.stand_in_engine import StandInEngine
from worker.config import WorkerConfig
from worker.ipc.messages import RequestOutput

MAX_MODEL_LEN = 1 << 20
STEP_MS_ENV = "LORAPLEX_FAST_ENGINE_STEP_MS"


class FastEngine(StandInEngine):
    """StandInEngine running every request at once, with printable tokens and an optional pace."""
    max_model_len = MAX_MODEL_LEN
    num_kv_blocks = 0

    def __init__(self, config: WorkerConfig):
        super().__init__()
        tokenizer = tokenizers.Tokenizer.from_file(str(Path(config.model.path) / "tokenizer.json"))
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids: list[int] = []
        self._token_ids = printable_token_ids(tokenizer)
        self._step_s = float(os.environ.get(STEP_MS_ENV) or 0) / 1000
        self._next_step = 0.0                   # time.monotonic() before which a paced step does not end

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        if self._step_s:
            now = time.monotonic()
            if now < self._next_step:
                time.sleep(self._next_step - now)
            self._next_step = max(now, self._next_step) + self._step_s
        return outputs

    def _token(self, index: int) -> int:
        return self._token_ids[index % len(self._token_ids)]


def printable_token_ids(tokenizer: tokenizers.Tokenizer) -> list[int]:
    """Ids that are not special and decode alone to non-empty printable text."""
    special = set(tokenizer.get_added_tokens_decoder())
    ids = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if token_id not in special and text and text.isprintable() and "\ufffd" not in text:
            ids.append(token_id)
    return ids
