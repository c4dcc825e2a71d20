"""Scheduling decisions: queue order, preemption victim, and the adapter bypass rule.

The scheduler applies these; it owns the mechanics (blocks, slots, status changes).
"""
from __future__ import annotations

from collections.abc import Container

from worker.batch import ScheduledSeq
from worker.request import AdapterRef, Request


def waiting_key(request: Request) -> tuple[bool, int]:
    """Waiting-queue order: preempted requests first (they were admitted once), then by arrival."""
    return request.num_preemptions == 0, request.arrival_seq


def running_key(request: Request) -> int:
    """Running order, oldest first: the order in which running requests get the step's budget."""
    return request.arrival_seq


def row_key(seq: ScheduledSeq) -> int:
    """Row order within a step: rows grouped by GPU slot (base rows first, stable otherwise), so each
    adapter's rows form one LoRA segment and its weights are read once per row tile, not once per row."""
    return seq.lora_slot


def preemption_victim(running: list[Request]) -> Request:
    """The newest running request gives its KV blocks back when memory runs out."""
    return max(running, key=running_key)


def may_overtake(request: Request, skipped: list[Request], max_bypasses: int,
                 draining: AdapterRef | None) -> bool:
    """Whether `request` may take an adapter slot ahead of requests `skipped` for want of a slot.

    Base-model requests always may. Once a skipped request has been overtaken `max_bypasses` times,
    one slot is drained for it: requests of the `draining` adapter (see slot_to_drain) wait, those of
    the other resident adapters still run. With no slot to drain (all pinned), nobody waits.
    """
    if request.adapter is None or all(s.num_adapter_bypasses < max_bypasses for s in skipped):
        return True
    return draining is not None and request.adapter != draining


def slot_to_drain(running: list[Request], pinned: Container[AdapterRef]) -> AdapterRef | None:
    """The adapter whose slot frees soonest if it admits no one new: the unpinned adapter in use whose
    longest remaining request (by max_tokens) is shortest."""
    remaining: dict[AdapterRef, int] = {}
    for r in running:
        if r.adapter is not None and r.adapter not in pinned:
            left = r.params.max_tokens - r.num_generated
            remaining[r.adapter] = max(remaining.get(r.adapter, 0), left)
    return min(remaining, key=remaining.__getitem__, default=None)


def record_overtake(skipped: list[Request]) -> None:
    """A later request was admitted ahead of every request in `skipped`."""
    for request in skipped:
        request.num_adapter_bypasses += 1
