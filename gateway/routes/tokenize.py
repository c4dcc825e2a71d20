"""POST /tokenize and /detokenize, with vLLM's bodies and answers.

Open without the API key, as in vLLM; such a request resolves `model` among the names already served
and never registers an adapter from a --lora-dir (ServingContext.may_load_adapters), so its 200 or
404 says nothing about the directories.
"""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api_error import APIError
from gateway.request_types import DetokenizeRequest, TokenizeRequest
from gateway.request_validation import check_token_ids
from gateway.responses import chat_text, json_response
from gateway.serving import ServingContext


async def tokenize(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    body = await server.read_json(request, TokenizeRequest)
    await server.resolve(request, body.model)
    if body.messages is not None:      # counted whatever its length, as vLLM's /tokenize counts it
        add_special = bool(body.add_special_tokens)
        text = await chat_text(server, body.messages, body.add_generation_prompt, body.chat_template_kwargs)
    elif body.prompt is not None:
        add_special = body.add_special_tokens is None or body.add_special_tokens
        text = body.prompt
    else:
        raise APIError("Either `prompt` or `messages` must be provided.", param="prompt")
    ids = await server.off_loop(len(text), lambda: server.tokenizer.encode(text, add_special))
    token_strs = None
    if body.return_token_strs:
        token_strs = await server.off_loop(len(ids), lambda: [server.tokenizer.backend.id_to_token(t) for t in ids])
    return json_response({"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids,
                          "token_strs": token_strs})


async def detokenize(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    body = await server.read_json(request, DetokenizeRequest)
    await server.resolve(request, body.model)
    def decode() -> str:
        if body.tokens:
            check_token_ids(body.tokens, server.vocab_size)
        return server.tokenizer.decode(body.tokens, skip_special_tokens=False)
    return json_response({"prompt": await server.off_loop(len(body.tokens), decode)})


routes = [Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])]
