"""What routes share: JSON bodies, usage, whole choices, worker errors, prompt logprobs, chat prompts."""
from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.responses import Response

from gateway.api_error import APIError
from gateway.json_text import encode
from gateway.serving import ServingContext
from gateway.tokenizer import Delta, Tokenizer


def json_response(content: Any, status_code: int = 200) -> Response:
    return Response(encode(content), status_code, media_type="application/json")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; prompt_tokens_details only when some prompt tokens were cached, as vLLM reports it
    (with --enable-prompt-tokens-details: ServingContext.generate drops the count otherwise)."""
    details = {"cached_tokens": cached_tokens} if cached_tokens else None
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": details}


async def collect_choices(deltas: AsyncIterator[tuple[int, Delta]], num_choices: int) -> list[Delta]:
    """Whole choices from their deltas (a non-streamed response)."""
    choices = [Delta("", []) for _ in range(num_choices)]
    async for index, delta in deltas:
        choices[index].extend(delta)
    return choices


def raise_if_failed(*choices: Delta) -> None:
    """The worker's message and status (500 when it gave none) when any of `choices` (whole, or a streamed
    delta) ended in an error."""
    failed = next((c for c in choices if c.finish_reason == "error"), None)
    if failed is not None:
        raise APIError(failed.error or "The request failed in the worker.", failed.status_code or 500)


def prompt_logprobs_field(tokenizer: Tokenizer, choice: Delta) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's prompt_logprobs: per prompt position {token_id: {logprob, rank, decoded_token}}."""
    if choice.prompt_logprobs is None:
        return None
    return [None if entry is None else {
        str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": tokenizer.token_text(token_id)}
        for token_id, logprob, rank in [(entry.token_id, entry.logprob, entry.rank),
                                        *((t, lp, r) for r, (t, lp) in enumerate(entry.top, start=1))]}
        for entry in choice.prompt_logprobs]


async def render_chat(server: ServingContext, messages: list, add_generation_prompt: bool,
                      add_special_tokens: bool, template_kwargs: dict[str, Any] | None) -> list[int]:
    """Prompt token ids of a conversation, through the tokenizer's chat template (on a thread when long); a 400
    when they do not fit the context."""
    text = await chat_text(server, messages, add_generation_prompt, template_kwargs)
    return await server.encode_prompt(text, add_special_tokens)


async def chat_text(server: ServingContext, messages: list, add_generation_prompt: bool,
                    template_kwargs: dict[str, Any] | None) -> str:
    """A conversation through the tokenizer's chat template (on a thread when long)."""
    conversation = [m.template_dict() for m in messages]
    kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in ("messages", "add_generation_prompt")}
    size = sum(len(m["content"]) for m in conversation)
    return await server.off_loop(size, lambda: server.tokenizer.apply_chat_template(
        conversation, add_generation_prompt, **kwargs))
