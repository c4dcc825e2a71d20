"""LogitEdits: a request's logit edits prepared once, at its first sampled step, so that a step's host work does
not grow with the request's lists (allowed_token_ids, logit_bias, bad words, stop ids, its prompt for the
penalties). penalties_and_bans.py applies them; every list is deduplicated here and lives on the device.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from worker.ipc.messages import SamplingParams
from worker.model_runner.sampling_passes import asks_penalties


class BadWords:
    """A request's bad words indexed by their prefixes: a step looks up the output's tails, one per distinct
    prefix length, instead of walking every word.

    Running example: words [[9], [7, 8, 9], [5, 8, 6]]: `always` bans 9; `by_prefix` maps (7, 8) -> [9] and
    (5, 8) -> [6]; with the last output token still pending, `by_known` maps (7,) -> (expected [8], banned [9])
    and (5,) -> ([8], [6])."""

    def __init__(self, words: list[list[int]], device: torch.device):
        words = {tuple(w) for w in words}
        self.always = _ids({w[0] for w in words if len(w) == 1}, device)            # [k] int64 or None
        lasts: dict[tuple[int, ...], set[int]] = defaultdict(set)
        for *prefix, last in (w for w in words if len(w) > 1):
            lasts[tuple(prefix)].add(last)
        known: dict[tuple[int, ...], list[tuple[int, int]]] = defaultdict(list)
        for prefix, banned in lasts.items():
            known[prefix[:-1]].extend((prefix[-1], last) for last in sorted(banned))
        self.prefix_lengths = sorted({len(p) for p in lasts})
        self.by_prefix = {p: _ids(banned, device) for p, banned in lasts.items()}       # prefix -> [k] int64
        # prefix without its last token -> [2, k]: (the pending id expected, the id banned if it is)
        self.by_known = {p: torch.tensor(list(zip(*pairs)), dtype=torch.int64).to(device, non_blocking=True)
                         for p, pairs in known.items()}

    def bans(self, output: list[int], num_pending: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(ids banned outright, [2, k] (expected pending id, id banned if it is) pairs) after `output`."""
        outright = [] if self.always is None else [self.always]
        conditional = []
        for length in self.prefix_lengths:
            known = length - 1 if num_pending else length
            if len(output) < known:
                break
            tail = tuple(output[len(output) - known:])
            if num_pending:
                pairs = self.by_known.get(tail)
                conditional += [] if pairs is None else [pairs]
            elif (banned := self.by_prefix.get(tail)) is not None:
                outright.append(banned)
        return outright, conditional


class PenaltyCounts:
    """The penalties' token statistics of one request: which tokens its prompt holds (built once) and how often
    each output token occurred, counted as tokens arrive on the host."""

    def __init__(self, prompt_token_ids: list[int], vocab_size: int, device: torch.device):
        self.prompt_seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)        # [V]
        if prompt_token_ids:
            self.prompt_seen.index_fill_(0, _ids(set(prompt_token_ids), device), True)
        self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)   # [V]
        self._num_counted = 0

    def count(self, output_token_ids: list[int]) -> torch.Tensor:
        """[V] float32 counts of `output_token_ids`, of which only the tokens new since the last call are read."""
        new = output_token_ids[self._num_counted:]
        if new:
            idx = torch.tensor(new, dtype=torch.int64).to(self.output_counts.device, non_blocking=True)
            self.output_counts.index_put_((idx,), torch.ones_like(idx, dtype=torch.float32), accumulate=True)
            self._num_counted = len(output_token_ids)
        return self.output_counts


class LogitEdits:
    """What a request's settings do to its logits, as device tensors."""

    def __init__(self, params: SamplingParams, prompt_token_ids: list[int], vocab_size: int,
                 eos_token_ids: list[int], device: torch.device):
        self.allowed = None                        # [V] bool: the tokens allowed_token_ids keeps
        if params.allowed_token_ids is not None:
            self.allowed = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.allowed.index_fill_(0, _ids(set(params.allowed_token_ids), device), True)
        self.bias = None                           # ([k] int64 ids, [k] float32 biases), each id once
        if params.logit_bias:
            ids, biases = zip(*params.logit_bias.items())
            self.bias = (_ids(ids, device, sort=False),
                         torch.tensor(biases, dtype=torch.float32).to(device, non_blocking=True))
        self.bad_words = BadWords(params.bad_words_token_ids, device) if params.bad_words_token_ids else None
        # [k] int64: what min_tokens bans, the stop ids and eos unless ignore_eos
        self.early_stops = _ids({*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)}, device)
        self.penalties = PenaltyCounts(prompt_token_ids, vocab_size, device) if asks_penalties(params) else None


def _ids(ids, device: torch.device, sort: bool = True) -> torch.Tensor | None:
    """[k] int64 on the device (sorted when `sort`); None when empty."""
    ids = sorted(ids) if sort else list(ids)
    return torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True) if ids else None
