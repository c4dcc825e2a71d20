"""Names the gateway serves: the base model's names and the adapters loaded on top of it.

A request's `model` is a served base name (no adapter), an adapter name, or `base:adapter`. With
runtime loading on, an unknown name that is an adapter directory under a --lora-dir root is loaded on first
use, by the same command as /v1/load_lora_adapter. Such a directory has one name, its real path relative to
its root (`team/sql`): another spelling (`team/sql/`, a symlink to it) is not found, and the answer names the
spelling to use, so one directory never takes two slots. Adapter names are at most 255 characters with no
commas, whitespace or control characters (vLLM's routers split adapter lists on commas, and each name is a
label on /metrics), and no `.` or `..` segment (a client's URL normalisation would turn
/v1/adapters/x/../y into /v1/adapters/y).

An adapter name is served from the moment the worker holds it until it has let it go: every load and unload
is one worker command under the name's lock, and finishes (the served names following the worker's answer)
even when the client that asked has gone. ServedModels also writes vLLM's model cards for /v1/models, with
each adapter's lineage (root = its path, parent = its base model).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

from gateway.api_error import APIError, model_not_found
from worker.config import LoRAConfig

MAX_ADAPTER_NAME = 255
T = TypeVar("T")


def adapter_name_problem(name: str) -> str | None:
    """What is wrong with `name` as an adapter name, None if nothing."""
    if len(name) > MAX_ADAPTER_NAME:
        return f"An adapter name must be at most {MAX_ADAPTER_NAME} characters long, got {len(name)}."
    if any(c == "," or c.isspace() or not c.isprintable() for c in name):
        return "An adapter name must not contain commas, whitespace or control characters."
    if any(part in (".", "..") for part in name.split("/")):
        return "An adapter name must not have '.' or '..' between slashes: /v1/adapters/{name} could not reach it."
    return None


def check_adapter_name(name: str) -> None:
    """400 naming the rule `name` breaks."""
    problem = adapter_name_problem(name)
    if problem is not None:
        raise APIError(problem, type="InvalidUserInput", param="lora_name")


@dataclass(frozen=True)
class Adapter:
    """An adapter the gateway serves by name, as the client loaded it."""
    name: str
    path: str
    base_model_name: str                   # one of the served base names
    pinned: bool = False
    created: int = field(default_factory=lambda: int(time.time()))


class ServedModels:
    """The served base names and adapter names, and what a request's `model` resolves to."""

    def __init__(self, served_names: tuple[str, ...], model_path: str, lora_dirs: tuple[str, ...] = (),
                 worker: Any = None, forget: Callable[[str], None] = lambda name: None):
        self.served_names = served_names
        self.model_path = model_path
        self._roots = LoRAConfig(lora_dirs=lora_dirs)   # find_adapter_dir: where unknown names are looked up
        self._worker = worker          # gateway.worker_client.WorkerClient or a stand-in: adapter_command()
        self._forget = forget          # what else an unloaded adapter leaves (its /metrics series)
        self.created = int(time.time())
        self._adapters: dict[str, Adapter] = {}
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}   # name -> (lock, holders and waiters)

    @property
    def base_name(self) -> str:
        return self.served_names[0]

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def get(self, name: str) -> Adapter | None:
        return self._adapters.get(name)

    def names(self) -> list[str]:
        return list(self._adapters)

    async def load(self, name: str, path: str, *, base_model_name: str | None = None, load_inplace: bool = False,
                   pinned: bool = False, warm: bool = False) -> None:
        """Load `name` in the worker, then serve it; an APIError with the worker's answer if it refuses."""
        await _finish_even_if_cancelled(self._load(name, path, base_model_name, load_inplace, pinned, warm))

    async def unload(self, name: str) -> None:
        """Unload `name` in the worker, then stop serving it; 404 if it is not served."""
        await _finish_even_if_cancelled(self._unload(name))

    async def resolve(self, model: str | None, may_load: bool = False) -> str | None:
        """The adapter a request's `model` names, None for the base model; 404 for an unknown name.

        Only with `may_load` is an unknown name looked up under the --lora-dir roots, and loaded.
        """
        if not model or model in self.served_names:
            return None
        name = self._known(model)
        if name is not None:
            return name
        path = self._found(model) if may_load else None
        if path is None:
            raise model_not_found(model)
        await _finish_even_if_cancelled(self._load(model, path, None, False, False, False, if_absent=True))
        return model

    @asynccontextmanager
    async def lock(self, name: str) -> AsyncIterator[None]:
        """Serialises loads and unloads of one adapter name. A name's lock lives only while someone holds or
        awaits it, so names a client makes up leave nothing behind."""
        lock, users = self._locks.get(name, (asyncio.Lock(), 0))
        self._locks[name] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._locks[name]
            if users == 1:
                del self._locks[name]
            else:
                self._locks[name] = (lock, users - 1)

    async def _load(self, name: str, path: str, base_model_name: str | None, load_inplace: bool, pinned: bool,
                    warm: bool, if_absent: bool = False) -> None:
        """The worker's load, then the name served; `if_absent`: nothing to do if it is served already
        (two requests naming one --lora-dir adapter)."""
        async with self.lock(name):
            if name in self._adapters and not load_inplace:
                if if_absent:
                    return
                raise APIError(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                               "adapter in place, set 'load_inplace' to True.", type="InvalidUserInput")
            result = await self._worker.adapter_command("load", name, path, load_inplace=load_inplace,
                                                        pinned=pinned, warm=warm)
            if not result.ok:
                raise APIError(result.message, result.status_code)
            base = base_model_name if base_model_name in self.served_names else self.base_name
            self._adapters[name] = Adapter(name, path, base, pinned)

    async def _unload(self, name: str) -> None:
        async with self.lock(name):
            if name not in self._adapters:
                raise APIError(f"The lora adapter '{name}' cannot be found.", 404)
            result = await self._worker.adapter_command("unload", name)
            if not result.ok and result.status_code != 404:      # 404: the worker holds it no more either
                raise APIError(result.message, result.status_code)
            del self._adapters[name]
            self._forget(name)
            if not result.ok:
                raise APIError(result.message, result.status_code)

    def _known(self, model: str) -> str | None:
        """The served adapter `model` names, alone or as `base:adapter`; None if none."""
        if model in self._adapters:
            return model
        for base in self.served_names:
            adapter = model.removeprefix(base + ":")
            if adapter != model and adapter in self._adapters:
                return adapter
        return None

    def _found(self, model: str) -> str | None:
        """The --lora-dir directory named `model`, None if there is none; 404 naming the directory's one
        name when `model` spells it another way."""
        path = self._roots.find_adapter_dir(model) if adapter_name_problem(model) is None else None
        if path is None:
            return None
        name = self._roots.adapter_name_of(path)
        if name != model:
            raise APIError(f"The model `{model}` does not exist. Its adapter directory under --lora-dir is "
                           f"served as `{name}`.", 404, param="model")
        return path

    def cards(self, max_model_len: int) -> list[dict[str, Any]]:
        base_cards = [_card(name, self.created, self.model_path, None, max_model_len)
                      for name in self.served_names]
        return base_cards + [_card(a.name, a.created, a.path, a.base_model_name, None)
                             for a in self._adapters.values()]

    def card(self, model: str, max_model_len: int) -> dict[str, Any]:
        """The card of a base name or an adapter name; 404 otherwise."""
        for card in self.cards(max_model_len):
            if card["id"] == model:
                return card
        raise model_not_found(model)


async def _finish_even_if_cancelled(work: Awaitable[T]) -> T:
    """`await work`, which runs to its end even if the caller is cancelled meanwhile (a client gone while
    the worker loads its adapter): the served names then still follow the worker's answer."""
    task = asyncio.ensure_future(work)
    task.add_done_callback(lambda done: done.cancelled() or done.exception())   # retrieved if no one waits
    return await asyncio.shield(task)


def _card(model_id: str, created: int, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "vllm", "root": root,
            "parent": parent, "max_model_len": max_model_len, "permission": [_permission()]}


def _permission() -> dict[str, Any]:
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": int(time.time()),
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}
