"""Token sampling with vLLM's semantics: the logits' per-request edits (penalties_and_bans.py), then temperature,
top-k/top-p/min-p, seeded draws, and logprobs of the raw model distribution (logprobs.py).

Every step is a batched tensor operation over the rows, run when some row asks for it (sampling_passes.py);
per-request settings become [num_rows] tensors. Python values are read back only at the end, with the tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.ipc.messages import SamplingParams, TokenLogprob
from worker.model_runner.logit_edits import LogitEdits
from worker.model_runner.logprobs import RowLogprobs, logprob_tensors
from worker.model_runner import penalties_and_bans
from worker.model_runner.penalties_and_bans import to_device
from worker.model_runner.sampling_passes import (asks_draw, asks_logprobs, asks_min_p, asks_seeded_draw,
                                                 asks_top_k_top_p)

_MASK64 = (1 << 64) - 1


@dataclass
class SamplingRow:
    """One row of the logits: its request's settings and tokens."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]     # tokens generated before this step, as known on the host
    num_pending: int = 0            # generated tokens still on their way from the device (async scheduling)
    pending_row: int = -1           # where the pending token is in the previous step's sampler output
    edits: LogitEdits | None = None  # the request's Sampler.logit_edits, kept across steps; None: built per call

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids) + self.num_pending


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                 # [num_rows] int64, on the sampler's device
    logprobs: RowLogprobs | None            # rows that asked for logprobs; None when none did
    finite: torch.Tensor | None = None      # [num_rows] bool: every logit of the row was finite

    def copy_to_host(self) -> "PendingTokens":
        """Start the step's one read-back (tokens and logprobs together); PendingTokens.wait() ends it."""
        return PendingTokens(self)


class PendingTokens:
    """A sampler output on its way to pinned host memory; `wait()` blocks on an event, never on the
    stream, so the host can prepare the next step meanwhile and the sync debug mode stays quiet."""

    def __init__(self, out: SamplerOutput):
        self._out = out
        finite = out.finite if out.finite is not None else torch.ones_like(out.token_ids, dtype=torch.bool)
        tensors = [out.token_ids, finite, *(out.logprobs.tensors if out.logprobs else ())]
        if out.token_ids.is_cuda:
            self._host = [t.to("cpu", non_blocking=True) for t in tensors]
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host, self._done = tensors, None

    @property
    def device_token_ids(self) -> torch.Tensor:
        return self._out.token_ids

    def wait(self) -> tuple[list[int], list[TokenLogprob | None], list[int]]:
        """(token ids, logprobs, rows whose logits were not all finite: their tokens are meaningless)."""
        if self._done is not None:
            self._done.synchronize()
        token_ids = self._host[0].tolist()
        nonfinite = [row for row, ok in enumerate(self._host[1].tolist()) if not ok]
        if self._out.logprobs is None:
            return token_ids, [None] * len(token_ids), nonfinite
        return token_ids, self._out.logprobs.from_host(self._host[2:], len(token_ids)), nonfinite


class Sampler:
    """Picks one token per row of logits; all work is done in float32."""

    def __init__(self, vocab_size: int, seed: int = 0, device: str | torch.device = "cpu",
                 eos_token_ids: tuple[int, ...] | list[int] = ()):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.eos_token_ids = list(eos_token_ids)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)  # rows without a seed

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], prev_tokens: torch.Tensor | None = None,
                 token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """`prev_tokens`: the previous step's sampled ids on the device, where rows' pending tokens are.
        `token_bitmask`: the grammars' allowed tokens (penalties_and_bans.apply_token_bitmask), None when no row
        has one."""
        # logits: [num_rows, vocab_size] float32 or bfloat16
        raw = logits.float()
        processed = self.process_logits(raw, rows, prev_tokens, token_bitmask)
        token_ids = processed.argmax(dim=-1)                                   # [num_rows]
        if any(asks_draw(r.params) for r in rows):
            drawn = self._draw(self.sampling_probs(processed, rows), rows)     # [num_rows]
            greedy = self._to_device([r.params.greedy for r in rows], torch.bool)
            token_ids = torch.where(greedy, token_ids, drawn)
        finite = torch.isfinite(raw).all(dim=-1)                              # [num_rows]
        return SamplerOutput(token_ids, self._row_logprobs(raw, token_ids, rows), finite)

    def logit_edits(self, params: SamplingParams, prompt_token_ids: list[int]) -> LogitEdits:
        """A request's lists as device tensors, built once for all its steps (SamplingRow.edits)."""
        return LogitEdits(params, prompt_token_ids, self.vocab_size, self.eos_token_ids, self.device)

    def process_logits(self, logits: torch.Tensor, rows: list[SamplingRow], prev_tokens: torch.Tensor | None = None,
                       token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """The logits a greedy row takes the argmax of: penalties_and_bans.process_logits with this sampler's
        eos ids."""
        return penalties_and_bans.process_logits(logits, rows, self.eos_token_ids, prev_tokens, token_bitmask)

    def sampling_probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top_k, top_p, min_p in that order, then softmax: the distribution a random
        row draws from. Greedy rows are scaled with temperature 1 (their draw is not used)."""
        temperature = self._to_device(
            [1.0 if r.params.greedy else r.params.temperature for r in rows], torch.float32)
        logits = logits / temperature[:, None]
        if any(asks_top_k_top_p(r.params) for r in rows):
            logits = self._apply_top_k_top_p(logits, rows)
        if any(asks_min_p(r.params) for r in rows):
            logits = self._apply_min_p(logits, rows)
        return logits.softmax(dim=-1)

    def _apply_top_k_top_p(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """top_k keeps every token at least as likely as the k-th; top_p then keeps the smallest
        prefix (best first) whose probability reaches top_p, so the best token always stays."""
        k = self._to_device([_top_k(r.params, self.vocab_size) for r in rows], torch.int64)
        top_p = self._to_device([r.params.top_p for r in rows], torch.float32)[:, None]
        sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)   # [n, V]
        kth = sorted_logits.gather(1, (k - 1)[:, None])                            # [n, 1]
        below_k = sorted_logits < kth
        probs = sorted_logits.masked_fill(below_k, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs          # probability of the better tokens
        drop_sorted = below_k | ((mass_before >= top_p) & (top_p < 1.0))
        drop_sorted[:, 0] = False        # a top_p that rounds to 0 in float32 still keeps the best token
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)          # vocab order
        return logits.masked_fill(drop, float("-inf"))

    def _apply_min_p(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        min_p = self._to_device([r.params.min_p for r in rows], torch.float32)[:, None]
        probs = logits.softmax(dim=-1)                                                # [n, V]
        return logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))

    def _draw(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Exponential race: with q ~ Exp(1) per token, argmax(probs / q) is a draw from probs.
        A seeded row takes q from a generator seeded by (seed, number of tokens generated so far),
        so its token depends on nothing else in the batch."""
        noise = torch.empty_like(probs).exponential_(generator=self._generator)      # [n, V]
        for i, r in enumerate(rows):
            if asks_seeded_draw(r.params):
                seed = _row_seed(r.params.seed, r.num_generated)
                generator = torch.Generator(device=self.device).manual_seed(seed)
                noise[i] = torch.empty_like(probs[i]).exponential_(generator=generator)
        noise = noise.clamp_min(torch.finfo(noise.dtype).tiny)   # q = 0 would make 0/0 = nan win
        return (probs / noise).argmax(dim=-1)

    def _row_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor,
                      rows: list[SamplingRow]) -> RowLogprobs | None:
        wanted = [i for i, r in enumerate(rows) if asks_logprobs(r.params)]
        if not wanted:
            return None
        idx = self._to_device(wanted, torch.int64)
        top = [rows[i].params.logprobs for i in wanted]
        return RowLogprobs(wanted, top, logprob_tensors(logits[idx], token_ids[idx], max(top)))

    def _to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        return to_device(values, dtype, self.device)


def _top_k(params: SamplingParams, vocab_size: int) -> int:
    """top_k as a count of tokens kept; 0 or -1 (disabled) keeps the whole vocabulary."""
    return params.top_k if 0 < params.top_k < vocab_size else vocab_size


def _row_seed(seed: int, step: int) -> int:
    """A 64-bit generator seed from a request seed and a step (splitmix64, applied twice)."""
    return _splitmix64((_splitmix64(seed & _MASK64) + step) & _MASK64)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
