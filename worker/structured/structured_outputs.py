"""StructuredOutputs: constrained requests from arrival to their last token.

    add_request ──hold──▶ compiling (GrammarCompiler's pool) ──ready()──▶ scheduler, with a matcher
                                    └── a bad spec: failed, answered 400 ──┘
    each step with a constrained row: matchers catch up with the filed tokens ──bitmask()──▶ the sampler

A matcher accepts a request's tokens as they are filed (`output_token_ids`, caught up when the next bitmask
is made), so its state is the host's; with async scheduling the engine files the tokens in flight before it
samples a batch with a constrained row whose last token is still pending (`needs_filed_tokens`).

A grammar ends when it takes an end-of-sequence token, and the request with it, unless `ignore_eos`: the request goes
on to `max_tokens` as vLLM's does (finish reason "length"), but where vLLM lets every token follow the end, only the
end-of-sequence tokens may here, so its text stays a match.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, wait

import torch

from worker.batch import ScheduledBatch
from worker.request import Request
from worker.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


class _Matcher:
    """One request's grammar state over the tokens accepted so far."""

    def __init__(self, compiled, end_row: torch.Tensor):
        import xgrammar
        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.end_row = end_row    # [ceil(vocab / 32)] int32: what may follow the grammar's end, its stop tokens
        self.num_accepted = 0
        self.broken = False       # a token the grammar refused was sampled (no token was allowed): unconstrained

    def catch_up(self, tokens: list[int], request_id: str) -> None:
        for token in tokens[self.num_accepted:]:
            if not self.broken and not self._accept(token):
                logger.warning("request %s: token %d does not follow its grammar; it goes on unconstrained",
                               request_id, token)
                self.broken = True
        self.num_accepted = len(tokens)

    def _accept(self, token: int) -> bool:
        """Whether `token` may come next; the matcher takes it if so. Past the grammar's end (which xgrammar refuses
        to go on from) a stop token may come, again and again."""
        if self.matcher.is_terminated():
            return bool(self.end_row[token // 32] >> (token % 32) & 1)
        return self.matcher.accept_token(token)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.broken:
            return
        if self.matcher.is_terminated():
            bitmask[row] = self.end_row
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)


class StructuredOutputs:
    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: list[int], device: torch.device,
                 disable_any_whitespace: bool = False):
        self.device = device
        self.vocab_size = vocab_size
        # made now, on the compiler's own thread (xgrammar's imports, the tokenizer's vocabulary): when the first
        # constrained request made it, that work held every other request up for seconds
        self._compiler = GrammarCompiler(tokenizer_path, vocab_size, list(eos_token_ids), disable_any_whitespace)
        self._end_row = token_bitmask_row(eos_token_ids, vocab_size)   # what may follow a grammar's end
        self._compiling: dict[str, tuple[Request, Future]] = {}  # request id -> (request, compiled grammar)
        self._matchers: dict[str, _Matcher] = {}                 # request id -> its matcher, while it runs

    def wait_ready(self) -> None:
        """Wait for the grammar compiler begun at construction (the engine calls it once its model is up)."""
        self._compiler.wait_ready()

    @property
    def num_compiling(self) -> int:
        return len(self._compiling)

    def hold(self, request: Request) -> None:
        """Start compiling the request's grammar; it waits here until ready() hands it over."""
        self._compiling[request.request_id] = (request, self._compiler.submit(request.params.structured))

    def ready(self) -> tuple[list[Request], list[tuple[Request, str, int]]]:
        """Requests whose grammar compiled (each now with a matcher), and the others with the reason and its HTTP
        status: 400 for a spec xgrammar refused, 500 for anything else (the tokenizer could not be read)."""
        compiled, failed = [], []
        for request_id, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            error = future.exception()
            if error is None:
                self._matchers[request_id] = _Matcher(future.result(), self._end_row)
                compiled.append(request)
            else:
                failed.append((request, str(error), 400) if isinstance(error, ValueError) else
                              (request, f"The grammar could not be compiled: {error!r}", 500))
        compiled.sort(key=lambda r: r.arrival_seq)
        return compiled, failed

    def wait(self, deadline_s: float) -> bool:
        """Wait up to `deadline_s` seconds for a grammar; whether one is ready to hand over."""
        if not self._compiling:
            return False
        done, _ = wait([f for _, f in self._compiling.values()], timeout=max(deadline_s, 0.0),
                       return_when="FIRST_COMPLETED")
        return bool(done)

    def drop(self, request_id: str) -> Request | None:
        """An aborted request still compiling; None when it is not here."""
        held = self._compiling.pop(request_id, None)
        return None if held is None else held[0]

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def constrained_rows(self, batch: ScheduledBatch) -> list[Request]:
        return [s.request for s in batch.seqs if s.samples and s.request.request_id in self._matchers]

    def needs_filed_tokens(self, batch: ScheduledBatch) -> bool:
        """Whether a constrained row of `batch` waits for its last token (sampled by the step in flight)."""
        return any(r.num_pending for r in self.constrained_rows(batch))

    def bitmask(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """[num_sampling_rows, ceil(vocab / 32)] int32 on the device: each constrained row's allowed tokens,
        every bit set on the other rows; None when no row is constrained."""
        requests = [s.request for s in batch.seqs if s.samples]
        if not any(r.request_id in self._matchers for r in requests):
            return None
        words = -(-self.vocab_size // 32)
        host = torch.full((len(requests), words), -1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        for row, request in enumerate(requests):
            matcher = self._matchers.get(request.request_id)
            if matcher is not None and not request.is_finished:
                assert not request.num_pending, "a constrained row samples once its last token is filed"
                matcher.catch_up(request.output_token_ids, request.request_id)
                matcher.fill(host, row)
        return host.to(self.device, non_blocking=True)    # the caching host allocator keeps `host` until copied

    def close(self) -> None:
        self._compiler.close()


def token_bitmask_row(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """[ceil(vocab / 32)] int32 in xgrammar's layout, allowing `token_ids` alone: bit t % 32 of word t // 32 is token
    t's. Running example: ids [2, 33] of a 64-token vocabulary give words [0b100, 0b10]."""
    words = [0] * -(-vocab_size // 32)
    for t in token_ids:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >> 31 else w for w in words], dtype=torch.int32)   # bit 31: the sign
