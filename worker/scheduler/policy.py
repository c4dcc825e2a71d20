"""Scheduling decisions: queue order, preemption victim, and the adapter bypass rule.

The scheduler applies these; it owns the mechanics (blocks, slots, status changes).
"""
from __future__ import annotations

from worker.request import Request


def waiting_key(request: Request) -> tuple[bool, int]:
    """Waiting-queue order: preempted requests first (they were admitted once), then by arrival."""
    return request.num_preemptions == 0, request.arrival_seq


def running_key(request: Request) -> int:
    """Running order, oldest first: the order in which running requests get the step's budget."""
    return request.arrival_seq


def preemption_victim(running: list[Request]) -> Request:
    """The newest running request gives its KV blocks back when memory runs out."""
    return max(running, key=running_key)


def may_overtake(request: Request, skipped: list[Request], max_bypasses: int) -> bool:
    """Whether `request` may take an adapter slot ahead of requests `skipped` for want of a slot.

    Base-model requests always may. An adapter request may not once any skipped request has been
    overtaken `max_bypasses` times: slots then drain until the skipped one gets one.
    """
    if request.adapter is None:
        return True
    return all(s.num_adapter_bypasses < max_bypasses for s in skipped)


def record_overtake(skipped: list[Request]) -> None:
    """A later request was admitted ahead of every request in `skipped`."""
    for request in skipped:
        request.num_adapter_bypasses += 1
