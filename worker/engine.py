"""The offline engine: add requests and adapters, step, get per-request outputs.

    batch = scheduler.schedule(); out = runner.execute(batch); scheduler.update(batch, out.token_ids)
"""
from __future__ import annotations

import itertools
import logging

import torch

from worker.config import WorkerConfig
from worker.ipc.messages import RequestOutput, SamplingParams
from worker.kv_cache.block_allocator import BlockAllocator
from worker.lora.adapter import AdapterError, LoRAAdapter, load_adapter
from worker.lora.slot_table import SlotTable
from worker.model_runner.runner import ModelRunner
from worker.models.hf_config import ArchConfig
from worker.request import AdapterRef, Request
from worker.scheduler.scheduler import Scheduler
from worker.validation import validate_request

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "half": torch.float16, "float": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, checkpoint: torch.dtype, device: torch.device) -> torch.dtype:
    """auto: float32 on the CPU; on a GPU the checkpoint's dtype, with float32 served as bfloat16."""
    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"--dtype {name!r} is not supported (auto, float32, float16, bfloat16)")
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return torch.bfloat16 if checkpoint == torch.float32 else checkpoint


class Engine:
    def __init__(self, config: WorkerConfig):
        self.config = config
        self.device = resolve_device(config.device)
        self.arch = ArchConfig.from_dir(config.model.path)
        self.dtype = resolve_dtype(config.model.dtype, self.arch.dtype, self.device)
        self.max_model_len = config.model.max_model_len or self.arch.max_position_embeddings
        self.vocab_size = self.arch.vocab_size
        self.eos_token_ids = list(self.arch.eos_token_ids)
        self.runner = ModelRunner(config, self.arch, self.device, self.dtype, self.max_model_len)
        self.num_kv_blocks = self.runner.num_kv_blocks
        allocator = BlockAllocator(self.num_kv_blocks, config.cache.block_size)
        self.scheduler = Scheduler(config.scheduler, config.lora, allocator, SlotTable(config.lora.max_loras))
        self._adapter_refs: dict[str, AdapterRef] = {}          # registered name -> current version
        self._adapters: dict[int, LoRAAdapter] = {}             # uid -> weights (live versions only)
        self._uid_users: dict[int, int] = {}                    # uid -> unfinished requests using it
        self._uids = itertools.count(1)
        self._arrivals = itertools.count()
        self._requests: dict[str, Request] = {}
        logger.info("engine ready: %s on %s (%s), %d KV blocks", self.arch.architecture, self.device,
                    self.dtype, self.num_kv_blocks)

    # adapters

    def add_adapter(self, name: str, path: str, *, load_inplace: bool = False, pinned: bool = False) -> None:
        if name in self._adapter_refs and not load_inplace:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                               "adapter in place, set 'load_inplace' to True.")
        adapter = load_adapter(name, path, self.arch, self.config.lora.max_lora_rank, self.dtype)
        old = self._adapter_refs.get(name)
        ref = AdapterRef(name, next(self._uids))
        self._adapter_refs[name] = ref
        self._adapters[ref.uid] = adapter
        self._uid_users[ref.uid] = 0
        if old is not None:
            self._release_version(old)
        logger.info("adapter %s (rank %d, %s) registered from %s", name, adapter.rank,
                    ",".join(adapter.target_modules), path)

    def remove_adapter(self, name: str) -> None:
        ref = self._adapter_refs.pop(name, None)
        if ref is None:
            raise AdapterError(f"The lora adapter '{name}' cannot be found.", status_code=404)
        self._release_version(ref)

    def _release_version(self, ref: AdapterRef) -> None:
        """Forget an old version once no unfinished request runs on it."""
        if self._uid_users.get(ref.uid, 0) == 0 and ref.uid in self._adapters:
            del self._adapters[ref.uid], self._uid_users[ref.uid]
            self.scheduler.slots.drop(ref)

    # requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    lora_name: str | None = None) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        validate_request(prompt_token_ids, params, self.vocab_size, self.max_model_len)
        ref = None
        if lora_name is not None:
            ref = self._adapter_refs.get(lora_name)
            if ref is None:
                raise AdapterError(f"The model `{lora_name}` does not exist.", status_code=404)
            self._uid_users[ref.uid] += 1
        request = Request(request_id, list(prompt_token_ids), params, next(self._arrivals), ref,
                          tuple(self.eos_token_ids), self.max_model_len)
        self._requests[request_id] = request
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request now, freeing its KV blocks and adapter reference; None if it is unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return None
        self.scheduler.abort_request(request_id)
        self._forget(request)
        return RequestOutput(request_id, [], finish_reason="abort", num_prompt_tokens=request.num_prompt_tokens)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def running_adapter_names(self) -> list[str]:
        return sorted({r.adapter.name for r in self.scheduler.running if r.adapter})

    def waiting_adapter_names(self) -> list[str]:
        return sorted({r.adapter.name for r in self.scheduler.waiting if r.adapter})

    # the step

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        for ref, slot in batch.adapter_loads:
            self.runner.load_adapter(slot, self._adapters[ref.uid])
        logprobs, token_ids = {}, []
        if not batch.is_empty:
            result = self.runner.execute(batch)
            for request_id, scored in result.prompt_logprobs.items():
                self._requests[request_id].prompt_logprobs += scored
            sampling = [s.request.request_id for s in batch.seqs if s.samples]
            logprobs, token_ids = dict(zip(sampling, result.logprobs)), result.token_ids
        updated = self.scheduler.update(batch, token_ids)
        outputs = [self._output(request, logprobs) for request in updated]
        for request in updated:
            if request.is_finished:
                self._forget(request)
        return outputs

    def _output(self, request: Request, logprobs: dict) -> RequestOutput:
        if request.finish_reason == "error":   # the scheduler found it can never fit in the KV pool
            return RequestOutput(request.request_id, [], finish_reason="error",
                                 num_prompt_tokens=request.num_prompt_tokens,
                                 error=f"The request needs more KV-cache blocks than the pool has "
                                       f"({self.num_kv_blocks} blocks of {self.config.cache.block_size} tokens).")
        lp = logprobs.get(request.request_id)
        first = len(request.output_token_ids) == 1
        prompt_lps = [None, *request.prompt_logprobs] if first and request.params.prompt_logprobs is not None else None
        return RequestOutput(request.request_id, [request.output_token_ids[-1]],
                             new_logprobs=None if lp is None else [lp], prompt_logprobs=prompt_lps,
                             finish_reason=request.finish_reason, stop_reason=request.stop_reason,
                             num_prompt_tokens=request.num_prompt_tokens)

    def _forget(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)
        ref = request.adapter
        if ref is not None and ref.uid in self._uid_users:
            self._uid_users[ref.uid] -= 1
            if self._adapter_refs.get(ref.name) != ref:
                self._release_version(ref)
