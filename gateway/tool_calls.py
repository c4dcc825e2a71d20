"""Tool calling as vLLM serves it: `tool_choice` checked, the JSON-schema constraint that makes "required" and a
named tool always give a valid call, and the Hermes/Qwen parser of `<tool_call>{json}</tool_call>` blocks for
"auto". One parser reads a stream and a whole output (`ToolChoice.parse` streams the whole text through it), so a
response's calls, content and finish reason are the same however its text arrives.

    tool_choice   constraint                              message                               finish_reason
    none          -                                       content                               the worker's
    auto          - (parser: --tool-call-parser hermes)   text outside the blocks, tool_calls   "tool_calls" if any
    required      array of {name: enum, parameters}       content "", one call per item          the worker's
    named         that tool's parameters                  content "", the output as arguments    the worker's
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.api_error import APIError
from gateway.json_reader import JsonReader
from gateway.json_text import has_surrogate
from worker.ipc.messages import StructuredOutput

PARSERS = ("hermes",)
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
CORRECT_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                      # JSON text
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str                           # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]         # the request's tools, as the chat template receives them
    name: str | None = None             # the named tool
    parallel: bool = True               # parallel_tool_calls: "required" may give more than one call

    @classmethod
    def from_request(cls, tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None,
                     auto_enabled: bool) -> ToolChoice:
        """vLLM's checks: a tool_choice needs tools; "auto" (the default with tools) needs the parser flags; a named
        tool must be one of `tools`; "required" with no tools is "none"."""
        if tool_choice is None:
            tool_choice = "auto" if tools else "none"
        if tool_choice == "none":
            return cls("none", tools or [])
        _check(tools is not None, "When using `tool_choice`, `tools` must be set.", "tool_choice")
        _check(tool_choice in ("auto", "required") or isinstance(tool_choice, dict),
               f"Invalid value for `tool_choice`: {tool_choice}! Only named tools, \"none\", \"auto\" or \"required\" "
               "are supported.", "tool_choice")
        names = [t["function"]["name"] for t in tools]
        if tool_choice == "required":
            return cls("none", []) if not tools else cls("required", tools, parallel=parallel is not False)
        if tool_choice == "auto":
            _check(auto_enabled, AUTO_NEEDS_FLAGS, "tool_choice")
            return cls("auto", tools)
        function = tool_choice.get("function")
        _check(isinstance(function, dict), f"Invalid value for `function`: `{function}` in `tool_choice`! "
               f"{CORRECT_USAGE}", "tool_choice")
        _check("name" in function, f"Expected field `name` in `function` in `tool_choice`! {CORRECT_USAGE}",
               "tool_choice")
        name = function["name"]
        _check(isinstance(name, str) and bool(name), f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
               f"{CORRECT_USAGE}", "tool_choice")
        _check(name in names, "The tool specified in `tool_choice` does not match any of the specified `tools`",
               "tool_choice")
        return cls("named", tools, name)

    @property
    def parses_output(self) -> bool:
        """Whether the output is read as tool calls (then special tokens such as <tool_call> stay in the text)."""
        return self.mode != "none"

    def constraint(self) -> StructuredOutput | None:
        """The JSON schema "required" and a named tool constrain the output to (vLLM's), else None."""
        if self.mode == "named":
            schema = self._parameters(self.name)
        elif self.mode == "required":
            schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
                {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                "parameters": t["function"].get("parameters") or EMPTY_PARAMETERS},
                 "required": ["name", "parameters"]} for t in self.tools]}}
            if not self.parallel:
                schema["maxItems"] = 1
        else:
            return None
        return StructuredOutput("json", json.dumps(schema, separators=(",", ":")))

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool calls) of a whole output: what its stream gives, the deltas joined. Content is None when
        "auto" found calls and no text outside them, as vLLM answers it."""
        stream = self.stream()
        content, deltas = stream.feed(text)
        more_content, more_deltas = stream.finish()
        content += more_content
        calls: list[list[str]] = []                        # [id, name, arguments] by index
        for delta in deltas + more_deltas:
            if delta["index"] == len(calls):
                calls.append([delta["id"], delta["function"]["name"], ""])
            calls[delta["index"]][2] += delta["function"]["arguments"]
        if self.mode == "auto" and calls:
            content = content or None
        return content, [ToolCall(name, arguments, id) for id, name, arguments in calls]

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def _parameters(self, name: str) -> dict[str, Any]:
        tool = next(t for t in self.tools if t["function"]["name"] == name)
        return tool["function"].get("parameters") or EMPTY_PARAMETERS


class ToolCallStream:
    """A streamed output's tool calls as OpenAI and vLLM stream them: `feed(text)` and `finish()` give (content, tool
    call deltas). A call's first delta carries its index, id, type and name with arguments ""; later deltas of that
    index carry pieces of its arguments as they are generated, which concatenate to the arguments of the whole
    output's call: the named tool's output as it comes; for "required" and Hermes blocks, the JSON read so far
    written as json.dumps writes it (a number or literal once it ends, a lone surrogate as its escape).

    What it decides, as vLLM's streaming Hermes parser does (its whole-output parser differs: it makes an output
    with one bad block all content, drops text after the first block and takes the last of two "name" keys, which
    a stream could not take back): text outside the blocks is content, wherever it is; each block that gives a call
    is a call, one that breaks before its name is read (not JSON, not an object, nested past MAX_JSON_DEPTH, a name
    that is not a string or holds a lone surrogate) is content; the first string "name" and the first "arguments"
    count; a block that breaks after its name is read keeps what was read and stops there."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.num_calls = 0
        self._text = ""                                   # auto: output not read yet (a possible tag held back)
        self._block: _Block | None = None                 # auto: the <tool_call> block being read
        self._reader = JsonReader()                      # required: the array of calls
        self._items: dict[int, _Call] = {}                # required: the calls by array position

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.choice.mode == "named":
            deltas = [] if self.num_calls else [self._start(_Call(self.choice.name))]
            if text:
                deltas.append(_arguments_delta(0, text))
            return "", deltas
        if self.choice.mode == "required":
            items: list[dict[str, Any]] = []
            for kind, path, value in self._reader.feed(text):
                if path:
                    self._on_event(self._items.setdefault(path[0], _Call()), kind, path[1:], value, "parameters",
                                   items)
            return "", items
        if self.choice.mode == "auto":
            self._text += text
            return self._hermes(final=False)
        return text, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self.choice.mode == "named" and not self.num_calls:
            return "", [self._start(_Call(self.choice.name))]
        return self._hermes(final=True) if self.choice.mode == "auto" else ("", [])

    def _hermes(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Content up to a block (holding back a possible start of one), then the block's call as it is read (holding
        back a possible end tag); a block ends at its first end tag, or with the output."""
        content, deltas = "", []
        while True:
            if self._block is None:
                start = self._text.find(TOOL_CALL_START)
                if start < 0:
                    keep = 0 if final else _partial_suffix(self._text, TOOL_CALL_START)
                    content += self._text[:len(self._text) - keep]
                    self._text = self._text[len(self._text) - keep:]
                    return content, deltas
                content += self._text[:start]
                self._block, self._text = _Block(), self._text[start + len(TOOL_CALL_START):]
            end = self._text.find(TOOL_CALL_END)
            if end >= 0:
                body, rest = self._text[:end], self._text[end + len(TOOL_CALL_END):]
            else:
                keep = 0 if final else _partial_suffix(self._text, TOOL_CALL_END)
                body, rest = self._text[:len(self._text) - keep], None
                self._text = self._text[len(self._text) - keep:]
            block = self._block
            block.raw += body
            if not block.broken:
                for kind, path, value in block.reader.feed(body):
                    self._on_event(block.call, kind, path, value, "arguments", deltas)
                block.broken = block.reader.error
            if rest is None and not final:
                return content, deltas
            if block.call.index is None:            # never a call: the block is text, as parse_hermes says
                content += TOOL_CALL_START + block.raw + (TOOL_CALL_END if rest is not None else "")
            self._block = None
            if rest is None:
                return content, deltas
            self._text = rest

    def _on_event(self, call: _Call, kind: str, path: tuple, value: Any, key: str,
                  deltas: list[dict[str, Any]]) -> None:
        """One event of a call's JSON (path relative to the call object): its name starts the call, the text of its
        `key` value goes out as arguments (held until the name is known), its end gives "{}" if it had none."""
        if kind == "string" and path == ("name",) and call.name is None and not has_surrogate(value):
            call.name = value
            deltas.append(self._start(call))
            if call.pending:
                deltas.append(_arguments_delta(call.index, call.pending))
                call.pending = ""
        elif kind == "text" and path[:1] == (key,) and not call.arguments_read:
            call.has_arguments = True
            if call.index is None:
                call.pending += value
            elif deltas and deltas[-1]["index"] == call.index and "id" not in deltas[-1]:
                deltas[-1]["function"]["arguments"] += value
            else:
                deltas.append(_arguments_delta(call.index, value))
        elif kind == "end" and path == (key,):
            call.arguments_read = True
        elif kind == "end" and path == () and call.index is not None and not call.has_arguments:
            call.has_arguments = True
            deltas.append(_arguments_delta(call.index, "{}"))

    def _start(self, call: _Call) -> dict[str, Any]:
        call.index, self.num_calls = self.num_calls, self.num_calls + 1
        return {"index": call.index, **ToolCall(call.name, "").as_dict()}


def _arguments_delta(index: int, arguments: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": arguments}}


@dataclass
class _Call:
    """A streamed call: its name once read, its index once started, arguments read before the name."""
    name: str | None = None
    index: int | None = None
    pending: str = ""
    has_arguments: bool = False
    arguments_read: bool = False


@dataclass
class _Block:
    """A Hermes block being read: its text (content if it never gives a call), its JSON, its call."""
    raw: str = ""
    reader: JsonReader = field(default_factory=lambda: JsonReader())
    call: _Call = field(default_factory=_Call)
    broken: bool = False


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (text that may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _check(ok: bool, message: str, param: str | None) -> None:
    if not ok:
        raise APIError(message, param=param)
