"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, with vLLM's bodies, messages and codes.

Served only with runtime loading on (--allow-runtime-lora-updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING),
as in vLLM. The gateway checks names (served_models.adapter_name_problem) and paths: with --lora-dir, the
directory and its files must lie inside one, symlinks followed (LoRAConfig.may_read, the rule automatic
loading follows too); the worker reads and validates the PEFT directory and answers with the status code to
return. Success bodies are plain text, as in vLLM. An unloaded adapter's series leave /metrics.
"""
from __future__ import annotations

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
    if not server.config.worker.lora.may_read(path):
        raise APIError(f"The lora adapter path '{path}' is outside the directories allowed by --lora-dir.",
                       type=INVALID_INPUT, param="lora_path")
    await server.served_models.load(name, path, load_inplace=body.load_inplace, pinned=body.pinned)
    return Response(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    name = (await server.read_json(request, UnloadLoRAAdapterRequest)).lora_name
    if not name:
        raise APIError("'lora_name' needs to be provided to unload a LoRA adapter.", type=INVALID_INPUT)
    await server.served_models.unload(name)
    return Response(f"Success: LoRA adapter '{name}' removed successfully.")


routes = [Route("/v1/load_lora_adapter", load_lora_adapter, methods=["POST"]),
          Route("/v1/unload_lora_adapter", unload_lora_adapter, methods=["POST"])]
