"""ServingContext: what every route shares, and the one path from a prompt to a choice's text deltas."""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import anyio

from gateway.config import GatewayConfig
from gateway.metrics import Metrics
from gateway.protocol import check_token_ids
from gateway.served_models import ServedModels
from gateway.tokenizer import Delta, IncrementalDetokenizer, Tokenizer
from worker.ipc.messages import AddRequest, SamplingParams

logger = logging.getLogger(__name__)


class ServingContext:
    """What the routes share: the worker client, the tokenizer, the served names, the metrics."""

    def __init__(self, config: GatewayConfig, client: Any, tokenizer: Tokenizer):
        self.config = config
        self.client = client                     # gateway.worker_client.WorkerClient or a stand-in
        self.tokenizer = tokenizer
        self.served_models = ServedModels(config.served_names, config.model, config.lora_dirs)
        self.metrics = Metrics(config.served_names[0], config.max_loras)

    @property
    def max_model_len(self) -> int:
        return self.client.ready.max_model_len

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may use: known to both the tokenizer and the model."""
        return min(self.tokenizer.vocab_size, self.client.ready.vocab_size)

    async def start(self) -> None:
        """Start the worker, then load the --lora-modules adapters; raises with the worker's message."""
        await self.client.start()
        for module in self.config.lora_modules:
            result = await self.client.adapter_command("load", module.name, module.path, pinned=module.pinned)
            if not result.ok:
                raise RuntimeError(f"Failed to load LoRA adapter '{module.name}' from {module.path}: "
                                   f"{result.message}")
            self.served_models.add(module.name, module.path, module.base_model_name, module.pinned)
        logger.info("Serving %s (max_model_len %d) with adapters %s", ", ".join(self.config.served_names),
                    self.max_model_len, [m.name for m in self.config.lora_modules])

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        """Prompt token ids, checked against the vocabulary; a 400 for an empty prompt."""
        ids = self.tokenizer.encode(prompt, add_special_tokens) if isinstance(prompt, str) else prompt
        check_token_ids(ids, self.vocab_size)
        return ids

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       lora_name: str | None, detokenizer: IncrementalDetokenizer) -> AsyncIterator[Delta]:
        """One choice as text deltas, until the worker finishes it or a stop string ends it.

        Leaving early (a stop string, a closed stream, a disconnect) closes the worker's stream,
        which aborts the request in the worker.
        """
        timer = self.metrics.start_request(lora_name, len(prompt_ids))
        outputs = self.client.generate(AddRequest(request_id, prompt_ids, params, lora_name))
        reason = "abort"
        try:
            async for output in outputs:
                timer.on_tokens(len(output.new_token_ids))
                delta = detokenizer.update(output)
                reason = delta.finish_reason or reason
                yield delta
                if delta.finish_reason is not None:
                    return
        except Exception:
            reason = "error"
            raise
        finally:
            timer.finish(reason)
            with anyio.CancelScope(shield=True):
                await outputs.aclose()
