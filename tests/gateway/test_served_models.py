"""ServedModels' per-name locks: loads and unloads of one name run one at a time, and a name leaves no lock."""
from __future__ import annotations

import asyncio

from gateway.served_models import ServedModels


async def test_a_name_is_locked_one_holder_at_a_time_and_leaves_no_lock_behind():
    models = ServedModels(("base",), "/models/base")
    order: list[str] = []

    async def hold(name: str, tag: str) -> None:
        async with models.lock(name):
            order.append(f"{tag} in")
            await asyncio.sleep(0.01)
            order.append(f"{tag} out")

    await asyncio.gather(hold("a", "first"), hold("a", "second"), hold("b", "other"))
    assert order.index("first out") < order.index("second in")       # same name: one after the other
    assert order.index("other in") < order.index("first out")        # another name does not wait
    await asyncio.gather(*(hold(f"made-up-{i}", str(i)) for i in range(200)))
    assert models._locks == {}
