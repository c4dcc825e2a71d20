"""Logprobs of the raw model distribution: the sampled (or scored) token's logprob and rank, and the k best tokens,
computed on the device and read back with the step's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.ipc.messages import TokenLogprob


@dataclass
class RowLogprobs:
    """Logprob tensors of the rows that asked for them (see logprob_tensors), still on the device."""
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


def compute_logprobs(logits_rows: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """Row i of `logits_rows` scored against token_ids[i] (raw distribution), with its k best tokens."""
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits_rows.device)
    return _to_token_logprobs(*(t.tolist() for t in to_host(*logprob_tensors(logits_rows, ids, k))))


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, k: int):
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
