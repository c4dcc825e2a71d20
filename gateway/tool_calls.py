"""Tool calling as vLLM serves it: `tool_choice` checked, the JSON-schema constraint that makes "required" and a
named tool always give a valid call, and the Hermes/Qwen parser of `<tool_call>{json}</tool_call>` blocks for
"auto", over a whole output and over a stream.

    tool_choice   constraint                              message                               finish_reason
    none          -                                       content                               the worker's
    auto          - (parser: --tool-call-parser hermes)   content before the blocks, tool_calls  "tool_calls" if any
    required      array of {name: enum, parameters}       content "", one call per item          the worker's
    named         that tool's parameters                  content "", the output as arguments    the worker's
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.protocol import APIError
from worker.ipc.messages import StructuredOutput

PARSERS = ("hermes",)
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_BLOCKS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)   # the last may be unclosed
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
        """(content, tool calls) of a whole output."""
        if self.mode == "named":
            return "", [ToolCall(self.name, text)]
        if self.mode == "required":
            return "", [ToolCall(c["name"], _dumps(c["parameters"])) for c in _json_or(text, [])]
        if self.mode == "auto":
            return parse_hermes(text)
        return text, []

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self)

    def _parameters(self, name: str) -> dict[str, Any]:
        tool = next(t for t in self.tools if t["function"]["name"] == name)
        return tool["function"].get("parameters") or EMPTY_PARAMETERS


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """Hermes/Qwen blocks: `<tool_call>{"name": .., "arguments": {..}}</tool_call>`, the text before the first
    block as content. An output whose blocks do not all parse is all content, as vLLM answers it."""
    if TOOL_CALL_START not in text:
        return text, []
    calls = []
    for closed, unclosed in _BLOCKS.findall(text):
        call = _json_or(closed or unclosed, None)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, []
        calls.append(ToolCall(call["name"], _dumps(call.get("arguments", {}))))
    content = text[:text.index(TOOL_CALL_START)]
    return content or None, calls


class ToolCallStream:
    """A streamed output as OpenAI streams tool calls: `feed(text)` and `finish()` give (content, tool call
    deltas). A named tool's arguments stream as they come (the first delta with the call's id and name); the
    calls of "required" and of Hermes blocks go out whole, each once its JSON (block) is closed."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.num_calls = 0
        self._text = ""          # output not handed out yet (auto, required)
        self._scan = 0           # required: where the scan of _text stopped
        self._depth = 0
        self._in_string = self._escaped = False
        self._item_start = -1

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if self.choice.mode == "named":
            return self._named(text)
        if self.choice.mode == "required":
            self._text += text
            return "", self._required_items()
        if self.choice.mode == "auto":
            self._text += text
            return self._hermes(final=False)
        return text, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return self._hermes(final=True) if self.choice.mode == "auto" else ("", [])

    def _named(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        if not text:
            return "", []
        if self.num_calls == 0:
            self.num_calls = 1
            call = ToolCall(self.choice.name, text).as_dict()
            return "", [{"index": 0, **call}]
        return "", [{"index": 0, "function": {"arguments": text}}]

    def _required_items(self) -> list[dict[str, Any]]:
        """Scan the JSON array for items closed since the last call (strings and nesting tracked)."""
        deltas = []
        for i in range(self._scan, len(self._text)):
            c = self._text[i]
            if self._in_string:
                self._escaped, self._in_string = (False, True) if self._escaped else (c == "\\", c != '"')
                continue
            if c == '"':
                self._in_string = True
            elif c in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._item_start = i
            elif c in "]}":
                if self._depth == 2:
                    item = _json_or(self._text[self._item_start:i + 1], {})
                    deltas.append(self._call_delta(ToolCall(item.get("name", ""), _dumps(item.get("parameters", {})))))
                self._depth -= 1
        self._scan = len(self._text)
        return deltas

    def _hermes(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """Content up to a block (holding back a possible start of one), then each block once closed."""
        content, deltas = "", []
        while True:
            start = self._text.find(TOOL_CALL_START)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._text, TOOL_CALL_START)
                content += self._text[:len(self._text) - keep]
                self._text = self._text[len(self._text) - keep:]
                return content, deltas
            content += self._text[:start]
            end = self._text.find(TOOL_CALL_END, start)
            if end < 0 and not final:
                self._text = self._text[start:]
                return content, deltas
            body = self._text[start + len(TOOL_CALL_START):end if end >= 0 else len(self._text)]
            call = _json_or(body, None)
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                deltas.append(self._call_delta(ToolCall(call["name"], _dumps(call.get("arguments", {})))))
            else:
                content += self._text[start:end + len(TOOL_CALL_END) if end >= 0 else len(self._text)]
            self._text = self._text[end + len(TOOL_CALL_END):] if end >= 0 else ""

    def _call_delta(self, call: ToolCall) -> dict[str, Any]:
        self.num_calls += 1
        return {"index": self.num_calls - 1, **call.as_dict()}


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (text that may become the marker)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _json_or(text: str, default: Any) -> Any:
    try:
        return json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return default


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _check(ok: bool, message: str, param: str | None) -> None:
    if not ok:
        raise APIError(message, param=param)
