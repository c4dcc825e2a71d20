"""The per-request edits of the logits before any draw: logit_bias, the penalties (repetition, frequency,
presence), then the bans (a grammar's token bitmask, allowed_token_ids, bad_words, min_tokens), with vLLM's
semantics. Their result is what a greedy row takes the argmax of.

Each edit is one batched tensor operation over the rows, skipped when no row asks for it
(sampling_passes.py); per-request settings become [num_rows] tensors, copied to the device without a sync.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker.model_runner.sampling_passes import (asks_allowed_tokens, asks_bad_words, asks_logit_bias,
                                                 asks_penalties)

if TYPE_CHECKING:
    from worker.model_runner.sampler import SamplingRow

# A repetition penalty near 0 or past float32's range would make penalised logits infinite (and the softmax
# nan): penalties act as if within [1 / PENALTY_LIMIT, PENALTY_LIMIT], which keeps the order of model-sized
# logits exact, and penalised logits stay within +-LOGIT_LIMIT, finite after any temperature >= SAMPLING_EPS.
PENALTY_LIMIT = 1e25
LOGIT_LIMIT = 1e30


def process_logits(logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: list[int],
                   prev_tokens: torch.Tensor | None = None, token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
    """logit_bias, penalties, then the bans, in float32; `logits` itself is never written to. vLLM bans before the
    penalties; a banned logit is -inf either way, and banning last keeps it -inf rather than the penalties' clamp
    of it. `prev_tokens`: the previous step's sampled ids on the device, where rows' pending tokens are."""
    # logits: [num_rows, vocab_size]
    logits = logits.float()
    if any(asks_logit_bias(r.params) for r in rows):
        logits = apply_logit_bias(logits, rows)
    if any(asks_penalties(r.params) for r in rows):
        logits = apply_penalties(logits, rows, prev_tokens)
    if token_bitmask is not None:
        logits = apply_token_bitmask(logits, token_bitmask)
    if any(asks_allowed_tokens(r.params) for r in rows):
        logits = keep_allowed(logits, rows)
    if any(asks_bad_words(r.params) for r in rows):
        logits = ban_bad_words(logits, rows, prev_tokens)
    return mask_early_stops(logits, rows, eos_token_ids)


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    pairs = [(i, t, b) for i, r in enumerate(rows) for t, b in (r.params.logit_bias or {}).items()]
    row_idx, token_idx, bias = zip(*pairs)
    indices = (to_device(row_idx, torch.int64, logits.device), to_device(token_idx, torch.int64, logits.device))
    return logits.index_put(indices, to_device(bias, torch.float32, logits.device), accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], prev_tokens: torch.Tensor | None) -> torch.Tensor:
    """Repetition over the prompt and output tokens, frequency and presence over the output tokens."""
    device = logits.device
    counts = token_counts([r.output_token_ids for r in rows], logits.shape[1], device)      # [n, V]
    pending = [(i, r.pending_row) for i, r in enumerate(rows) if r.num_pending]
    if pending:   # tokens not on the host yet are counted from the device, without reading them back
        assert prev_tokens is not None, "rows with a pending token need the previous sampler output"
        row_idx, src = (to_device(list(x), torch.int64, device) for x in zip(*pending))
        counts.index_put_((row_idx, prev_tokens[src]), torch.ones_like(row_idx, dtype=counts.dtype),
                          accumulate=True)
    seen = (token_counts([r.prompt_token_ids for r in rows], logits.shape[1], device) > 0) | (counts > 0)
    repetition = to_device([r.params.repetition_penalty for r in rows], torch.float32, device)
    repetition = repetition.clamp(1 / PENALTY_LIMIT, PENALTY_LIMIT)
    frequency = to_device([r.params.frequency_penalty for r in rows], torch.float32, device)
    presence = to_device([r.params.presence_penalty for r in rows], torch.float32, device)
    repetition = torch.where(seen, repetition[:, None], 1.0)                               # [n, V]
    logits = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    return logits.clamp(-LOGIT_LIMIT, LOGIT_LIMIT)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Semantics: out[i, t] = logits[i, t] if bit t % 32 of bitmask[i, t // 32] is set else -inf
    (xgrammar's layout; a row of -1 words allows every token). Out of place, on the device."""
    # logits: [n, V] float32; bitmask: [n, ceil(V / 32)] int32, read as its little-endian bytes: bit t % 8 of
    # byte t // 8 is token t's (one byte per token in the temporaries, not four)
    as_bytes = bitmask.contiguous().view(torch.uint8)                                          # [n, 4W]
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    allowed = ((as_bytes[:, :, None] >> shifts) & 1).flatten(1)[:, :logits.shape[1]]          # [n, V] uint8
    return logits.masked_fill(allowed == 0, float("-inf"))


def keep_allowed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Rows with allowed_token_ids keep those tokens alone; the others keep every token."""
    device = logits.device
    pairs = [(i, t) for i, r in enumerate(rows) for t in r.params.allowed_token_ids or ()]
    unrestricted = to_device([r.params.allowed_token_ids is None for r in rows], torch.bool, device)
    keep = unrestricted[:, None].expand_as(logits).clone()                   # [n, V]
    if pairs:
        row_idx, token_idx = zip(*pairs)
        keep[to_device(row_idx, torch.int64, device), to_device(token_idx, torch.int64, device)] = True
    return logits.masked_fill(~keep, float("-inf"))


def ban_bad_words(logits: torch.Tensor, rows: list[SamplingRow], prev_tokens: torch.Tensor | None) -> torch.Tensor:
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
    row_idx, token_idx, src, expected = (to_device(x, torch.int64, logits.device) for x in zip(*bans))
    banned = src < 0
    if prev_tokens is not None:
        banned = banned | (prev_tokens[src.clamp_min(0)] == expected) & (src >= 0)
    minus_inf = torch.full_like(banned, float("-inf"), dtype=logits.dtype)
    penalty = torch.where(banned, minus_inf, torch.zeros_like(minus_inf))     # -inf + 0 = -inf
    return logits.index_put((row_idx, token_idx), penalty, accumulate=True)


def mask_early_stops(logits: torch.Tensor, rows: list[SamplingRow], eos_token_ids: list[int]) -> torch.Tensor:
    """Rows short of min_tokens cannot end: their stop ids (and eos unless ignore_eos) get -inf."""
    pairs = [(i, t) for i, r in enumerate(rows) if r.num_generated < r.params.min_tokens
             for t in r.params.stop_token_ids + ([] if r.params.ignore_eos else eos_token_ids)]
    if not pairs:
        return logits
    row_idx, token_idx = zip(*pairs)
    indices = (to_device(row_idx, torch.int64, logits.device), to_device(token_idx, torch.int64, logits.device))
    return logits.index_put(indices, torch.full((len(pairs),), float("-inf"), device=logits.device))


def token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[num_rows, vocab_size] float32: how often each token occurs in each row's list."""
    row_idx = to_device([i for i, ids in enumerate(token_lists) for _ in ids], torch.int64, device)
    token_idx = to_device([t for ids in token_lists for t in ids], torch.int64, device)
    counts = torch.zeros(len(token_lists), vocab_size, device=device)
    return counts.index_put_((row_idx, token_idx), torch.ones_like(token_idx, dtype=counts.dtype), accumulate=True)


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row host values as a device tensor, copied without a sync."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
