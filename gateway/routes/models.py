"""GET /v1/models and /v1/models/{model}: vLLM's model cards for the base names and the adapters."""
from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.sse import json_response

if TYPE_CHECKING:
    from gateway.app import ServingContext


async def list_models(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    return json_response({"object": "list", "data": server.models.cards(server.max_model_len)})


async def retrieve_model(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    return json_response(server.models.card(request.path_params["model"], server.max_model_len))


routes = [Route("/v1/models", list_models, methods=["GET"]),
          Route("/v1/models/{model:path}", retrieve_model, methods=["GET"])]
