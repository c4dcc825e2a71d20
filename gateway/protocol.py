"""OpenAI/vLLM request types, their validation, and vLLM's error envelope.

Requests decode with msgspec in two steps: JSON to a dict (so a malformed body or a non-object is a
400, and vLLM's pre-validation checks see the raw values), then the dict to a typed struct. Field
names and defaults are vLLM's; unknown fields are ignored as vLLM ignores them. Every failure is an
APIError, rendered as {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import math
from typing import Any, Literal, TypeVar

import msgspec

from worker.ipc.messages import SamplingParams, StructuredOutput

INT64_MIN, INT64_MAX = -(2 ** 63), 2 ** 63 - 1
MAX_N = 128   # choices per prompt; a guard against one request fanning out without bound
LOGIT_BIAS_LIMIT = 100.0   # vLLM clamps each bias to [-100, 100]

ERROR_TYPES = {400: "BadRequestError", 401: "UnauthorizedError", 404: "NotFoundError", 413: "BadRequestError",
               415: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}

# Accepted by vLLM, not implemented here: a request that sets one is refused rather than
# silently answered without it.
UNSUPPORTED_FIELDS = ("suffix", "prompt_embeds", "use_beam_search", "continue_final_message", "logits_processors",
                      "chat_template", "truncate_prompt_tokens")


class APIError(Exception):
    """An error answered to the client with vLLM's envelope."""

    def __init__(self, message: str, status: int = 400, type: str | None = None, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or ERROR_TYPES.get(status, "BadRequestError")
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.status}}


def model_not_found(name: str) -> APIError:
    return APIError(f"The model `{name}` does not exist.", 404, param="model")


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class _GenerationRequest(msgspec.Struct, kw_only=True):
    """Fields completions and chat share, with vLLM's defaults."""
    model: str | None = None
    n: int | None = 1
    seed: int | None = None
    stop: str | list[str] | None = []
    stop_token_ids: list[int] | None = []
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    user: str | None = None
    logit_bias: dict[str, Any] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    response_format: dict[str, Any] | None = None      # gateway/structured.py reads the constraint fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def __post_init__(self) -> None:
        if self.n is None:
            self.n = 1

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None, index: int,
                        bad_words_token_ids: list[list[int]] | None = None,
                        structured: StructuredOutput | None = None) -> SamplingParams:
        """The worker's parameters for choice `index` (each choice gets its own seed). `bad_words_token_ids`:
        Tokenizer.bad_words_token_ids of `bad_words`; `structured`: gateway.structured.structured_output."""
        _check(self.min_tokens <= max_tokens,
               f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {self.min_tokens}.", None)
        seed = None if self.seed is None or self.seed == -1 else self.seed + index
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_tokens, seed=seed,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None or self.top_k == -1 else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop_token_ids=list(dict.fromkeys(self.stop_token_ids or [])), ignore_eos=self.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids, bad_words_token_ids=bad_words_token_ids or [],
            structured=structured)

    def validate_sampling(self, max_logprobs: int, logprobs: int | None) -> None:
        """vLLM's SamplingParams checks, with its messages."""
        temperature = 1.0 if self.temperature is None else self.temperature
        _check(self.n >= 1, f"n must be at least 1, got {self.n}.", "n")
        _check(self.n <= MAX_N, f"n must be at most {MAX_N}, got {self.n}.", "n")
        _check(-2.0 <= (self.presence_penalty or 0.0) <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.", "presence_penalty")
        _check(-2.0 <= (self.frequency_penalty or 0.0) <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.", "frequency_penalty")
        if self.repetition_penalty is not None:
            _check(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0,
                   f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.",
                   "repetition_penalty")
        _check(math.isfinite(temperature), f"temperature must be a finite number, got {temperature}.",
               "temperature")
        _check(temperature >= 0.0, f"temperature must be non-negative, got {temperature}.", "temperature")
        _check(temperature <= 2.0, f"temperature must be in [0, 2], got {temperature}.", "temperature")
        if self.top_p is not None:
            _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        if self.top_k is not None:
            _check(self.top_k >= -1, f"top_k must be 0 (disable), or at least 1, got {self.top_k}.", "top_k")
            _check(self.top_k <= INT64_MAX, f"top_k must be a 64-bit integer, got {self.top_k}.", "top_k")
        _check(all(INT64_MIN <= t <= INT64_MAX for t in self.stop_token_ids or []),
               "stop_token_ids must be 64-bit integers.", "stop_token_ids")
        if self.min_p is not None:
            _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.", "min_p")
        _check(self.min_tokens >= 0, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.",
               "min_tokens")
        if self.seed is not None:
            _check(INT64_MIN <= self.seed <= INT64_MAX, f"seed must be a 64-bit integer, got {self.seed}.", "seed")
        _check(all(self.stop_strings), "stop cannot contain an empty string.", "stop")
        _check(all(INT64_MIN <= t <= INT64_MAX for t in self.allowed_token_ids or []),
               "allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids")
        _check(temperature > 0.0 or self.n == 1, f"n must be 1 when using greedy sampling, got {self.n}.", "n")
        _check_logprobs_limit("sample", logprobs, max_logprobs, "logprobs")
        _check_logprobs_limit("prompt", self.prompt_logprobs, max_logprobs, "prompt_logprobs")


class CompletionRequest(_GenerationRequest, kw_only=True):
    prompt: str | list | None = None       # str | list[str] | list[int] | list[list[int]]: see prompt_inputs
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = 16
    add_special_tokens: bool = True

    def prompt_inputs(self) -> list[str | list[int]]:
        """The prompts of this request, each a string or a list of token ids."""
        prompt = self.prompt
        _check(bool(prompt), "Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
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
            _check(kind == "text" and isinstance(part.get("text"), str),
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


class ChatCompletionRequest(_GenerationRequest, kw_only=True):
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


T = TypeVar("T")


def decode_body(raw: bytes, type_: type[T]) -> T:
    """Parse and validate a JSON request body; every failure is a 400 APIError."""
    try:
        data = msgspec.json.decode(raw)
    except (msgspec.MsgspecError, UnicodeDecodeError) as e:      # MsgspecError: 1e999 is a ValidationError
        raise APIError(f"JSON decode error: {e}") from None
    except RecursionError:
        raise APIError("JSON decode error: the body is nested too deeply.") from None
    if not isinstance(data, dict):
        raise APIError("The request body must be a JSON object.")
    for field in UNSUPPORTED_FIELDS:
        _check(data.get(field) in (None, False, "", [], {}),
               f"`{field}` is not supported by this server.", field)
    if issubclass(type_, _GenerationRequest):
        _check_raw_generation(data)
    try:
        return msgspec.convert(data, type_, strict=False)
    except msgspec.ValidationError as e:
        raise APIError(str(e), param=_param_of(e)) from None


def _check_raw_generation(data: dict[str, Any]) -> None:
    """vLLM's checks that run before field validation, on the raw values."""
    _check(not (data.get("stream_options") and not data.get("stream")),
           "Stream options can only be defined when `stream=True`.", "stream_options")
    prompt_logprobs = data.get("prompt_logprobs")
    if _is_number(prompt_logprobs):
        _check(not (data.get("stream") and (prompt_logprobs > 0 or prompt_logprobs == -1)),
               "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        _check(prompt_logprobs >= 0 or prompt_logprobs == -1,
               "`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
    logprobs = data.get("logprobs")
    if _is_number(logprobs):
        _check(logprobs >= 0, "`logprobs` must be a positive value.", "logprobs")
    top_logprobs = data.get("top_logprobs")
    if _is_number(top_logprobs):
        _check(top_logprobs >= 0 or top_logprobs == -1, "`top_logprobs` must be a positive value or -1.",
               "top_logprobs")
        _check(not ((top_logprobs == -1 or top_logprobs > 0) and not data.get("logprobs")),
               "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")


def resolve_max_tokens(requested: int | None, num_prompt_tokens: int, max_model_len: int,
                       param: str = "max_tokens") -> int:
    """The output budget of one prompt; vLLM's context-length errors when it does not fit."""
    _check(num_prompt_tokens < max_model_len,
           f"This model's maximum context length is {max_model_len} tokens. However, your request has "
           f"{num_prompt_tokens} input tokens. Please reduce the length of the input messages.", None)
    if requested is None:
        return max_model_len - num_prompt_tokens
    _check(requested >= 1, f"max_tokens must be at least 1, got {requested}.", param)
    _check(num_prompt_tokens + requested <= max_model_len,
           f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's maximum "
           f"context length is {max_model_len} tokens and your request has {num_prompt_tokens} input "
           f"tokens ({requested} > {max_model_len} - {num_prompt_tokens}).", None)
    return requested


def check_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """Prompt token ids must exist in the tokenizer's vocabulary, and a prompt must not be empty."""
    _check(bool(token_ids), "The decoder prompt cannot be empty", "prompt")
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    _check(bad is None, f"Token id {bad} is out of vocabulary", "prompt")


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    _check(isinstance(call.get("function"), dict), "Each tool call needs a `function` object.", "messages")
    function = dict(call["function"])
    arguments = function.get("arguments")
    if not arguments:
        function["arguments"] = {}
    elif isinstance(arguments, str):
        try:
            function["arguments"] = msgspec.json.decode(arguments)
        except msgspec.DecodeError:
            raise APIError(f"Invalid JSON in the arguments of a tool call: {arguments!r}", param="messages") from None
    return {**call, "function": function}


def _logit_bias(bias: dict[str, Any] | None) -> dict[int, float] | None:
    """Token ids from the JSON's string keys, each bias clamped to [-100, 100], as vLLM converts them."""
    if not bias:
        return None
    out = {}
    for token_id, value in bias.items():
        try:
            key = int(token_id)
        except ValueError:
            raise APIError(f"Found token_id `{token_id}` in logit_bias but token_id must be an integer or string "
                           "representing an integer", param="logit_bias") from None
        _check(_is_number(value), f"logit_bias values must be numbers, got {value!r} for token_id `{token_id}`.",
               "logit_bias")
        _check(INT64_MIN <= key <= INT64_MAX, f"token_id(s) [{key}] in logit_bias contain out-of-vocab token ids.",
               "logit_bias")
        out[key] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, float(value)))
    return out


def _check_logprobs_limit(kind: str, requested: int | None, max_logprobs: int, param: str) -> None:
    if requested is not None:
        _check(requested <= max_logprobs and requested != -1,
               f"Requested {kind} logprobs of {requested}, which is greater than max allowed: {max_logprobs}",
               param)


def _check(ok: bool, message: str, param: str | None) -> None:
    if not ok:
        raise APIError(message, param=param)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _param_of(error: msgspec.ValidationError) -> str | None:
    """The field msgspec names: `$.messages[0].role` -> "messages[0].role"."""
    message = str(error)
    _, sep, path = message.rpartition(" - at `$")
    if message.startswith("Object missing required field `"):
        field = message.split("`")[1]
        path = f"{path.rstrip('`')}.{field}" if sep else field
        return path.lstrip(".")
    return (path.rstrip("`").lstrip(".") or None) if sep else None
