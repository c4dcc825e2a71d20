"""JsonReader: one JSON value read as a model generates it, a character at a time (gateway/tool_calls.py streams
tool-call arguments with it), checked as json.loads checks it."""
from __future__ import annotations

import json
import re
from typing import Any

from gateway.json_text import MAX_JSON_DEPTH, escape_surrogates, json_or

_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_BARE = frozenset("+-.0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_HEX = frozenset("0123456789abcdefABCDEF")
_PLAIN = re.compile(r'[^"\\\x00-\x1f]+')


class JsonReader:
    """One JSON value read as it is generated, a character at a time, checked as json.loads checks it. `feed` gives
    events, each with the path (keys and array positions) of the value it belongs to: ("text", path, piece) for the
    value's text as json.dumps writes it (separators ", " and ": ", a number or literal once it ends: json.dumps of
    json.loads of it), ("string", path, value) when a string value ends, ("end", path, None) when any value ends.
    A container's own brackets, keys and separators belong to the container's path. A lone surrogate escape stays
    an escape in the text (UTF-8 cannot hold it); nesting past MAX_JSON_DEPTH is an error. After an error it reads
    no more (`error`)."""

    def __init__(self) -> None:
        self.error = False
        self._frames: list[list[Any]] = []     # open containers: [bracket, state, current key or position]
        self._top = "value"                    # "value" until the value is read, then "done"
        self._string: str | None = None        # inside a string: "key" or "value"
        self._chars: list[str] = []            # the string's characters so far
        self._escape: str | None = None        # inside an escape: "" after the backslash, then "u" and the hex digits
        self._high = ""                        # a high surrogate waiting for its low half
        self._bare = ""                        # a number or literal being read

    def feed(self, text: str) -> list[tuple[str, tuple, Any]]:
        events: list[tuple[str, tuple, Any]] = []
        at = 0
        while at < len(text) and not self.error:
            plain = _PLAIN.match(text, at) if self._string is not None and self._escape is None else None
            if plain:                           # a run of a string's plain characters at once
                self._add(plain.group(), events)
                at = plain.end()
            else:
                self._char(text[at], events)
                at += 1
        return events

    def _path(self, depth: int | None = None) -> tuple:
        return tuple(f[2] for f in self._frames[:depth])

    def _state(self) -> str:
        return self._frames[-1][1] if self._frames else self._top

    def _set(self, state: str) -> None:
        if self._frames:
            self._frames[-1][1] = state
        else:
            self._top = state

    def _char(self, c: str, events: list) -> None:
        if self._string is not None:
            return self._string_char(c, events)
        if self._bare:
            if c in _BARE:
                self._bare += c
                return
            self._end_bare(events)
            if self.error:
                return
        if c in " \t\n\r":
            return
        state = self._state()
        if state in ("value", "value_or_end"):
            if c == "]" and state == "value_or_end":
                return self._close(events)
            if c in "{[":
                if len(self._frames) == MAX_JSON_DEPTH:
                    self.error = True
                    return
                events.append(("text", self._path(), c))
                self._frames.append([c, "key_or_end" if c == "{" else "value_or_end", None if c == "{" else 0])
            elif c == '"':
                events.append(("text", self._path(), c))
                self._string, self._chars = "value", []
            elif c in _BARE:
                self._bare = c
            else:
                self.error = True
        elif state in ("key", "key_or_end"):
            if c == "}" and state == "key_or_end":
                return self._close(events)
            if c != '"':
                self.error = True
                return
            events.append(("text", self._path(-1), c))
            self._string, self._chars = "key", []
        elif state == "colon":
            if c != ":":
                self.error = True
                return
            events.append(("text", self._path(-1), ": "))
            self._set("value")
        elif state == "next":
            bracket = self._frames[-1][0]
            if c == ",":
                events.append(("text", self._path(-1), ", "))
                if bracket == "[":
                    self._frames[-1][2] += 1
                self._set("key" if bracket == "{" else "value")
            elif c == ("}" if bracket == "{" else "]"):
                self._close(events)
            else:
                self.error = True
        else:                                   # after the value: nothing but whitespace
            self.error = True

    def _string_char(self, c: str, events: list) -> None:
        if self._escape is None:
            if c == '"':
                return self._end_string(events)
            if c == "\\":
                self._escape = ""
            elif c < " ":
                self.error = True               # a raw control character, which json.loads refuses
            else:
                self._add(c, events)
        elif self._escape == "":
            if c == "u":
                self._escape = "u"
            elif c in _ESCAPES:
                self._escape = None
                self._add(_ESCAPES[c], events)
            else:
                self.error = True
        elif c in _HEX:
            self._escape += c
            if len(self._escape) == 5:
                code, self._escape = int(self._escape[1:], 16), None
                if self._high and 0xDC00 <= code <= 0xDFFF:
                    code, self._high = 0x10000 + ((ord(self._high) - 0xD800) << 10 | (code - 0xDC00)), ""
                elif 0xD800 <= code <= 0xDBFF:
                    self._flush_high(events)
                    self._high = chr(code)
                    return
                self._add(chr(code), events)
        else:
            self.error = True

    def _add(self, chars: str, events: list) -> None:
        self._flush_high(events)
        self._chars.append(chars)
        self._emit_string(chars, events)

    def _flush_high(self, events: list) -> None:
        if self._high:
            high, self._high = self._high, ""
            self._chars.append(high)
            self._emit_string(high, events)

    def _emit_string(self, chars: str, events: list) -> None:
        path = self._path() if self._string == "value" else self._path(-1)
        events.append(("text", path, escape_surrogates(json.dumps(chars, ensure_ascii=False)[1:-1])))

    def _end_string(self, events: list) -> None:
        self._flush_high(events)
        kind, value = self._string, "".join(self._chars)
        self._string, self._chars = None, []
        if kind == "key":
            events.append(("text", self._path(-1), '"'))
            self._frames[-1][2] = value
            self._set("colon")
        else:
            events.append(("text", self._path(), '"'))
            events.append(("string", self._path(), value))
            self._value_done(events)

    def _end_bare(self, events: list) -> None:
        bare, self._bare = self._bare, ""
        value = json_or(bare, JsonReader)
        if value is JsonReader:
            self.error = True
            return
        events.append(("text", self._path(), json.dumps(value)))
        self._value_done(events)

    def _close(self, events: list) -> None:
        bracket = self._frames.pop()[0]
        events.append(("text", self._path(), "}" if bracket == "{" else "]"))
        self._value_done(events)

    def _value_done(self, events: list) -> None:
        events.append(("end", self._path(), None))
        self._set("next" if self._frames else "done")
