"""Names the gateway serves: the base model's names and the adapters loaded on top of it.

A request's `model` is a served base name (no adapter), an adapter name, or `base:adapter`. With
runtime loading on, an unknown name that is an adapter directory under a --lora-dir root is registered
on first use; the worker, which knows the same roots, loads it when the request arrives. Adapter names
are at most 255 characters with no commas, whitespace or control characters: vLLM's routers split
adapter lists on commas, and each name is a label on /metrics. ServedModels also writes
vLLM's model cards for /v1/models, with each adapter's lineage (root = its path, parent = its base model).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from gateway.api_error import APIError, model_not_found
from worker.config import LoRAConfig

MAX_ADAPTER_NAME = 255


def adapter_name_problem(name: str) -> str | None:
    """What is wrong with `name` as an adapter name, None if nothing."""
    if len(name) > MAX_ADAPTER_NAME:
        return f"An adapter name must be at most {MAX_ADAPTER_NAME} characters long, got {len(name)}."
    if any(c == "," or c.isspace() or not c.isprintable() for c in name):
        return "An adapter name must not contain commas, whitespace or control characters."
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

    def __init__(self, served_names: tuple[str, ...], model_path: str, lora_dirs: tuple[str, ...] = ()):
        self.served_names = served_names
        self.model_path = model_path
        self._roots = LoRAConfig(lora_dirs=lora_dirs)   # find_adapter_dir: the worker's own lookup rule
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

    def add(self, name: str, path: str, base_model_name: str | None = None, pinned: bool = False) -> None:
        base = base_model_name if base_model_name in self.served_names else self.base_name
        self._adapters[name] = Adapter(name, path, base, pinned)

    def remove(self, name: str) -> None:
        del self._adapters[name]

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

    def resolve(self, model: str | None, may_load: bool = False) -> str | None:
        """The adapter a request's `model` names, None for the base model; 404 for an unknown name.

        Only with `may_load` is an unknown name looked up under the --lora-dir roots (and registered).
        """
        if not model or model in self.served_names:
            return None
        if model in self._adapters:
            return model
        for base in self.served_names:
            adapter = model.removeprefix(base + ":")
            if adapter != model and adapter in self._adapters:
                return adapter
        path = self._roots.find_adapter_dir(model) if may_load and adapter_name_problem(model) is None else None
        if path is None:
            raise model_not_found(model)
        self.add(model, path)
        return model

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


def _card(model_id: str, created: int, root: str, parent: str | None, max_model_len: int | None) -> dict[str, Any]:
    return {"id": model_id, "object": "model", "created": created, "owned_by": "vllm", "root": root,
            "parent": parent, "max_model_len": max_model_len, "permission": [_permission()]}


def _permission() -> dict[str, Any]:
    return {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": int(time.time()),
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False}
