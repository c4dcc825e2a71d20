"""A stand-in for gateway.worker_client.WorkerClient, and a small tokenizer, for in-process gateway tests.

FakeWorkerClient answers every request with a scripted list of token ids (its `script`, a function
of the request), one `chunk` of tokens per output, honouring max_tokens, min_tokens, stop token ids,
EOS and ignore_eos like the worker. Logprobs are deterministic: output token i has logprob
-0.25 * (i + 1), rank 1, and alternatives (token + j) % vocab at logprob - j. It records what it was
asked, and which requests were closed before they finished (the worker would abort those). Its first
output of a request carries `queue_time`, as the worker's does.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from gateway.tokenizer import Tokenizer
from worker.ipc.messages import AdapterCommandResult, AddRequest, Ready, RequestOutput, Stats, TokenLogprob

END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML = ("{%- for message in messages %}"
          "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
          "{%- endfor %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
CORPUS = ["the quick brown fox jumps over the lazy dog", "hello world, hello there", "STOP and go",
          "une fenêtre à Paris", "日本語 text", "plain ascii words only"]


def build_tokenizer() -> Tokenizer:
    """A byte-level BPE over a tiny corpus: multi-byte characters stay split across several tokens."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=[END_OF_TEXT, IM_START, IM_END],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return Tokenizer(backend, CHATML, {"eos_token": IM_END, "pad_token": END_OF_TEXT})


class FakeWorkerClient:
    def __init__(self, script: Callable[[AddRequest], list[int]], *, max_model_len: int = 256,
                 vocab_size: int = 320, eos_token_ids: tuple[int, ...] = (2,), chunk: int = 1,
                 delay: float = 0.0, startup_error: str | None = None, queue_time: float | None = None):
        self.script = script
        self.chunk = chunk
        self.delay = delay
        self.queue_time = queue_time
        self.startup_error = startup_error
        self._ready = Ready(max_model_len=max_model_len, vocab_size=vocab_size,
                            eos_token_ids=list(eos_token_ids), num_kv_blocks=64)
        self.ready: Ready | None = None
        self.stats = Stats(num_running=0, num_waiting=0)
        self.healthy = False
        self.requests: list[AddRequest] = []
        self.aborted: list[str] = []
        self.adapter_commands: list[tuple[str, str, str | None, bool, bool]] = []
        self.adapter_results: dict[str, AdapterCommandResult] = {}   # name -> answer; default ok
        self.warm_loads: list[str] = []          # names loaded with warm=True (the --lora-modules adapters)
        self.settled_after: list[int] = []       # each "settle": how many adapter commands had come before it
        self.error: str | None = None       # set: every request ends at once with this error, as on worker death
        self.error_status: int | None = None   # the HTTP status the worker gives that error (None: none given)
        self.shut_down = False

    async def start(self) -> Ready:
        if self.startup_error is not None:
            raise RuntimeError(self.startup_error)
        self.ready, self.healthy = self._ready, True
        return self.ready

    async def shutdown(self) -> None:
        self.shut_down, self.healthy = True, False

    async def adapter_command(self, op: str, name: str, path: str | None = None, load_inplace: bool = False,
                              pinned: bool = False, warm: bool = False) -> AdapterCommandResult:
        if op == "settle":           # not an adapter's command: when it came, after how many of those
            self.settled_after.append(len(self.adapter_commands))
            return AdapterCommandResult(0, ok=True)
        self.adapter_commands.append((op, name, path, load_inplace, pinned))
        self.warm_loads += [name] if warm else []
        return self.adapter_results.get(name, AdapterCommandResult(len(self.adapter_commands), ok=True))

    async def generate(self, request: AddRequest, on_output: Callable[[RequestOutput], None] | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """The request's outputs; `on_output` sees each one first, as WorkerClient's sees them arrive."""
        observe = on_output or (lambda output: None)
        self.requests.append(request)
        if self.error is not None:
            yield _observed(observe, RequestOutput(request.request_id, [], finish_reason="error", error=self.error,
                                                   status_code=self.error_status))
            return
        tokens, finish, stop_reason = self._tokens(request)
        finished = False
        try:
            for start in range(0, len(tokens), self.chunk):
                await asyncio.sleep(self.delay)
                part = tokens[start:start + self.chunk]
                last = start + self.chunk >= len(tokens)
                finished = last
                yield _observed(observe, RequestOutput(
                    request.request_id, part, new_logprobs=self._logprobs(request, part, start),
                    prompt_logprobs=self._prompt_logprobs(request) if start == 0 else None,
                    finish_reason=finish if last else None, stop_reason=stop_reason if last else None,
                    num_prompt_tokens=len(request.prompt_token_ids),
                    queue_time=self.queue_time if start == 0 else None))
        finally:
            if not finished:
                self.aborted.append(request.request_id)

    def _tokens(self, request: AddRequest) -> tuple[list[int], str, int | None]:
        """The tokens the worker would emit, its finish reason and stop token."""
        params, out = request.params, []
        for token in self.script(request):
            out.append(token)
            if len(out) >= params.min_tokens:
                if token in params.stop_token_ids:
                    return out, "stop", token
                if not params.ignore_eos and token in self._ready.eos_token_ids:
                    return out, "stop", None
            if len(out) >= params.max_tokens:
                return out, "length", None
        return out, "length", None

    def _logprobs(self, request: AddRequest, part: list[int], start: int) -> list[TokenLogprob] | None:
        k = request.params.logprobs
        if k is None:
            return None
        return [_entry(token, -0.25 * (start + i + 1), k, self._ready.vocab_size) for i, token in enumerate(part)]

    def _prompt_logprobs(self, request: AddRequest) -> list[TokenLogprob | None] | None:
        k = request.params.prompt_logprobs
        if k is None:
            return None
        return [None] + [_entry(t, -1.0, k, self._ready.vocab_size) for t in request.prompt_token_ids[1:]]


def _entry(token: int, logprob: float, k: int, vocab_size: int) -> TokenLogprob:
    return TokenLogprob(token, logprob, 1, [((token + j) % vocab_size, logprob - j) for j in range(k)])


def _observed(observe: Callable[[RequestOutput], None], output: RequestOutput) -> RequestOutput:
    observe(output)
    return output
