"""StructuredOutputs: constrained requests from arrival to their last token.

    add_request ──hold──▶ compiling (GrammarCompiler's pool) ──ready()──▶ scheduler, with a matcher
                                    └── a bad spec: failed, answered 400 ──┘
    each step with a constrained row: matchers catch up with the filed tokens ──bitmask()──▶ the sampler

A matcher accepts a request's tokens as they are filed (`output_token_ids`, caught up when the next bitmask
is made), so its state is the host's; with async scheduling the engine files the tokens in flight before it
samples a batch with a constrained row whose last token is still pending (`needs_filed_tokens`).

The bitmask is the host's work on the step's critical path (between the previous step's tokens and this step's
sampling, while its forward pass runs on the device), so it is made in rows of page-locked memory made once (two in
turn: one may still be copying), the matchers advanced and their rows filled by xgrammar's batch calls (the fills on
its threads). Made with a page-locked tensor allocated a step, 256 constrained rows of an 8B model on an H200 spent
~4.7 ms a step in that allocation alone (py-spy of the worker), against a ~10 ms forward pass.

A grammar ends when it takes an end-of-sequence token, and the request with it, unless `ignore_eos`: the request goes
on to `max_tokens` as vLLM's does (finish reason "length"), but where vLLM lets every token follow the end, only the
end-of-sequence tokens may here, so its text stays a match.
"""
from __future__ import annotations

import logging
import os
from concurrent.futures import Future, wait

import torch

from worker.batch import ScheduledBatch
from worker.request import Request
from worker.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)

FILL_THREADS = 4        # xgrammar's threads that fill a step's rows (it fills in parallel from 2 rows on)


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
                self.refused(token, request_id)
        self.num_accepted = len(tokens)

    def refused(self, token: int, request_id: str) -> None:
        logger.warning("request %s: token %d does not follow its grammar; it goes on unconstrained", request_id, token)
        self.broken = True

    def _accept(self, token: int) -> bool:
        """Whether `token` may come next; the matcher takes it if so. Past the grammar's end (which xgrammar refuses
        to go on from) a stop token may come, again and again."""
        if self.matcher.is_terminated():
            return bool(self.end_row[token // 32] >> (token % 32) & 1)
        return self.matcher.accept_token(token)

    @property
    def free(self) -> bool:
        """Not broken and not past its grammar's end: xgrammar's batch calls may advance and fill it."""
        return not self.broken and not self.matcher.is_terminated()


class _BitmaskRows:
    """Where a step's bitmask is written and copied from: [rows, words] int32 host memory made once (page-locked on
    CUDA), two of them in turn, each reused once its copy to the device has ended (an event, nearly always passed
    by then: a step's bitmask is made after the previous step's tokens are read)."""

    def __init__(self, rows: int, words: int, device: torch.device):
        self.device, self.words = device, words
        self._pin = device.type == "cuda"
        self._host = [self._make(rows), self._make(rows)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def _make(self, rows: int) -> torch.Tensor:
        return torch.empty((max(rows, 1), self.words), dtype=torch.int32, pin_memory=self._pin)

    def take(self, rows: int) -> torch.Tensor:
        """The next [rows, words] host rows, free to write."""
        copied = self._copied[self._turn]
        if copied is not None and not copied.query():
            copied.synchronize()            # its copy has not ended (a second bitmask before the step's tokens)
        self._copied[self._turn] = None
        if self._host[self._turn].shape[0] < rows:      # more sampling rows than max_num_seqs: grown once
            self._host[self._turn] = self._make(rows)
        return self._host[self._turn][:rows]

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """`host` (from take) on the device; its rows are taken again two calls later."""
        turn, self._turn = self._turn, self._turn ^ 1
        if self.device.type != "cuda":
            return host.clone()
        on_device = host.to(self.device, non_blocking=True)
        self._copied[turn] = torch.cuda.Event()
        self._copied[turn].record()
        return on_device


class StructuredOutputs:
    def __init__(self, tokenizer_path: str, vocab_size: int, eos_token_ids: list[int], device: torch.device,
                 disable_any_whitespace: bool = False, max_rows: int = 1):
        self.device = device
        self.vocab_size = vocab_size
        # made now, on the compiler's own thread (xgrammar's imports, the tokenizer's vocabulary): when the first
        # constrained request made it, that work held every other request up for seconds
        self._compiler = GrammarCompiler(tokenizer_path, vocab_size, list(eos_token_ids), disable_any_whitespace)
        self._end_row = token_bitmask_row(eos_token_ids, vocab_size)   # what may follow a grammar's end
        self._compiling: dict[str, tuple[Request, Future]] = {}  # request id -> (request, compiled grammar)
        self._matchers: dict[str, _Matcher] = {}                 # request id -> its matcher, while it runs
        self._rows = _BitmaskRows(max_rows, -(-vocab_size // 32), device)   # max_rows: the most sampling rows
        self._end_words = self._end_row.numpy()
        self._batch = None      # xgrammar's BatchGrammarMatcher, made by the first bitmask (xgrammar imported by then)

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
        host = self._rows.take(len(requests))
        words = host.numpy()
        live: list[tuple[int, Request, _Matcher]] = []
        open_rows = []                          # no grammar (or a broken one): every token allowed
        for row, request in enumerate(requests):
            matcher = self._matchers.get(request.request_id)
            if matcher is None or request.is_finished:
                open_rows.append(row)
            else:
                assert not request.num_pending, "a constrained row samples once its last token is filed"
                live.append((row, request, matcher))
        self._catch_up([(request, matcher) for _, request, matcher in live])
        fill_rows, fill_matchers = [], []
        for row, _, matcher in live:
            if matcher.free:
                fill_rows.append(row)
                fill_matchers.append(matcher.matcher)
            elif matcher.broken:
                open_rows.append(row)
            else:                               # past the grammar's end
                words[row] = self._end_words
        words[open_rows] = -1
        if fill_matchers:
            if self._batch is None:
                import xgrammar
                self._batch = xgrammar.BatchGrammarMatcher(max_threads=min(FILL_THREADS, os.cpu_count() or 1))
            self._batch.batch_fill_next_token_bitmask(fill_matchers, host, fill_rows)
        return self._rows.to_device(host)

    def _catch_up(self, live: list[tuple[Request, _Matcher]]) -> None:
        """Every matcher takes its request's tokens filed since: one new token each on free matchers in one batch
        call, any other case one matcher at a time (_Matcher.catch_up)."""
        import xgrammar
        batched, tokens = [], []
        for request, matcher in live:
            filed = request.output_token_ids
            if matcher.free and len(filed) == matcher.num_accepted + 1:
                batched.append((request, matcher))
                tokens.append(filed[-1])
            else:
                matcher.catch_up(filed, request.request_id)
        if not batched:
            return
        accepted = xgrammar.BatchGrammarMatcher.batch_accept_token([m.matcher for _, m in batched], tokens)
        for (request, matcher), token, ok in zip(batched, tokens, accepted):
            matcher.num_accepted += 1
            if not ok:
                matcher.refused(token, request.request_id)

    def close(self) -> None:
        self._compiler.close()


def token_bitmask_row(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """[ceil(vocab / 32)] int32 in xgrammar's layout, allowing `token_ids` alone: bit t % 32 of word t // 32 is token
    t's. Running example: ids [2, 33] of a 64-token vocabulary give words [0b100, 0b10]."""
    words = [0] * -(-vocab_size // 32)
    for t in token_ids:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >> 31 else w for w in words], dtype=torch.int32)   # bit 31: the sign
