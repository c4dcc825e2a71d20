"""POST /v1/completions: string, token-id and batched prompts, n choices each, streamed or whole.

Every (prompt, sample) pair is its own worker request; choice index = prompt_index * n + sample. A request
creates at most MAX_CHOICES of them, refused before anything is encoded or queued.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api_error import check
from gateway.generation_request import MAX_CHOICES
from gateway.request_types import CompletionRequest, check_best_of
from gateway.request_validation import resolve_max_tokens
from gateway.responses import collect_choices, json_response, prompt_logprobs_field, raise_if_failed, usage
from gateway.serving import ServingContext
from gateway.sse import cancel_on_disconnect, merge, sse_response
from gateway.structured import checked_start, structured_output, uses_token_constraints
from gateway.tokenizer import Delta, IncrementalDetokenizer, Tokenizer
from worker.ipc.messages import SamplingParams, TokenLogprob


@dataclass
class Job:
    """One choice: its prompt and the worker request that samples it."""
    index: int
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams


async def create_completion(request: Request) -> Response:
    server: ServingContext = request.app.state.server
    body, lora_name, jobs = await completion_jobs(server, request)
    response_id, model = f"cmpl-{uuid.uuid4().hex}", body.model or server.served_models.base_name
    deltas = merge([_choice_stream(server, body, job, lora_name, response_id) for job in jobs])
    header = {"id": response_id, "object": "text_completion", "created": int(time.time()), "model": model}
    if body.stream:
        if uses_token_constraints(body):
            deltas = await checked_start(deltas)
        return sse_response(_chunks(server.tokenizer, body, jobs, deltas, header))
    choices = await cancel_on_disconnect(request, collect_choices(deltas, len(jobs)))
    if choices is None:
        return Response(status_code=499)
    return json_response(_response(server.tokenizer, body, jobs, choices, header))


async def completion_jobs(server: ServingContext, request: Request) -> tuple[CompletionRequest, str | None, list[Job]]:
    """The request's body checked as vLLM checks it, its model resolved (the adapter's name, None for the base)
    and its choices' jobs (prompt * n + sample); the /v1/completions/render route answers with them too."""
    body = await server.read_json(request, CompletionRequest)
    lora_name = await server.resolve(request, body.model)
    body.validate_sampling(server.config.max_logprobs, body.logprobs)
    check_best_of(body.best_of, body.n)
    return body, lora_name, await _jobs(server, body)


async def _jobs(server: ServingContext, body: CompletionRequest) -> list[Job]:
    prompts = body.prompt_inputs()
    check(len(prompts) * body.n <= MAX_CHOICES,
          f"This request asks for {len(prompts) * body.n} choices ({len(prompts)} prompts x n={body.n}), more than "
          f"the {MAX_CHOICES} one request may create. Please send fewer prompts or a smaller n per request.",
          "prompt")
    jobs = []
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and body.echo:
        prompt_logprobs = body.logprobs
    structured = structured_output(body)
    bad_words = server.tokenizer.bad_words_token_ids(body.bad_words)
    for prompt in prompts:
        ids = await server.encode_prompt(prompt, body.add_special_tokens)
        max_tokens = resolve_max_tokens(body.max_tokens, len(ids), server.max_model_len)
        text = prompt if isinstance(prompt, str) else await server.decode(ids, skip_special_tokens=False)
        for sample in range(body.n):
            params = body.sampling_params(max_tokens, body.logprobs, prompt_logprobs, sample, bad_words, structured)
            jobs.append(Job(len(jobs), ids, text, params))
    return jobs


def _choice_stream(server: ServingContext, body: CompletionRequest, job: Job, lora_name: str | None,
                   response_id: str) -> AsyncIterator[Delta]:
    detokenizer = IncrementalDetokenizer(server.tokenizer, job.prompt_ids, stop=body.stop_strings,
                                         skip_special_tokens=body.skip_special_tokens,
                                         include_stop_str_in_output=body.include_stop_str_in_output)
    return server.generate(f"{response_id}-{job.index}", job.prompt_ids, job.params, lora_name, detokenizer)


def _response(tokenizer: Tokenizer, body: CompletionRequest, jobs: list[Job], choices: list[Delta],
              header: dict[str, Any]) -> dict[str, Any]:
    raise_if_failed(*choices)
    out = []
    for job, choice in zip(jobs, choices):
        text, logprobs = choice.text, None
        if body.echo:
            text = job.prompt_text + text
        if body.logprobs is not None:
            logprobs = completion_logprobs(tokenizer, *_scored_tokens(body, job, choice), body.logprobs, 0,
                                           bool(body.return_tokens_as_token_ids))
        out.append({"index": job.index, "text": text, "logprobs": logprobs,
                    "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason,
                    "token_ids": choice.token_ids if body.return_token_ids else None,
                    "prompt_logprobs": prompt_logprobs_field(tokenizer, choice) if body.prompt_logprobs is not None
                    else None,
                    "prompt_token_ids": job.prompt_ids if body.return_token_ids else None})
    completion_tokens = sum(len(c.token_ids) for c in choices)
    # vLLM reports the cached prompt tokens of the last prompt
    return {**header, "choices": out, "usage": usage(_prompt_tokens(body, jobs), completion_tokens,
                                                     choices[-1].num_cached_tokens)}


async def _chunks(tokenizer: Tokenizer, body: CompletionRequest, jobs: list[Job],
                  deltas: AsyncIterator[tuple[int, Delta]], header: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    generated = [0] * len(jobs)
    text_offsets = [0] * len(jobs)
    started = [False] * len(jobs)
    cached = None           # the first cached-token count to arrive reaches the final usage, as in vLLM
    async for index, delta in deltas:
        job, first = jobs[index], not started[index]
        started[index] = True
        generated[index] += len(delta.token_ids)
        cached = delta.num_cached_tokens if cached is None else cached
        raise_if_failed(delta)
        text, logprobs = delta.text, None
        if first and body.echo:
            text = job.prompt_text + text
        if body.logprobs is not None:
            scored = _scored_tokens(body, job, delta) if first else (delta.token_ids, delta.logprobs or [])
            logprobs = completion_logprobs(tokenizer, *scored, body.logprobs, text_offsets[index],
                                           bool(body.return_tokens_as_token_ids))
        text_offsets[index] += len(text)
        if not (text or logprobs or delta.finish_reason or body.return_token_ids):
            continue
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": delta.finish_reason,
                  "stop_reason": delta.stop_reason}
        if body.return_token_ids:
            choice["token_ids"] = delta.token_ids
            choice["prompt_token_ids"] = job.prompt_ids if first else None
        chunk = {**header, "choices": [choice], "usage": None}
        if body.continuous_usage:
            chunk["usage"] = usage(len(job.prompt_ids), generated[index])
        yield chunk
    if body.include_usage:
        yield {**header, "choices": [], "usage": usage(_prompt_tokens(body, jobs), sum(generated), cached)}


def _scored_tokens(body: CompletionRequest, job: Job, delta: Delta) -> tuple[list[int], list[TokenLogprob | None]]:
    """Token ids and their logprobs for the logprobs field: the prompt's first when echoing."""
    ids, entries = delta.token_ids, list(delta.logprobs or [])
    if body.echo:
        prompt_entries = delta.prompt_logprobs or [None] * len(job.prompt_ids)
        ids, entries = job.prompt_ids + ids, list(prompt_entries) + entries
    return ids, entries


def completion_logprobs(tokenizer: Tokenizer, token_ids: list[int], entries: list[TokenLogprob | None],
                        num_top: int, text_offset: int, as_token_ids: bool) -> dict[str, Any]:
    """The completions API's logprobs: tokens, token_logprobs, top_logprobs, text_offset."""
    name = (lambda t: f"token_id:{t}") if as_token_ids else tokenizer.token_text
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        token = name(token_id)
        offsets.append(text_offset)
        text_offset += len(token)
        tokens.append(token)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(max(entry.logprob, -9999.0))
        top: dict[str, float] = {}
        for top_id, logprob in [(entry.token_id, entry.logprob), *entry.top]:
            if len(top) > num_top:
                break
            top.setdefault(name(top_id), max(logprob, -9999.0))
        top_logprobs.append(top)
    return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top_logprobs}


def _prompt_tokens(body: CompletionRequest, jobs: list[Job]) -> int:
    """Each prompt counts once however many choices sample it, as in vLLM."""
    return sum(len(job.prompt_ids) for job in jobs) // body.n


routes = [Route("/v1/completions", create_completion, methods=["POST"])]
