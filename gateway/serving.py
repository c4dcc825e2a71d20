"""ServingContext: what every route shares, and the one path from a prompt to a choice's text deltas."""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator, Callable, TypeVar

import anyio
from starlette.requests import Request

from gateway.api_error import APIError, model_not_found
from gateway.auth import APIKey
from gateway.config import GatewayConfig
from gateway.metrics import Metrics
from gateway.request_body import default_max_body_bytes, read_json
from gateway.request_validation import check_token_ids, resolve_max_tokens
from gateway.served_models import ServedModels
from gateway.tokenizer import Delta, IncrementalDetokenizer, Tokenizer
from worker.ipc.messages import AddRequest, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
OFF_LOOP_SIZE = 16_384    # characters or tokens past which tokenizing and templating run on a thread


class ServingContext:
    """What the routes share: the worker client, the tokenizer, the served names, the metrics."""

    def __init__(self, config: GatewayConfig, client: Any, tokenizer: Tokenizer):
        self.config = config
        self.client = client                     # gateway.worker_client.WorkerClient or a stand-in
        self.tokenizer = tokenizer
        worker = config.worker
        self.metrics = Metrics(config.served_names[0], worker.lora.max_loras, worker.cache.block_size,
                               worker.cache.gpu_memory_utilization, worker.cache.enable_prefix_caching,
                               worker.cache.kv_cache_dtype)
        self.served_models = ServedModels(config.served_names, worker.model.path, worker.lora.lora_dirs,
                                          client, forget=self.metrics.forget_adapter)
        self.api_key = APIKey(config.api_key) if config.api_key else None

    @property
    def max_model_len(self) -> int:
        return self.client.ready.max_model_len

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may use: known to both the tokenizer and the model."""
        return min(self.tokenizer.vocab_size, self.client.ready.vocab_size)

    @property
    def max_body_bytes(self) -> int:
        return self.config.max_request_body_bytes or default_max_body_bytes(self.max_model_len)

    async def read_json(self, request: Request, type_: type[T]) -> T:
        """The request's JSON body as `type_`, within the body size limit."""
        return await read_json(request, type_, self.max_body_bytes)

    def may_load_adapters(self, request: Request) -> bool:
        """Whether `request` may make the server read a --lora-dir: runtime loading is on, and the
        request carries the API key if there is one."""
        return self.config.allow_runtime_lora_updating and (self.api_key is None or self.api_key.accepts(request.scope))

    async def resolve(self, request: Request, model: str | None) -> str | None:
        """The adapter `model` names for this request (ServedModels.resolve, which may load it); 404 if
        unknown."""
        return await self.served_models.resolve(model, may_load=self.may_load_adapters(request))

    async def off_loop(self, size: int, work: Callable[[], T]) -> T:
        """`work()`, on a worker thread when `size` says it is large enough to stall the event loop."""
        if size < OFF_LOOP_SIZE:
            return work()
        return await anyio.to_thread.run_sync(work)

    async def start(self) -> None:
        """Start the worker, then load the --lora-modules adapters; raises with the worker's message."""
        self.metrics.engine_ready(await self.client.start())
        for module in self.config.lora_modules:
            try:
                await self.served_models.load(module.name, module.path, base_model_name=module.base_model_name,
                                              pinned=module.pinned, warm=True)
            except APIError as e:
                raise RuntimeError(f"Failed to load LoRA adapter '{module.name}' from {module.path}: "
                                   f"{e.message}") from None
        if self.config.lora_modules:     # their host memory page-locked before serving: it holds up the steps
            settled = await self.client.adapter_command("settle", "")
            if not settled.ok:
                raise RuntimeError(f"Preparing the LoRA adapters failed: {settled.message}")
        names = [m.name for m in self.config.lora_modules]
        logger.info("Serving %s (max_model_len %d) with %d adapters%s", ", ".join(self.config.served_names),
                    self.max_model_len, len(names), f": {names}" if len(names) <= 16 else
                    f" ({', '.join(names[:8])}, ..., {names[-1]})")

    async def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        """Prompt token ids, checked against the vocabulary; a 400 for an empty prompt, and for one
        past the context before its ids are listed (a long list holds the GIL while it is built)."""
        def encode() -> list[int]:
            ids = prompt
            if isinstance(prompt, str):
                encoding = self.tokenizer.encoding(prompt, add_special_tokens)
                if len(encoding) >= self.max_model_len:
                    resolve_max_tokens(None, len(encoding), self.max_model_len)     # raises
                ids = encoding.ids
            check_token_ids(ids, self.vocab_size)
            return ids
        return await self.off_loop(len(prompt), encode)

    async def decode(self, token_ids: list[int], skip_special_tokens: bool) -> str:
        return await self.off_loop(len(token_ids), lambda: self.tokenizer.decode(token_ids, skip_special_tokens))

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       lora_name: str | None, detokenizer: IncrementalDetokenizer) -> AsyncIterator[Delta]:
        """One choice as text deltas, until the worker finishes it or a stop string ends it.

        Leaving early (a stop string, a closed stream, a disconnect) closes the worker's stream,
        which aborts the request in the worker.
        """
        if lora_name is not None and lora_name not in self.served_models:
            raise model_not_found(lora_name)      # unloaded since the request named it: no series comes back
        timer = self.metrics.start_request(lora_name, len(prompt_ids), params.max_tokens)
        # the timer sees each worker output as it arrives, before outputs waiting together are merged
        outputs = self.client.generate(AddRequest(request_id, prompt_ids, params, lora_name), timer.on_output)
        reason = "abort"
        try:
            async for output in outputs:
                self._raise_if_adapter_gone(lora_name, output)
                delta = detokenizer.update(output)
                if not self.config.enable_prompt_tokens_details:
                    delta.num_cached_tokens = None     # vLLM reports cached tokens only with the flag
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

    def _raise_if_adapter_gone(self, lora_name: str | None, output: RequestOutput) -> None:
        """404, as before submitting, for a request whose adapter was unloaded while it waited."""
        if lora_name is not None and output.error is not None and (
                lora_name not in self.served_models or output.status_code == 404):
            raise model_not_found(lora_name)
