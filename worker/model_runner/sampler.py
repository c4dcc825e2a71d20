"""Token sampling with vLLM's semantics: logit_bias, penalties, bans (a grammar's token bitmask,
allowed_token_ids, bad_words, min_tokens), temperature, top-k/top-p/min-p, seeded draws, and logprobs of the
raw model distribution.

Every step is a batched tensor operation over the rows; per-request settings become [num_rows]
tensors. Python values are read back only at the end, for the logprobs handed to the gateway.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.ipc.messages import SamplingParams, TokenLogprob

_MASK64 = (1 << 64) - 1
# A repetition penalty near 0 or past float32's range would make penalised logits infinite (and the softmax
# nan): penalties act as if within [1 / PENALTY_LIMIT, PENALTY_LIMIT], which keeps the order of model-sized
# logits exact, and penalised logits stay within +-LOGIT_LIMIT, finite after any temperature >= SAMPLING_EPS.
PENALTY_LIMIT = 1e25
LOGIT_LIMIT = 1e30


@dataclass
class SamplingRow:
    """One row of the logits: its request's settings and tokens."""
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]     # tokens generated before this step, as known on the host
    num_pending: int = 0            # generated tokens still on their way from the device (async scheduling)
    pending_row: int = -1           # where the pending token is in the previous step's sampler output

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids) + self.num_pending


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                 # [num_rows] int64, on the sampler's device
    logprobs: "RowLogprobs | None"          # rows that asked for logprobs; None when none did
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


@dataclass
class RowLogprobs:
    """Logprob tensors of the rows that asked for them (see _logprob_tensors), still on the device."""
    rows: list[int]                 # row index of each entry
    top: list[int]                  # how many top tokens each of those rows asked for
    tensors: tuple[torch.Tensor, ...]

    def from_host(self, host: list[torch.Tensor], num_rows: int) -> list[TokenLogprob | None]:
        """Per-row entries (None for rows that did not ask) from the host copies of `tensors`."""
        entries = _to_token_logprobs(*(t.tolist() for t in host))
        out: list[TokenLogprob | None] = [None] * num_rows
        for row, k, entry in zip(self.rows, self.top, entries):
            entry.top = entry.top[:k]
            out[row] = entry
        return out


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
        `token_bitmask`: the grammars' allowed tokens (see apply_token_bitmask), None when no row has one."""
        # logits: [num_rows, vocab_size] float32 or bfloat16
        raw = logits.float()
        processed = self.process_logits(raw, rows, prev_tokens, token_bitmask)
        token_ids = processed.argmax(dim=-1)                                   # [num_rows]
        if not all(r.params.greedy for r in rows):
            drawn = self._draw(self.sampling_probs(processed, rows), rows)     # [num_rows]
            greedy = self._to_device([r.params.greedy for r in rows], torch.bool)
            token_ids = torch.where(greedy, token_ids, drawn)
        finite = torch.isfinite(raw).all(dim=-1)                              # [num_rows]
        return SamplerOutput(token_ids, self._row_logprobs(raw, token_ids, rows), finite)

    def process_logits(self, logits: torch.Tensor, rows: list[SamplingRow], prev_tokens: torch.Tensor | None = None,
                       token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """logit_bias, penalties (repetition, frequency, presence), then the bans: the grammar's bitmask,
        allowed_token_ids, bad_words, min_tokens: the logits a greedy row takes the argmax of, in float32.
        `logits` itself is never written to. vLLM bans before the penalties; a banned logit is -inf either
        way, and banning last keeps it -inf rather than the penalties' clamp of it."""
        logits = logits.float()
        if any(r.params.logit_bias for r in rows):
            logits = self._apply_logit_bias(logits, rows)
        if any(_has_penalty(r.params) for r in rows):
            logits = self._apply_penalties(logits, rows, prev_tokens)
        if token_bitmask is not None:
            logits = apply_token_bitmask(logits, token_bitmask)
        if any(r.params.allowed_token_ids is not None for r in rows):
            logits = self._keep_allowed(logits, rows)
        if any(r.params.bad_words_token_ids for r in rows):
            logits = self._ban_bad_words(logits, rows, prev_tokens)
        return self._mask_early_stops(logits, rows)

    def _apply_logit_bias(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        pairs = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items()]
        row_idx, token_idx, bias = zip(*pairs)
        indices = (self._to_device(row_idx, torch.int64), self._to_device(token_idx, torch.int64))
        return logits.index_put(indices, self._to_device(bias, torch.float32), accumulate=True)

    def _keep_allowed(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Rows with allowed_token_ids keep those tokens alone; the others keep every token."""
        pairs = [(i, t) for i, r in enumerate(rows) for t in r.params.allowed_token_ids or ()]
        unrestricted = self._to_device([r.params.allowed_token_ids is None for r in rows], torch.bool)
        keep = unrestricted[:, None].expand_as(logits).clone()                   # [n, V]
        if pairs:
            row_idx, token_idx = zip(*pairs)
            keep[self._to_device(row_idx, torch.int64), self._to_device(token_idx, torch.int64)] = True
        return logits.masked_fill(~keep, float("-inf"))

    def _ban_bad_words(self, logits: torch.Tensor, rows: list[SamplingRow],
                       prev_tokens: torch.Tensor | None) -> torch.Tensor:
        """A bad word's last token is banned when the output ends with the rest of it (a one-token word:
        always). A pending last token is compared on the device, so the host never waits for it.

        Running example: bad word [7, 8, 9], output on the host [.., 7] and a pending token: 9 is banned
        where prev_tokens[pending_row] == 8."""
        bans = []          # (row, banned token, row of the pending token to compare or -1, its expected id)
        for i, r in enumerate(rows):
            for word in r.params.bad_words_token_ids:
                *prefix, last = word
                if not prefix:
                    bans.append((i, last, -1, 0))
                    continue
                known = prefix[:-1] if r.num_pending else prefix
                out = r.output_token_ids
                if len(out) >= len(known) and out[len(out) - len(known):] == known:
                    bans.append((i, last, r.pending_row, prefix[-1]) if r.num_pending else (i, last, -1, 0))
        if not bans:
            return logits
        row_idx, token_idx, src, expected = (self._to_device(x, torch.int64) for x in zip(*bans))
        banned = src < 0
        if prev_tokens is not None:
            banned = banned | (prev_tokens[src.clamp_min(0)] == expected) & (src >= 0)
        minus_inf = torch.full_like(banned, float("-inf"), dtype=logits.dtype)
        penalty = torch.where(banned, minus_inf, torch.zeros_like(minus_inf))     # -inf + 0 = -inf
        return logits.index_put((row_idx, token_idx), penalty, accumulate=True)

    def sampling_probs(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Temperature, top_k, top_p, min_p in that order, then softmax: the distribution a random
        row draws from. Greedy rows are scaled with temperature 1 (their draw is not used)."""
        temperature = self._to_device(
            [1.0 if r.params.greedy else r.params.temperature for r in rows], torch.float32)
        logits = logits / temperature[:, None]
        if any(_top_k(r.params, self.vocab_size) < self.vocab_size or r.params.top_p < 1.0
               for r in rows):
            logits = self._apply_top_k_top_p(logits, rows)
        if any(r.params.min_p > 0.0 for r in rows):
            logits = self._apply_min_p(logits, rows)
        return logits.softmax(dim=-1)

    def _apply_penalties(self, logits: torch.Tensor, rows: list[SamplingRow],
                         prev_tokens: torch.Tensor | None) -> torch.Tensor:
        counts = self._token_counts([r.output_token_ids for r in rows])          # [n, V]
        pending = [(i, r.pending_row) for i, r in enumerate(rows) if r.num_pending]
        if pending:   # tokens not on the host yet are counted from the device, without reading them back
            assert prev_tokens is not None, "rows with a pending token need the previous sampler output"
            row_idx, src = (self._to_device(list(x), torch.int64) for x in zip(*pending))
            counts.index_put_((row_idx, prev_tokens[src]), torch.ones_like(row_idx, dtype=counts.dtype),
                              accumulate=True)
        seen = (self._token_counts([r.prompt_token_ids for r in rows]) > 0) | (counts > 0)
        repetition = self._to_device([r.params.repetition_penalty for r in rows], torch.float32)
        repetition = repetition.clamp(1 / PENALTY_LIMIT, PENALTY_LIMIT)
        frequency = self._to_device([r.params.frequency_penalty for r in rows], torch.float32)
        presence = self._to_device([r.params.presence_penalty for r in rows], torch.float32)
        repetition = torch.where(seen, repetition[:, None], 1.0)                  # [n, V]
        logits = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
        return logits.clamp(-LOGIT_LIMIT, LOGIT_LIMIT)

    def _mask_early_stops(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Rows short of min_tokens cannot end: their stop ids (and eos unless ignore_eos) get -inf."""
        pairs = [(i, t) for i, r in enumerate(rows)
                 if r.num_generated < r.params.min_tokens for t in self._stop_ids(r.params)]
        if not pairs:
            return logits
        row_idx, token_idx = zip(*pairs)
        indices = (self._to_device(row_idx, torch.int64), self._to_device(token_idx, torch.int64))
        return logits.index_put(indices, torch.full((len(pairs),), float("-inf"), device=logits.device))

    def _stop_ids(self, params: SamplingParams) -> list[int]:
        return params.stop_token_ids + ([] if params.ignore_eos else self.eos_token_ids)

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
            if r.params.seed is not None and not r.params.greedy:
                seed = _row_seed(r.params.seed, r.num_generated)
                generator = torch.Generator(device=self.device).manual_seed(seed)
                noise[i] = torch.empty_like(probs[i]).exponential_(generator=generator)
        noise = noise.clamp_min(torch.finfo(noise.dtype).tiny)   # q = 0 would make 0/0 = nan win
        return (probs / noise).argmax(dim=-1)

    def _row_logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor,
                      rows: list[SamplingRow]) -> RowLogprobs | None:
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not wanted:
            return None
        idx = self._to_device(wanted, torch.int64)
        top = [rows[i].params.logprobs for i in wanted]
        return RowLogprobs(wanted, top, _logprob_tensors(logits[idx], token_ids[idx], max(top)))

    def _token_counts(self, token_lists: list[list[int]]) -> torch.Tensor:
        """[num_rows, vocab_size] float32: how often each token occurs in each row's list."""
        row_idx = self._to_device([i for i, ids in enumerate(token_lists) for _ in ids], torch.int64)
        token_idx = self._to_device([t for ids in token_lists for t in ids], torch.int64)
        counts = torch.zeros(len(token_lists), self.vocab_size, device=self.device)
        return counts.index_put_((row_idx, token_idx), torch.ones_like(token_idx, dtype=counts.dtype),
                                 accumulate=True)

    def _to_device(self, values, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Semantics: out[i, t] = logits[i, t] if bit t % 32 of bitmask[i, t // 32] is set else -inf
    (xgrammar's layout; a row of -1 words allows every token). Out of place, on the device."""
    # logits: [n, V] float32; bitmask: [n, ceil(V / 32)] int32, read as its little-endian bytes: bit t % 8 of
    # byte t // 8 is token t's (one byte per token in the temporaries, not four)
    as_bytes = bitmask.contiguous().view(torch.uint8)                                          # [n, 4W]
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    allowed = ((as_bytes[:, :, None] >> shifts) & 1).flatten(1)[:, :logits.shape[1]]          # [n, V] uint8
    return logits.masked_fill(allowed == 0, float("-inf"))


def compute_logprobs(logits_rows: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """Row i of `logits_rows` scored against token_ids[i] (raw distribution), with its k best tokens."""
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits_rows.device)
    return _to_token_logprobs(*(t.tolist() for t in to_host(*_logprob_tensors(logits_rows, ids, k))))


def _logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, k: int):
    """Logprobs and ranks of token_ids, and the k best tokens with their logprobs.

    Ranks and order are taken on the float32 logits, which log_softmax's rounding cannot reorder.
    """
    # logits: [n, V]; token_ids: [n] int64
    logits = logits.float()
    logprobs = logits.log_softmax(dim=-1)                                     # [n, V]
    chosen = token_ids[:, None]                                               # [n, 1]
    ranks = (logits > logits.gather(1, chosen)).sum(dim=-1) + 1              # [n]
    top_ids = _top_k_ids(logits, min(k, logits.shape[1]))                    # [n, k]
    return token_ids, logprobs.gather(1, chosen)[:, 0], ranks, top_ids, logprobs.gather(1, top_ids)


def _top_k_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the k largest logits per row, best first; equal logits in ascending id order.

    torch.topk breaks ties arbitrarily, so tokens tied with the k-th value are picked again by id.
    Running example: logits [1, 3, 3, 2, 3], k = 2: k-th value 3, no token above it,
    tied ids {1, 2, 4} → [1, 2].
    """
    # logits: [n, V]
    if k == 0:
        return torch.empty(logits.shape[0], 0, dtype=torch.int64, device=logits.device)
    values, ids = logits.topk(k, dim=-1)                                      # [n, k]
    kth = values[:, -1:]                                                      # [n, 1]
    num_above = (values > kth).sum(dim=-1, keepdim=True)                      # [n, 1]
    ids, by_id = ids.sort(dim=-1)
    best = ids.gather(1, values.gather(1, by_id).sort(dim=-1, descending=True, stable=True).indices)
    vocab_ids = torch.arange(logits.shape[1], device=logits.device)
    tie_key = torch.where(logits == kth, -vocab_ids, -logits.shape[1])       # [n, V]; larger = lower id
    tied_ids = tie_key.topk(k, dim=-1).indices                                # [n, k]
    slot = torch.arange(k, device=logits.device)                              # [k]
    tie_slot = (slot - num_above).clamp_min(0)                                # [n, k]
    return torch.where(slot < num_above, best, tied_ids.gather(1, tie_slot))


def _to_token_logprobs(token_ids: list, logprobs: list, ranks: list, top_ids: list,
                       top_logprobs: list) -> list[TokenLogprob]:
    return [TokenLogprob(token_id=t, logprob=lp, rank=r, top=list(zip(ids, lps)))
            for t, lp, r, ids, lps in zip(token_ids, logprobs, ranks, top_ids, top_logprobs)]


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copy device tensors to (pinned) host memory asynchronously and wait on an event, not on the
    stream: the one device-to-host transfer a step allows, and no sync the debug mode would flag."""
    if not tensors or not tensors[0].is_cuda:
        return list(tensors)
    host = [t.to("cpu", non_blocking=True) for t in tensors]
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return host


def _has_penalty(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0)


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
