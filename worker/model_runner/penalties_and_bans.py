"""The per-request edits of the logits before any draw: logit_bias, the penalties (repetition, frequency,
presence), then the bans (a grammar's token bitmask, allowed_token_ids, bad_words, min_tokens), with vLLM's
semantics. Their result is what a greedy row takes the argmax of.

Each edit is one batched tensor operation over the rows, skipped when no row asks for it
(sampling_passes.py); per-request settings become [num_rows] tensors, copied to the device without a sync.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from worker.model_runner.logit_edits import LogitEdits
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
    of it. `prev_tokens`: the previous step's sampled ids on the device, where rows' pending tokens are. A row's
    lists are read from its LogitEdits (built here when the row brings none), never walked per step."""
    # logits: [num_rows, vocab_size]
    logits = logits.float()
    edits = [r.edits or LogitEdits(r.params, r.prompt_token_ids, logits.shape[1], eos_token_ids, logits.device)
             for r in rows]
    if any(asks_logit_bias(r.params) for r in rows):
        logits = apply_logit_bias(logits, edits)
    if any(asks_penalties(r.params) for r in rows):
        logits = apply_penalties(logits, rows, edits, prev_tokens)
    if token_bitmask is not None:
        logits = apply_token_bitmask(logits, token_bitmask)
    if any(asks_allowed_tokens(r.params) for r in rows):
        logits = keep_allowed(logits, edits)
    if any(asks_bad_words(r.params) for r in rows):
        logits = ban_bad_words(logits, rows, edits, prev_tokens)
    return mask_early_stops(logits, rows, edits)


def apply_logit_bias(logits: torch.Tensor, edits: list[LogitEdits]) -> torch.Tensor:
    biased = [(i, e.bias) for i, e in enumerate(edits) if e.bias is not None]
    row_idx, token_idx = row_pairs([(i, ids) for i, (ids, _) in biased], logits.device)
    bias = torch.cat([values for _, (_, values) in biased])
    return logits.index_put((row_idx, token_idx), bias, accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], edits: list[LogitEdits],
                    prev_tokens: torch.Tensor | None) -> torch.Tensor:
    """Repetition over the prompt and output tokens, frequency and presence over the output tokens."""
    device, vocab_size = logits.device, logits.shape[1]
    none_seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    none_counted = torch.zeros(vocab_size, dtype=torch.float32, device=device)
    counts = torch.stack([none_counted if e.penalties is None else e.penalties.count(r.output_token_ids)
                          for r, e in zip(rows, edits)])                                       # [n, V] (a copy)
    pending = [(i, r.pending_row) for i, r in enumerate(rows) if r.num_pending]
    if pending:   # tokens not on the host yet are counted from the device, without reading them back
        assert prev_tokens is not None, "rows with a pending token need the previous sampler output"
        row_idx, src = (to_device(list(x), torch.int64, device) for x in zip(*pending))
        counts.index_put_((row_idx, prev_tokens[src]), torch.ones_like(row_idx, dtype=counts.dtype),
                          accumulate=True)
    prompt_seen = torch.stack([none_seen if e.penalties is None else e.penalties.prompt_seen for e in edits])
    seen = prompt_seen | (counts > 0)                                                          # [n, V]
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


def keep_allowed(logits: torch.Tensor, edits: list[LogitEdits]) -> torch.Tensor:
    """Rows with allowed_token_ids keep those tokens alone; the others keep every token."""
    every = torch.ones(logits.shape[1], dtype=torch.bool, device=logits.device)
    keep = torch.stack([every if e.allowed is None else e.allowed for e in edits])              # [n, V]
    return logits.masked_fill(~keep, float("-inf"))


def ban_bad_words(logits: torch.Tensor, rows: list[SamplingRow], edits: list[LogitEdits],
                  prev_tokens: torch.Tensor | None) -> torch.Tensor:
    """A bad word's last token is banned when the output ends with the rest of it (a one-token word:
    always). A pending last token is compared on the device, so the host never waits for it.

    Running example: bad word [7, 8, 9], output on the host [.., 7] and a pending token: 9 is banned
    where prev_tokens[pending_row] == 8."""
    outright, conditional = [], []     # (row, [k] banned ids); (row, [2, k] expected pending id and banned id)
    for i, (r, e) in enumerate(zip(rows, edits)):
        if e.bad_words is not None:
            ids, pairs = e.bad_words.bans(r.output_token_ids, r.num_pending)
            outright += [(i, t) for t in ids]
            conditional += [(i, p) for p in pairs]
    if outright:
        logits = logits.index_put(row_pairs(outright, logits.device), logits.new_full((), float("-inf")))
    if conditional and prev_tokens is not None:
        row_idx, _ = row_pairs([(i, p[0]) for i, p in conditional], logits.device)
        expected, token_idx = torch.cat([p for _, p in conditional], dim=1)
        src = to_device([rows[i].pending_row for i, _ in conditional], torch.int64, logits.device)
        src = torch.repeat_interleave(src, to_device([p.shape[1] for _, p in conditional], torch.int64,
                                                     logits.device), output_size=len(expected))
        banned = prev_tokens[src] == expected
        minus_inf = torch.full_like(banned, float("-inf"), dtype=logits.dtype)
        penalty = torch.where(banned, minus_inf, torch.zeros_like(minus_inf))     # -inf + 0 = -inf
        logits = logits.index_put((row_idx, token_idx), penalty, accumulate=True)
    return logits


def mask_early_stops(logits: torch.Tensor, rows: list[SamplingRow], edits: list[LogitEdits]) -> torch.Tensor:
    """Rows short of min_tokens cannot end: their stop ids (and eos unless ignore_eos) get -inf."""
    early = [(i, e.early_stops) for i, (r, e) in enumerate(zip(rows, edits))
             if r.num_generated < r.params.min_tokens and e.early_stops is not None]
    if not early:
        return logits
    return logits.index_put(row_pairs(early, logits.device), logits.new_full((), float("-inf")))


def row_pairs(per_row: list[tuple[int, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) of every id in the rows' [k] id tensors, built on the device: the host walks the
    rows, never the ids. Running example: [(0, [3, 7]), (2, [5])] gives rows [0, 0, 2], ids [3, 7, 5]."""
    sizes = [len(ids) for _, ids in per_row]
    rows = to_device([i for i, _ in per_row], torch.int64, device)
    row_idx = torch.repeat_interleave(rows, to_device(sizes, torch.int64, device), output_size=sum(sizes))
    return row_idx, torch.cat([ids for _, ids in per_row])


def to_device(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-row host values as a device tensor, copied without a sync."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)
