"""GET /v1/models and /v1/models/{model}: vLLM's model cards for the base names and the adapters."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.responses import json_response
from gateway.serving import ServingContext


async def list_models(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    return json_response({"object": "list", "data": server.served_models.cards(server.max_model_len)})


async def retrieve_model(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    return json_response(server.served_models.card(request.path_params["model"], server.max_model_len))


routes = [Route("/v1/models", list_models, methods=["GET"]),
          Route("/v1/models/{model:path}", retrieve_model, methods=["GET"])]
