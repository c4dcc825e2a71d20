"""The OpenAI/vLLM request bodies, decoded by msgspec (request_validation.decode_body): completions and chat
(GenerationRequest's fields and theirs), tokenize, detokenize, and the LoRA load and unload routes. Field names and
defaults are vLLM's; unknown fields are ignored as vLLM ignores them.
"""
from __future__ import annotations

from typing import Any, Literal

import msgspec

from gateway.api_error import APIError, check
from gateway.generation_request import GenerationRequest
from gateway.json_text import parse_json_field


class CompletionRequest(GenerationRequest, kw_only=True):
    prompt: str | list | None = None       # str | list[str] | list[int] | list[list[int]]: see prompt_inputs
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    add_special_tokens: bool = True
    best_of: int | None = None          # check_best_of

    def prompt_inputs(self) -> list[str | list[int]]:
        """The prompts of this request, each a string or a list of token ids."""
        prompt = self.prompt
        check(bool(prompt), "Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
        if isinstance(prompt, str):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_int(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
        raise APIError("prompt must be a string, a list of strings, a list of token ids, "
                       "or a list of lists of token ids.", param="prompt")


def check_best_of(best_of: int | None, n: int) -> None:
    """vLLM's answers to `best_of` (completions and chat): its V1 engine samples no extra choices to keep the best
    of, so anything above 1 is refused, after the checks its SamplingParams makes first."""
    if best_of is None:
        return
    check(best_of >= 1, f"best_of must be at least 1, got {best_of}", "best_of")
    check(best_of >= n, f"best_of must be greater than or equal to n, got n={n} and best_of={best_of}.", "best_of")
    check(best_of == 1, "vLLM V1 does not yet support best_of.", "best_of")


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None     # an assistant's earlier calls
    tool_call_id: str | None = None                    # a tool's answer: the call it answers

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template reads it: text content; an assistant's tool calls with their arguments
        as objects (vLLM parses them so), a tool answer's call id."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            out["tool_calls"] = [_template_tool_call(call) for call in self.tool_calls]
        return out

    def text(self) -> str:
        """The content as one string: text parts joined by newlines, as vLLM's "string" format."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        texts = []
        for part in self.content:
            kind = part.get("type")
            check(kind == "text" and isinstance(part.get("text"), str),
                  f"Unsupported content part type: {kind!r}; only 'text' parts are supported.", "messages")
            texts.append(part["text"])
        return "\n".join(texts)


class FunctionDefinition(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(msgspec.Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionRequest(GenerationRequest, kw_only=True):
    messages: list[ChatMessage]
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None    # gateway/tool_calls.py checks it
    parallel_tool_calls: bool | None = True
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    best_of: int | None = None          # check_best_of

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as JSON objects, as the chat template and the tool-call parser read them."""
        return None if self.tools is None else msgspec.to_builtins(self.tools)

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def max_output_tokens(self) -> tuple[int | None, str]:
        """The requested output budget and the field it came from."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's completion form (prompt) or chat form (messages) of /tokenize."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None     # None: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False
    pinned: bool = False


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str = ""


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    check(isinstance(call.get("function"), dict), "Each tool call needs a `function` object.", "messages")
    function = dict(call["function"])
    arguments = function.get("arguments")
    if not arguments:
        function["arguments"] = {}
    elif isinstance(arguments, str):
        function["arguments"] = parse_json_field(arguments, "Invalid JSON in the arguments of a tool call", "messages")
    return {**call, "function": function}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
