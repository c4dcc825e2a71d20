"""The worker's cyclic garbage collections: the heap frozen once it is built, and every pass timed for the log.

A collection of the oldest generation walks every object the collector tracks while the step loop waits. A worker's
heap after startup is large: a process holding torch, an 8B-shaped model's modules and 1,000 registered adapters
tracks ~305,000 objects, and one full collection of them took ~145 ms on a 2-core machine, a stall of every stream.
The first ones come soon after startup (the adapters' reads add long-lived objects), in the middle of serving. So
the worker freezes its heap (gc.freeze: later collections skip it) once the engine is built and again once the
startup adapters are registered (`freeze`, before the gateway turns healthy), as the gateway freezes its own;
what serving makes afterwards is collected as usual, in passes over it alone.

`GCPauses` times each pass (gc.callbacks); the runner's periodic step line reports them (worker/model_runner/
runner.py StepPaths), and a pass longer than LONG_PAUSE_S is logged as it ends (at most once a minute).
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

LONG_PAUSE_S = 0.02       # a pass this long is worth a line of its own
LONG_PAUSE_LOG_S = 60.0   # ... at most this often


def freeze() -> None:
    """Collect what is garbage now, then move every tracked object out of reach of later collections."""
    gc.collect()
    gc.freeze()


class GCPauses:
    """Collections and their pause times since the last `take`, while installed."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._start = 0.0
        self._logged_at = -LONG_PAUSE_LOG_S
        self._count = self._full = 0
        self._total = self._longest = 0.0

    def install(self) -> None:
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = self._clock()
            return
        pause = self._clock() - self._start
        self._count += 1
        self._full += info.get("generation") == 2
        self._total += pause
        self._longest = max(self._longest, pause)
        if pause >= LONG_PAUSE_S and self._start - self._logged_at >= LONG_PAUSE_LOG_S:
            self._logged_at = self._start
            logger.warning("a garbage collection of generation %d paused the worker for %.0f ms (%d objects "
                           "collected)", info.get("generation", -1), 1e3 * pause, info.get("collected", 0))

    def take(self) -> tuple[int, int, float, float]:
        """(passes, full passes, total seconds, longest seconds) since the last call, and start counting again."""
        taken = self._count, self._full, self._total, self._longest
        self._count = self._full = 0
        self._total = self._longest = 0.0
        return taken

    def describe(self) -> str:
        """`take` as the step line's words."""
        count, full, total, longest = self.take()
        return (f"gc: {count} passes ({full} full) took {1e3 * total:.1f} ms, the longest {1e3 * longest:.1f} ms"
                if count else "gc: no passes")


PAUSES = GCPauses()     # the process's; the worker installs it
