"""The model's tokenizer in the gateway: encode, decode, chat template, incremental detokenization.

Built on the `tokenizers` library and jinja2 directly (no transformers, so no torch): a Hugging Face
tokenizer directory holds tokenizer.json, and tokenizer_config.json with the special tokens and the
chat template (or the template in chat_template.jinja).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import tokenizers
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.api_error import APIError
from gateway.stop_strings import StopStrings
from worker.ipc.messages import RequestOutput, TokenLogprob

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# Longer inputs go through the batch calls, which release the GIL (so a thread running them leaves the
# event loop free); the single calls hold it.
RELEASE_GIL_SIZE = 4096
DETOKENIZE_CONTEXT = 5    # prompt tokens decoded before the output, so the first token keeps its spacing
NO_CHAT_TEMPLATE = ("As of transformers v4.44, default chat template is no longer allowed, so you must "
                    "provide a chat template if the tokenizer does not define one.")


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, chat_template: str | None = None,
                 special_tokens: dict[str, str] | None = None):
        self.backend = backend
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}      # bos_token, eos_token, ... -> their text
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._token_texts: dict[int, str] = {}

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise FileNotFoundError(f"No tokenizer.json in {path}; pass --tokenizer with a Hugging Face "
                                    "tokenizer directory.")
        backend = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        template = _default_template(config.get("chat_template"))
        if template is None and (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        special = {key: _token_text(config[key]) for key in SPECIAL_TOKEN_KEYS if config.get(key)}
        return cls(backend, template, special)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.encoding(text, add_special_tokens).ids

    def encoding(self, text: str, add_special_tokens: bool = True) -> tokenizers.Encoding:
        """The backend's encoding, whose length is known before its ids become a Python list."""
        if len(text) < RELEASE_GIL_SIZE:
            return self.backend.encode(text, add_special_tokens=add_special_tokens)
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(token_ids) < RELEASE_GIL_SIZE:
            return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.backend.decode_batch([token_ids], skip_special_tokens=skip_special_tokens)[0]

    def bad_words_token_ids(self, words: list[str] | None) -> list[list[int]]:
        """vLLM's bad_words as token sequences: each word as is (left-stripped), and with a leading space
        when that gives another first token and as many tokens (the word in the middle of a text)."""
        sequences = []
        for word in words or ():
            ids = self.encode(word.lstrip(), add_special_tokens=False)
            spaced = self.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences += [ids] if ids else []
            if spaced and (not ids or spaced[0] != ids[0] and len(spaced) == len(ids)):
                sequences.append(spaced)
        return sequences

    def token_text(self, token_id: int) -> str:
        """One token decoded on its own (a partial UTF-8 sequence reads as U+FFFD), for logprobs."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.decode([token_id], skip_special_tokens=False)
        return text

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render the conversation; template errors, whatever a client's kwargs made the template raise,
        are the client's (400), as in vLLM."""
        if self.chat_template is None:
            raise APIError(NO_CHAT_TEMPLATE)
        context = {**self.special_tokens, **kwargs, "messages": messages,
                   "add_generation_prompt": add_generation_prompt}
        try:
            return _compile(self.chat_template).render(context)
        except (jinja2.TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as e:
            raise APIError(f"Chat template error: {e}") from None


@dataclass
class Delta:
    """What one worker output adds to a choice."""
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    status_code: int | None = None     # with an error: the HTTP status the worker gave it (None: 500)
    num_cached_tokens: int | None = None   # prompt tokens the prefix cache held; on a choice's first delta

    def extend(self, later: Delta) -> None:
        """Append a later delta of the same choice (to build a whole, non-streamed choice)."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            self.logprobs = self.logprobs or []
            self.logprobs.extend(later.logprobs)
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.finish_reason, self.stop_reason, self.error = later.finish_reason, later.stop_reason, later.error
        self.status_code = later.status_code
        if self.num_cached_tokens is None:
            self.num_cached_tokens = later.num_cached_tokens


class IncrementalDetokenizer:
    """Turns a request's outputs into text deltas that are final.

    Never emits a broken UTF-8 sequence: while the decoded tail ends in U+FFFD the text is held back
    (vLLM's prefix/read offsets). Never emits a stop string or a part of one: text that could begin
    a stop string is held until it is known not to; on a match the text ends before the stop string
    (or after it, with include_stop_str_in_output) and the finish reason becomes "stop". The token
    that stopped the request (EOS or a stop token id) adds no text unless include_stop_str_in_output.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], *, skip_special_tokens: bool = True,
                 stop: list[str] | tuple[str, ...] = (), include_stop_str_in_output: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = StopStrings.of(tuple(stop)) if stop else None
        self._stop_state = 0                # the automaton's state after the text decoded so far
        self._include_stop = include_stop_str_in_output
        self._ids = list(prompt_ids[-DETOKENIZE_CONTEXT:])
        self._prefix_offset = 0            # _ids[prefix:read] is decoded text already released
        self._read_offset = len(self._ids)
        self._held = ""                     # decoded text that may begin a stop string

    def update(self, output: RequestOutput) -> Delta:
        finished = output.finish_reason is not None
        text_ids = output.new_token_ids
        if output.finish_reason == "stop" and not self._include_stop and text_ids:
            text_ids = text_ids[:-1]
        text, stop_string = self._release(self._decode(text_ids, flush=finished), final=finished)
        delta = Delta(text, output.new_token_ids, output.new_logprobs, output.prompt_logprobs,
                      num_cached_tokens=output.num_cached_tokens)
        if stop_string is not None:
            delta.finish_reason, delta.stop_reason = "stop", stop_string
        elif finished:
            delta.finish_reason, delta.stop_reason, delta.error = output.finish_reason, output.stop_reason, output.error
            delta.status_code = output.status_code
        return delta

    def _decode(self, token_ids: list[int], flush: bool) -> str:
        """New complete text after appending `token_ids`; with flush, whatever remains."""
        self._ids.extend(token_ids)
        decode = self._tokenizer.decode
        released = decode(self._ids[self._prefix_offset:self._read_offset], self._skip_special)
        text = decode(self._ids[self._prefix_offset:], self._skip_special)
        if len(text) <= len(released) or (text.endswith("\ufffd") and not flush):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return text[len(released):]

    def _release(self, text: str, final: bool) -> tuple[str, str | None]:
        """(text safe to emit, the stop string that matched or None). The automaton reads the new text alone;
        the stop strings are searched only once one has ended, which ends the request."""
        if self._stop is None:
            return text, None
        buffer = self._held + text
        self._stop_state, ended = self._stop.advance(self._stop_state, text)
        matches = [(i, s) for s in self._stop.strings if (i := buffer.find(s)) >= 0] if ended else []
        if matches:
            start, stop = min(matches, key=lambda m: m[0])
            self._held = ""
            return buffer[:start + len(stop) if self._include_stop else start], stop
        keep = 0 if final else self._stop.held_length(self._stop_state)
        self._held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep], None


def _token_text(value: Any) -> str:
    return value["content"] if isinstance(value, dict) else str(value)


def _default_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of named templates ("default" wins)."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        return named.get("default") or next(iter(named.values()), None)
    return value


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    """A chat template compiled the way Hugging Face templates expect to be rendered."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
