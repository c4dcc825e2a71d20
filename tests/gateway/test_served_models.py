"""ServedModels: per-name locks (loads and unloads of one name run one at a time, and a name leaves no lock),
and the adapter names it serves always the worker's, through failed loads, /tokenize, --lora-dir spellings
and races."""
from __future__ import annotations

import asyncio
import itertools
import json
import re
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from gateway.served_models import ServedModels
from gateway_app import ADAPTER, ANSWER_IDS, BASE, error_of, serve
from registry_worker_client import RegistryWorkerClient
from worker.config import LoRAConfig
from worker.ipc.messages import AdapterCommandResult


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


# Every adapter name the gateway serves is one the worker holds, and the other way round: after failed
# loads, names only /tokenize used, and loads, unloads and requests racing one another.

NAME = "found"
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@pytest.fixture
def lora_dir(tmp_path) -> Path:
    for name in (NAME, "broken"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    return tmp_path


@asynccontextmanager
async def served(lora_dir: Path):
    """(http client, worker) of an app with runtime loading, `lora_dir` and a worker holding a registry that
    refuses to load <lora_dir>/broken."""
    client = RegistryWorkerClient(lambda request: list(ANSWER_IDS), broken=(str(lora_dir / "broken"),))
    async with serve(client, lora=LoRAConfig(lora_dirs=(str(lora_dir),)), allow_runtime_lora_updating=True,
                     api_key="secret") as (http, _, _):
        http.headers["Authorization"] = "Bearer secret"
        yield http, client


async def adapter_names(http: httpx.AsyncClient, client: RegistryWorkerClient) -> set[str]:
    """The adapter names served, after checking that /v1/models, /v1/adapters and the worker agree on them,
    that both processes know every adapter listed, and that /metrics has series of no other adapter."""
    models = {m["id"] for m in (await http.get("/v1/models")).json()["data"]} - {BASE}
    cards = (await http.get("/v1/adapters")).json()["data"]
    assert {c["id"] for c in cards} == models == set(client.registry), (models, cards, client.registry)
    assert all(c["base_model"] == BASE and c["version"] == 1 for c in cards), cards
    metrics = (await http.get("/metrics")).text
    assert set(re.findall(r'lora_name="([^"]*)"', metrics)) <= models
    return models


async def load(http: httpx.AsyncClient, name: str, path: Path | str) -> httpx.Response:
    return await http.post(LOAD, json={"lora_name": name, "lora_path": str(path)})


async def unload(http: httpx.AsyncClient, name: str) -> httpx.Response:
    return await http.post(UNLOAD, json={"lora_name": name})


async def complete(http: httpx.AsyncClient, model: str) -> httpx.Response:
    return await http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})


async def test_a_failed_automatic_load_leaves_the_name_nowhere(lora_dir):
    async with served(lora_dir) as (http, client):
        failed = await complete(http, "broken")
        tokenized = await http.post("/tokenize", json={"model": "broken", "prompt": "hi"})
        names = await adapter_names(http, client)
        sent = list(client.requests)
        unloaded = await unload(http, "broken")
        client.broken = ()                           # the folder mended: the name loads, and unloads
        mended = await complete(http, "broken")
        assert await adapter_names(http, client) == {ADAPTER, "broken"}
        assert (await unload(http, "broken")).status_code == 200
        assert await adapter_names(http, client) == {ADAPTER}
    message = f"adapter_config.json in {lora_dir / 'broken'} is unreadable"
    assert error_of(failed) == error_of(tokenized) == (400, message, None)
    assert names == {ADAPTER} and sent == []              # refused before a request reached the worker
    assert error_of(unloaded) == (404, "The lora adapter 'broken' cannot be found.", None)
    assert mended.status_code == 200


@pytest.mark.parametrize("route, body", [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})])
async def test_an_adapter_only_tokenize_named_is_loaded_and_unloads(lora_dir, route, body):
    async with served(lora_dir) as (http, client):
        named = await http.post(route, json={"model": NAME, **body})
        names = await adapter_names(http, client)
        again = await load(http, NAME, lora_dir / NAME)
        unloaded = await unload(http, NAME)
        after = await adapter_names(http, client)
        reloaded = await load(http, NAME, lora_dir / NAME)
    assert named.status_code == 200 and names == {ADAPTER, NAME}
    assert error_of(again)[:2] == (400, f"The lora adapter '{NAME}' has already been loaded. If you want to load "
                                        "the adapter in place, set 'load_inplace' to True.")
    assert unloaded.status_code == 200 and after == {ADAPTER} and reloaded.status_code == 200


async def test_a_directory_has_one_name_under_lora_dir(lora_dir):
    (lora_dir / "alias").symlink_to(lora_dir / NAME)
    async with served(lora_dir) as (http, client):
        answers = [await complete(http, spelling) for spelling in (f"{NAME}/", "alias", f"{NAME}//", NAME)]
        names = await adapter_names(http, client)
    served_as = f"Its adapter directory under --lora-dir is served as `{NAME}`."
    for answer, spelling in zip(answers, (f"{NAME}/", "alias", f"{NAME}//")):
        assert error_of(answer) == (404, f"The model `{spelling}` does not exist. {served_as}", "model")
    assert answers[-1].status_code == 200 and names == {ADAPTER, NAME}
    assert [c[:2] for c in client.adapter_commands if c[0] == "load"] == [("load", ADAPTER), ("load", NAME)]


@pytest.mark.parametrize("name", ["x/../found", "..", "./found", "a/.", "x/./y"])
async def test_a_name_with_a_dot_segment_is_refused_as_no_url_reaches_it(lora_dir, name):
    async with served(lora_dir) as (http, client):
        loaded = await load(http, name, lora_dir / NAME)
        requested = await complete(http, name)
        names = await adapter_names(http, client)
    rule = "An adapter name must not have '.' or '..' between slashes: /v1/adapters/{name} could not reach it."
    assert error_of(loaded) == (400, rule, "lora_name")
    assert error_of(requested) == (404, f"The model `{name}` does not exist.", "model")
    assert names == {ADAPTER}


@pytest.mark.parametrize("linked", ["adapter_model.safetensors", "adapter_config.json"])
async def test_a_load_by_path_follows_the_automatic_loads_rule_for_linked_files(lora_dir, tmp_path_factory, linked):
    outside = tmp_path_factory.mktemp("outside")
    (outside / linked).write_text("{}")
    (lora_dir / "linked").mkdir()
    (lora_dir / "linked" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    (lora_dir / "linked" / linked).unlink(missing_ok=True)
    (lora_dir / "linked" / linked).symlink_to(outside / linked)
    async with served(lora_dir) as (http, client):
        by_path = await load(http, "linked", lora_dir / "linked")
        by_name = await complete(http, "linked")
        names = await adapter_names(http, client)
    assert error_of(by_path) == (400, f"The lora adapter path '{lora_dir / 'linked'}' is outside the directories "
                                      "allowed by --lora-dir.", "lora_path")
    assert error_of(by_name) == (404, "The model `linked` does not exist.", "model")
    assert names == {ADAPTER}


async def test_an_unload_the_worker_answers_not_found_stops_serving_the_name():
    """Both processes must end without the name: the worker no longer holds it, so neither does the gateway."""
    async with serve(allow_runtime_lora_updating=True) as (http, client, _):
        client.adapter_results[ADAPTER] = AdapterCommandResult(0, ok=False, status_code=404,
                                                               message=f"The lora adapter '{ADAPTER}' cannot be found.")
        unloaded = await unload(http, ADAPTER)
        models = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
    assert error_of(unloaded) == (404, f"The lora adapter '{ADAPTER}' cannot be found.", None)
    assert models == [BASE]


# Races: every start order of the operations, each with seeded delays at every send, take and answer.

SEEDS = 3                # runs per start order
START_YIELDS = 40        # an op starts, and the abandoned request is left, after up to this many loop turns
EXPECTED = {"request": {200, 404}, "tokenize": {200}, "load": {200, 400}, "unload": {200, 404},
            "abandoned": {None}}


async def operation(http: httpx.AsyncClient, client: RegistryWorkerClient, op: str, name: str, path: Path,
                    answered: list[str]) -> int | None:
    """One client's call on `name`, its status (appending `op` to `answered`); "abandoned": a request whose
    client leaves mid-way."""
    await client.jitter(START_YIELDS)
    try:
        return await _call(http, client, op, name, path)
    finally:
        answered.append(op)


async def _call(http: httpx.AsyncClient, client: RegistryWorkerClient, op: str, name: str, path: Path) -> int | None:
    if op == "request":
        return (await complete(http, name)).status_code
    if op == "tokenize":
        return (await http.post("/tokenize", json={"model": name, "prompt": "hi"})).status_code
    if op == "load":
        return (await load(http, name, path)).status_code
    if op == "unload":
        return (await unload(http, name)).status_code
    task = asyncio.create_task(complete(http, name))
    await client.jitter(START_YIELDS)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return None


async def race(http: httpx.AsyncClient, client: RegistryWorkerClient, ops: tuple[str, ...], seed: int,
               name: str, path: Path) -> tuple[list[int | None], tuple[str, ...]]:
    """Each op's status and the order they were answered in, once the loads and unloads they started have all
    finished (an abandoned request's load finishes after its client left)."""
    client.reseed(seed)
    answered: list[str] = []
    statuses = await asyncio.gather(*(operation(http, client, op, name, path, answered) for op in ops))
    served_models = http._transport.app.state.server.served_models
    for _ in range(100_000):                   # event-loop turns, not time: each turn lets a load move on
        if not served_models._locks:
            return statuses, tuple(answered)
        await asyncio.sleep(0)
    raise AssertionError(f"a load or unload of {sorted(served_models._locks)} never finished")


@pytest.mark.parametrize("loaded_first", [False, True])
async def test_loads_unloads_and_requests_racing_leave_both_processes_agreeing(lora_dir, loaded_first):
    """Load, unload, an auto-loading request, /tokenize and an abandoned request on one --lora-dir adapter, in
    every start order; after each run the gateway and the worker hold the same names, and the name loads and
    unloads again."""
    orders, worker_orders = set(), set()
    async with served(lora_dir) as (http, client):
        for seed, ops in enumerate(ops for ops in itertools.permutations(EXPECTED) for _ in range(SEEDS)):
            if loaded_first:
                assert (await load(http, NAME, lora_dir / NAME)).status_code == 200
            statuses, answered = await race(http, client, ops, seed, NAME, lora_dir / NAME)
            orders.add(answered)
            worker_orders.add(tuple(client.events))
            for op, status in zip(ops, statuses):
                assert status in EXPECTED[op], (seed, ops, op, status, client.events)
            if NAME in await adapter_names(http, client):
                assert (await unload(http, NAME)).status_code == 200, (seed, ops, client.events)
            assert (await load(http, NAME, lora_dir / NAME)).status_code == 200
            assert (await unload(http, NAME)).status_code == 200
            assert await adapter_names(http, client) == {ADAPTER}
    unload_then_request = [events for events in worker_orders if any(
        a == ("unload", NAME, True) and b == ("request", NAME, False) for a, b in zip(events, events[1:]))]
    assert len(orders) >= 60 and unload_then_request, "the runs raced too little"


async def test_racing_a_broken_adapter_never_serves_it(lora_dir):
    path = lora_dir / "broken"
    expected = {"request": {400}, "tokenize": {400}, "load": {400}, "unload": {404}, "abandoned": {None}}
    async with served(lora_dir) as (http, client):
        for seed, ops in enumerate(itertools.permutations(expected)):
            statuses, _ = await race(http, client, ops, seed, "broken", path)
            for op, status in zip(ops, statuses):
                assert status in expected[op], (seed, ops, op, status, client.events)
            assert await adapter_names(http, client) == {ADAPTER}
