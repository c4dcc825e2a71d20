"""POST /v1/chat/completions: the chat template renders the messages into one prompt, sampled n times.

Streams as vLLM does: a first chunk per choice with only the role, then content deltas, the finish
reason on the last delta, and with include_usage a final chunk of usage and no choices. With tools, the
output is read as tool calls (gateway/tool_calls.py): `message.tool_calls`, streamed as `delta.tool_calls`.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.request_types import ChatCompletionRequest, check_best_of
from gateway.request_validation import resolve_max_tokens
from gateway.responses import collect_choices, json_response, prompt_logprobs_field, raise_if_failed, render_chat, usage
from gateway.serving import ServingContext
from gateway.sse import cancel_on_disconnect, merge, sse_response
from gateway.structured import checked_start, structured_output, uses_token_constraints
from gateway.tokenizer import Delta, IncrementalDetokenizer, Tokenizer
from gateway.tool_calls import PARSERS, ToolCallStream, ToolChoice
from worker.ipc.messages import SamplingParams, StructuredOutput, TokenLogprob


@dataclass
class ChatPrompt:
    """What a checked chat request runs with (the /v1/chat/completions/render route answers with it too)."""
    body: ChatCompletionRequest
    lora_name: str | None
    tools: ToolChoice
    template_kwargs: dict[str, Any]
    prompt_ids: list[int]
    max_tokens: int
    structured: StructuredOutput | None
    bad_words: list[list[int]]

    def sampling_params(self, index: int) -> SamplingParams:
        body = self.body
        return body.sampling_params(self.max_tokens, body.num_logprobs, body.prompt_logprobs, index, self.bad_words,
                                    self.structured)


async def chat_prompt(server: ServingContext, request: Request) -> ChatPrompt:
    """The request's body checked as vLLM checks it, its model resolved and its messages rendered to tokens."""
    body = await server.read_json(request, ChatCompletionRequest)
    lora_name = await server.resolve(request, body.model)
    body.validate_sampling(server.config.max_logprobs, body.num_logprobs)
    check_best_of(body.best_of, body.n)
    tools = ToolChoice.from_request(body.tool_dicts, body.tool_choice, body.parallel_tool_calls,
                                    server.config.enable_auto_tool_choice and server.config.tool_call_parser in PARSERS)
    template_kwargs = {**({"tools": body.tool_dicts} if body.tools else {}), **(body.chat_template_kwargs or {})}
    prompt_ids = await render_chat(server, body.messages, body.add_generation_prompt, body.add_special_tokens,
                                   template_kwargs)
    requested, param = body.max_output_tokens
    max_tokens = resolve_max_tokens(requested, len(prompt_ids), server.max_model_len, param)
    structured = tools.constraint() or structured_output(body)   # a tool's schema wins, as in vLLM
    return ChatPrompt(body, lora_name, tools, template_kwargs, prompt_ids, max_tokens, structured,
                      server.tokenizer.bad_words_token_ids(body.bad_words))


async def create_chat_completion(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    chat = await chat_prompt(server, request)
    body, tools, prompt_ids = chat.body, chat.tools, chat.prompt_ids
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = []
    for index in range(body.n):
        params = chat.sampling_params(index)
        detokenizer = IncrementalDetokenizer(server.tokenizer, prompt_ids, stop=body.stop_strings,
                                             skip_special_tokens=body.skip_special_tokens and tools.mode != "auto",
                                             include_stop_str_in_output=body.include_stop_str_in_output)
        streams.append(server.generate(f"{response_id}-{index}", prompt_ids, params, chat.lora_name, detokenizer))
    deltas = merge(streams)
    header = {"id": response_id, "object": "chat.completion", "created": int(time.time()),
              "model": body.model or server.served_models.base_name}
    role = "assistant" if body.add_generation_prompt else body.messages[-1].role
    if body.stream:
        header["object"] = "chat.completion.chunk"
        if chat.structured is not None or uses_token_constraints(body):
            deltas = await checked_start(deltas)
        return sse_response(_chunks(server.tokenizer, body, tools, prompt_ids, role, deltas, header))
    choices = await cancel_on_disconnect(request, collect_choices(deltas, body.n))
    if choices is None:
        return Response(status_code=499)
    return json_response(_response(server.tokenizer, body, tools, prompt_ids, role, choices, header))


def _message(tools: ToolChoice, role: str, choice: Delta) -> tuple[dict[str, Any], str | None]:
    """A whole choice's message, and its finish reason ("tool_calls" when "auto" found calls, as vLLM says)."""
    if not tools.parses_output:
        return {"role": role, "content": choice.text}, choice.finish_reason
    content, calls = tools.parse(choice.text)
    finish = "tool_calls" if tools.mode == "auto" and calls else choice.finish_reason
    return {"role": role, "content": content, "tool_calls": [c.as_dict() for c in calls]}, finish


def _response(tokenizer: Tokenizer, body: ChatCompletionRequest, tools: ToolChoice, prompt_ids: list[int], role: str,
              choices: list[Delta], header: dict[str, Any]) -> dict[str, Any]:
    raise_if_failed(*choices)
    messages = [_message(tools, role, choice) for choice in choices]
    out = [{"index": index, "message": messages[index][0],
            "logprobs": _logprobs(tokenizer, body, choice),
            "finish_reason": messages[index][1], "stop_reason": choice.stop_reason,
            "token_ids": choice.token_ids if body.return_token_ids else None}
           for index, choice in enumerate(choices)]
    completion_tokens = sum(len(c.token_ids) for c in choices)
    prompt_logprobs = prompt_logprobs_field(tokenizer, choices[0]) if body.prompt_logprobs is not None else None
    return {**header, "choices": out, "usage": usage(len(prompt_ids), completion_tokens, choices[0].num_cached_tokens),
            "prompt_logprobs": prompt_logprobs, "prompt_token_ids": prompt_ids if body.return_token_ids else None}


async def _chunks(tokenizer: Tokenizer, body: ChatCompletionRequest, tools: ToolChoice, prompt_ids: list[int],
                  role: str, deltas: AsyncIterator[tuple[int, Delta]],
                  header: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    for index in range(body.n):
        chunk = {**header, "choices": [{"index": index, "delta": {"role": role, "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
        if body.return_token_ids and index == 0:
            chunk["prompt_token_ids"] = prompt_ids
        if body.continuous_usage:
            chunk["usage"] = usage(len(prompt_ids), 0)
        yield chunk
    generated = [0] * body.n
    cached = None           # the first choice's cached prompt tokens reach the final usage, as in vLLM
    calls = [tools.stream() for _ in range(body.n)]
    async for index, delta in deltas:
        generated[index] += len(delta.token_ids)
        cached = delta.num_cached_tokens if cached is None else cached
        raise_if_failed(delta)
        logprobs = _logprobs(tokenizer, body, delta)
        messages, finish_reason = _delta_message(calls[index], delta)
        for message in messages[:-1]:   # a call's start and its arguments in one delta: the start goes first
            chunk = {**header, "choices": [{"index": index, "delta": message, "logprobs": None,
                                            "finish_reason": None}]}
            if body.continuous_usage:
                chunk["usage"] = usage(len(prompt_ids), generated[index])
            yield chunk
        message = messages[-1] if messages else {}
        if not (message or (logprobs and logprobs["content"]) or delta.finish_reason or body.return_token_ids):
            continue
        choice = {"index": index, "delta": message or {"content": ""}, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        if delta.finish_reason is not None:
            choice["stop_reason"] = delta.stop_reason
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
        chunk = {**header, "choices": [choice]}
        if body.continuous_usage:
            chunk["usage"] = usage(len(prompt_ids), generated[index])
        yield chunk
    if body.include_usage:
        yield {**header, "choices": [], "usage": usage(len(prompt_ids), sum(generated), cached)}


def _delta_message(calls: ToolCallStream, delta: Delta) -> tuple[list[dict[str, Any]], str | None]:
    """A streamed delta's messages (none when it has nothing to say; more than one when a call starts and its
    arguments follow, as a call's first delta carries only its name, and no message names an index twice) and its
    finish reason, tool calls read out."""
    if not calls.choice.parses_output:
        return ([{"content": delta.text}] if delta.text else []), delta.finish_reason
    content, tool_calls = calls.feed(delta.text)
    finish = delta.finish_reason
    if finish is not None:
        more_content, more_calls = calls.finish()
        content, tool_calls = content + more_content, tool_calls + more_calls
        finish = "tool_calls" if calls.choice.mode == "auto" and calls.num_calls else finish
    messages = [{"content": content}] if content else []
    for call in tool_calls:
        if not messages or any(c["index"] == call["index"] for c in messages[-1].get("tool_calls", ())):
            messages.append({})
        messages[-1].setdefault("tool_calls", []).append(call)
    return messages, finish


def _logprobs(tokenizer: Tokenizer, body: ChatCompletionRequest, choice: Delta) -> dict[str, Any] | None:
    if not body.logprobs:
        return None
    return chat_logprobs(tokenizer, choice.token_ids, choice.logprobs or [], body.top_logprobs or 0,
                         bool(body.return_tokens_as_token_ids))


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], entries: list[TokenLogprob], num_top: int,
                  as_token_ids: bool) -> dict[str, Any]:
    """The chat API's logprobs: content[{token, logprob, bytes, top_logprobs[{token, logprob, bytes}]}]."""
    name = (lambda t: f"token_id:{t}") if as_token_ids else tokenizer.token_text

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        token = name(token_id)
        return {"token": token, "logprob": max(logprob, -9999.0),
                "bytes": list(token.encode("utf-8", errors="replace"))}

    return {"content": [{**item(token_id, entry.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in entry.top[:num_top]]}
                        for token_id, entry in zip(token_ids, entries)]}


routes = [Route("/v1/chat/completions", create_chat_completion, methods=["POST"])]
