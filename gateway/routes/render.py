"""POST /v1/completions/render and /v1/chat/completions/render: the token ids a request would run with, as vLLM's
render endpoints answer (`vllm/entrypoints/scale_out/render/`, vLLM 0.33.0), without running it.

A prefix-aware router tokenizes each request here (llm-d's `token-producer` plugin with its `vllm` backend POSTs
the request body, `model` set to the base model, and reads `token_ids`; llm-d-router ebab6879,
`pkg/epp/framework/plugins/requestcontrol/dataproducer/tokenizer/vllm_http.go`) and matches them against the
`token_ids` of this server's KV-cache events. Both come from the same place: the body goes through the checks,
the chat template and the tokenizer of /v1/completions and /v1/chat/completions, so the ids are exactly the prompt
the engine caches. Errors are those routes' errors, in vLLM's envelope.

The answer is vLLM's GenerateRequest: completions get a list, one per prompt; chat gets one object.

    {"request_id": "cmpl-...", "token_ids": [...], "token_offsets": null, "features": null, "content_parts": null,
     "sampling_params": {...}, "model": ..., ..., "stream": false, "cache_salt": null, "priority": 0, ...}

`sampling_params` holds this server's resolved parameters under vLLM's names; `features` (multimodal hashes) is
always null, as only text prompts are served.
"""
from __future__ import annotations

import uuid
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.generation_request import GenerationRequest
from gateway.responses import json_response
from gateway.routes.chat import chat_prompt
from gateway.routes.completions import completion_jobs
from gateway.serving import ServingContext
from worker.ipc.messages import SamplingParams


async def render_completion(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    body, _, jobs = await completion_jobs(server, request)
    base_id = f"cmpl-{uuid.uuid4().hex}"
    firsts = jobs[::body.n]               # one job per prompt: its first choice
    return json_response([_generate_request(base_id if len(firsts) == 1 else f"{base_id}-{i}", job.prompt_ids,
                                            job.params, body) for i, job in enumerate(firsts)])


async def render_chat_completion(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    chat = await chat_prompt(server, request)
    body = chat.body
    parse_context = {"tools": body.tool_dicts, "tool_choice": body.tool_choice or "none",
                     "parallel_tool_calls": body.parallel_tool_calls, "include_reasoning": True,
                     "chat_template_kwargs": body.chat_template_kwargs or {},
                     "history_tool_call_cnt": sum(len(m.tool_calls or ()) for m in body.messages)}
    return json_response(_generate_request(f"chatcmpl-{uuid.uuid4().hex}", chat.prompt_ids, chat.sampling_params(0),
                                           body, parse_context))


def _generate_request(request_id: str, token_ids: list[int], params: SamplingParams, body: GenerationRequest,
                      parse_context: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's GenerateRequest fields, in its order."""
    return {"request_id": request_id, "token_ids": token_ids, "token_offsets": None, "features": None,
            "content_parts": None, "sampling_params": msgspec.to_builtins(params), "model": body.model,
            "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": body.return_token_ids,
            "output_mode": "tokens", "parse_context": parse_context, "stream": bool(body.stream),
            "stream_options": msgspec.to_builtins(body.stream_options) if body.stream and body.stream_options
            else None, "cache_salt": None, "priority": 0, "kv_transfer_params": None, "ec_transfer_params": None}


routes = [Route("/v1/completions/render", render_completion, methods=["POST"]),
          Route("/v1/chat/completions/render", render_chat_completion, methods=["POST"])]
