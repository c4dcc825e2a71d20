"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, with vLLM's bodies, messages and codes.

Served only with runtime loading on (--allow-runtime-lora-updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING),
as in vLLM. The gateway checks names (served_models.adapter_name_problem) and paths; the worker reads
and validates the PEFT directory and answers with the status code to return. Success bodies are plain
text, as in vLLM. An unloaded adapter's series leave /metrics.
"""
from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api_error import APIError
from gateway.request_types import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from gateway.served_models import check_adapter_name
from gateway.serving import ServingContext

INVALID_INPUT = "InvalidUserInput"


async def load_lora_adapter(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    body = await server.read_json(request, LoadLoRAAdapterRequest)
    name, path = body.lora_name, body.lora_path
    if not name or not path:
        raise APIError("Both 'lora_name' and 'lora_path' must be provided.", type=INVALID_INPUT)
    check_adapter_name(name)
    if "\0" in path:
        raise APIError("The lora adapter path must not contain a NUL character.", type=INVALID_INPUT,
                       param="lora_path")
    if name in server.served_models.served_names:
        raise APIError(f"The lora adapter name '{name}' is already a served model name.", type=INVALID_INPUT)
    if not _allowed(path, server.config.worker.lora.lora_dirs):
        raise APIError(f"The lora adapter path '{path}' is outside the directories allowed by --lora-dir.",
                       type=INVALID_INPUT, param="lora_path")
    async with server.served_models.lock(name):
        if not body.load_inplace and name in server.served_models:
            raise APIError(f"The lora adapter '{name}' has already been loaded. If you want to load the "
                           "adapter in place, set 'load_inplace' to True.", type=INVALID_INPUT)
        result = await server.client.adapter_command("load", name, path, load_inplace=body.load_inplace,
                                                     pinned=body.pinned)
        if not result.ok:
            raise APIError(result.message, result.status_code)
        server.served_models.add(name, path, pinned=body.pinned)
    return Response(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    name = (await server.read_json(request, UnloadLoRAAdapterRequest)).lora_name
    if not name:
        raise APIError("'lora_name' needs to be provided to unload a LoRA adapter.", type=INVALID_INPUT)
    async with server.served_models.lock(name):
        if name not in server.served_models:
            raise APIError(f"The lora adapter '{name}' cannot be found.", 404)
        result = await server.client.adapter_command("unload", name)
        if not result.ok:
            raise APIError(result.message, result.status_code)
        server.served_models.remove(name)
        server.metrics.forget_adapter(name)
    return Response(f"Success: LoRA adapter '{name}' removed successfully.")


def _allowed(path: str, lora_dirs: tuple[str, ...]) -> bool:
    """Without --lora-dir any path may be loaded; with it, only paths inside one of them."""
    resolved = Path(path).resolve()
    return not lora_dirs or any(resolved.is_relative_to(Path(d).resolve()) for d in lora_dirs)


routes = [Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
          Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])]
