"""GET /v1/adapters and /v1/adapters/{name}: where each served adapter stands in the worker.

The list carries `adapters_loading`: how many adapters the worker is still reading from disk into host memory, as
its latest stats say (the /health header's count). Such an adapter's card shows residency "disk" and loading true.

Residency is the fastest tier holding its weights ("gpu", "host", "disk"), with rank, target modules,
pinned, version, last use and load times, as the worker reports them; the gateway adds the base model
and creation time. The gateway serves a name only while the worker holds it (served_models.py); while a
load is under way the worker may list a name the gateway does not serve yet, which is listed with what the
worker reports.

`target_modules` names what the adapter adapts, in this order: q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj, down_proj (on a MoE base, the MLP of its dense layers), shared_expert.gate_proj / .up_proj / .down_proj
(Qwen2-MoE's shared expert), experts.gate_proj / experts.up_proj / experts.down_proj (the routed experts,
whichever format the adapter stores them in: PEFT target_parameters on mlp.experts.gate_up_proj lists both
experts.gate_proj and experts.up_proj; Mixtral's w1 / w3 / w2 are listed as gate / up / down). `rank` is the
largest rank over all of them, experts included.
"""
from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api_error import APIError
from gateway.responses import json_response
from gateway.served_models import Adapter
from gateway.serving import ServingContext
from worker.ipc.messages import AdapterState


async def list_adapters(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    cards = await _cards(server)
    return json_response({"object": "list", "data": cards,
                          "adapters_loading": server.client.stats.num_adapters_loading})


async def retrieve_adapter(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    name = request.path_params["name"]
    for card in await _cards(server):
        if card["id"] == name:
            return json_response(card)
    raise APIError(f"The lora adapter '{name}' cannot be found.", 404)


async def _cards(server: ServingContext) -> list[dict[str, Any]]:
    result = await server.client.adapter_command("list", "")
    if not result.ok:
        raise APIError(result.message, result.status_code)
    states = {state.name: state for state in result.adapters}
    return [_card(name, server.served_models.get(name), states.get(name))
            for name in dict.fromkeys([*server.served_models.names(), *states])]


def _card(name: str, adapter: Adapter | None, state: AdapterState | None) -> dict[str, Any]:
    card: dict[str, Any] = {
        "id": name, "object": "lora_adapter",
        "path": state.path if state else adapter.path,
        "base_model": adapter.base_model_name if adapter else None,
        "created": adapter.created if adapter else None,
        "pinned": state.pinned if state else adapter.pinned,
        "residency": state.residency if state else "disk", "loading": state.loading if state else False,
        "slot": None, "rank": None, "target_modules": None, "version": None, "last_used": None,
        "load_time_ms": {"disk": None, "gpu": None}, "num_running": 0, "num_waiting": 0}
    if state is not None:
        card.update(slot=state.slot, rank=state.rank, target_modules=state.target_modules, version=state.version,
                    last_used=state.last_used, load_time_ms={"disk": state.disk_load_ms, "gpu": state.gpu_load_ms},
                    num_running=state.num_running, num_waiting=state.num_waiting)
    return card


routes = [Route("/v1/adapters", list_adapters, methods=["GET"]),
          Route("/v1/adapters/{name:path}", retrieve_adapter, methods=["GET"])]
