"""build_app's lifespan: once the worker is ready, what startup built is frozen out of garbage collection."""
from __future__ import annotations

import gc

from gateway_app import serve


async def test_startup_heap_is_frozen_once_the_worker_is_ready():
    gc.unfreeze()
    async with serve():
        assert gc.get_freeze_count() > 0
