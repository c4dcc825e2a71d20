"""POST /tokenize and /detokenize, with vLLM's bodies and answers."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.protocol import APIError, DetokenizeRequest, TokenizeRequest, check_token_ids, decode_body
from gateway.responses import json_response, render_chat
from gateway.serving import ServingContext


async def tokenize(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    body = decode_body(await request.body(), TokenizeRequest)
    server.served_models.resolve(body.model)
    if body.messages is not None:
        add_special = bool(body.add_special_tokens)
        ids = render_chat(server, body.messages, body.add_generation_prompt, add_special, body.chat_template_kwargs)
    elif body.prompt is not None:
        add_special = body.add_special_tokens is None or body.add_special_tokens
        ids = server.tokenizer.encode(body.prompt, add_special)
    else:
        raise APIError("Either `prompt` or `messages` must be provided.", param="prompt")
    token_strs = [server.tokenizer.backend.id_to_token(t) for t in ids] if body.return_token_strs else None
    return json_response({"count": len(ids), "max_model_len": server.max_model_len, "tokens": ids,
                          "token_strs": token_strs})


async def detokenize(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    body = decode_body(await request.body(), DetokenizeRequest)
    server.served_models.resolve(body.model)
    if body.tokens:
        check_token_ids(body.tokens, server.vocab_size)
    return json_response({"prompt": server.tokenizer.decode(body.tokens, skip_special_tokens=False)})


routes = [Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])]
