"""WarmReadLog: the log lines of the --lora-modules adapters' reads into host memory, which go on after the server
has started serving (once read, their first requests wait only for the host -> GPU copy).

    reading 12 adapters into host memory                    once the registrations pause
    read 5 of 12 adapters into host memory so far (10 s)    at most every PROGRESS_S while reads remain
    all 12 adapters read into host memory in 14.2 s         once, when the last read is filed

Adapters registered while others are being read join their round. The gateway registers the --lora-modules adapters
one after the other, so a round's lines wait until no read has started for PAUSE_S: its first line counts them all.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from worker.request import AdapterRef

logger = logging.getLogger(__name__)

PAUSE_S = 0.5          # no read started for this long: the registrations have paused
PROGRESS_S = 10.0      # the least time between two lines of one round


@dataclass
class _Round:
    start: float                                             # clock time of its first read
    last_start: float                                        # clock time of its latest read
    end: float | None = None                                 # clock time its last read was found filed
    pending: set[AdapterRef] = field(default_factory=set)   # reads started, not yet filed
    num_started: int = 0
    num_failed: int = 0
    announced: bool = False                                  # its first line is written
    last_line: float = 0.0                                   # clock time of its latest line


class WarmReadLog:
    """Owned by the engine: told of each warm read as it starts (`started`) and of each read that failed (`failed`);
    `update`, after the finished reads are filed, writes the lines that are due."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._round: _Round | None = None     # None: no warm read under way, nor a line still to write

    @property
    def open(self) -> bool:
        """A line is still to come (the idle worker keeps updating until it is written)."""
        return self._round is not None

    def started(self, ref: AdapterRef) -> None:
        now = self._clock()
        if self._round is None:
            self._round = _Round(now, now)
        self._round.pending.add(ref)
        self._round.num_started += 1
        self._round.last_start, self._round.end = now, None

    def failed(self, ref: AdapterRef) -> None:
        """`ref`'s read failed (its requests were told why)."""
        if self._round is not None and ref in self._round.pending:
            self._round.pending.discard(ref)
            self._round.num_failed += 1

    def update(self, reading: Callable[[AdapterRef], bool]) -> None:
        """Forget the reads no longer `reading` (queued or running), and write the round's lines that are due."""
        r = self._round
        if r is None:
            return
        r.pending = {ref for ref in r.pending if reading(ref)}
        now = self._clock()
        if not r.pending and r.end is None:
            r.end = now
        if now - r.last_start < PAUSE_S:
            return                            # registrations may still be coming
        if not r.announced:
            logger.info("reading %s into host memory", _adapters(r.num_started))
            r.announced, r.last_line = True, now
        if not r.pending:
            self._finish(r)
        elif now - r.last_line >= PROGRESS_S:
            logger.info("read %d of %s into host memory so far (%.0f s)",
                        r.num_started - len(r.pending), _adapters(r.num_started), now - r.start)
            r.last_line = now

    def _finish(self, r: _Round) -> None:
        seconds = r.end - r.start
        if r.num_failed:
            logger.warning("%d of %s read into host memory in %.1f s; %d failed (see above)",
                           r.num_started - r.num_failed, _adapters(r.num_started), seconds, r.num_failed)
        else:
            logger.info("all %s read into host memory in %.1f s", _adapters(r.num_started), seconds)
        self._round = None


def _adapters(n: int) -> str:
    return f"{n} adapter" if n == 1 else f"{n} adapters"
