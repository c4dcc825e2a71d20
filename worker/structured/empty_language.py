"""Specs that no output satisfies, found before a request is served under them (each is then a 400).

xgrammar compiles a grammar whose rules never finish (`root ::= x`, `x ::= y`, `y ::= x`; `root ::= root "a"`;
the JSON schema `{"$ref": "#"}`, which it lowers to `root ::= root`) without complaint, and the matcher then
allows no token at all. `unproductive_rules` finds such rules on xgrammar's normalized EBNF: a rule is
productive when one of its alternatives is a sequence of productive items (a literal, a character class, an
optional or starred item, a reference to a productive rule); the rules left unproductive at the fixpoint
derive no finite string. `schema_problem` names what xgrammar reads differently from JSON Schema in a way that
would serve a schema admitting nothing, or one it cannot see: a remote `$ref`, an empty `anyOf`/`oneOf`/`type`,
`not` of everything, a required property that `additionalProperties: false` forbids.
"""
from __future__ import annotations

import re
from typing import Any

# Items of xgrammar's normalized EBNF: a literal, a character class, a lookahead's opening, a rule name, a
# repetition range, punctuation.
_TOKEN = re.compile(r'\s*("(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|\(=|[A-Za-z_][\w.\-]*|\{\s*-?\d+\s*,\s*-?\d+\s*\}'
                    r'|[()|*+?])')
_RULE = re.compile(r"^([A-Za-z_][\w.\-]*) ::= (.*)$")

# An expression: ("lit",) | ("ref", name) | ("seq", [expr]) | ("alt", [expr]) | ("opt", expr) | ("plus", expr)


def unproductive_rules(ebnf: str) -> list[str]:
    """The rules of `ebnf` (xgrammar's normalized text, `str(Grammar)`) that derive no finite string, in
    definition order; [] when every rule does, or when the text is not in the expected form."""
    rules: dict[str, tuple] = {}
    for line in ebnf.splitlines():
        match = _RULE.match(line.strip())
        if match is None:
            continue
        try:
            rules[match.group(1)] = _Parser(match.group(2)).expression()
        except ValueError:
            return []         # a form this reader does not know: leave the grammar to xgrammar
    productive: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, expr in rules.items():
            if name not in productive and _productive(expr, productive, rules):
                productive.add(name)
                changed = True
    return [name for name in rules if name not in productive]


def _productive(expr: tuple, productive: set[str], rules: dict[str, tuple]) -> bool:
    kind = expr[0]
    if kind in ("lit", "opt"):
        return True
    if kind == "ref":
        return expr[1] in productive or expr[1] not in rules      # an unknown name is xgrammar's to refuse
    if kind == "plus":
        return _productive(expr[1], productive, rules)
    parts = (_productive(e, productive, rules) for e in expr[1])
    return all(parts) if kind == "seq" else any(parts)


class _Parser:
    """Recursive descent over one rule's body: alternatives of sequences of quantified atoms."""

    def __init__(self, text: str):
        self.tokens, end = [], 0
        for match in _TOKEN.finditer(text):
            if match.start() != end:
                raise ValueError(text)
            self.tokens.append(match.group(1))
            end = match.end()
        if text[end:].strip():
            raise ValueError(text)
        self.at = 0

    def expression(self) -> tuple:
        expr = self._alternatives()
        while self._peek() == "(=":            # a lookahead after the body constrains what follows, not the rule
            self._atom()
        if self.at != len(self.tokens):
            raise ValueError(self.tokens[self.at])
        return expr

    def _peek(self) -> str | None:
        return self.tokens[self.at] if self.at < len(self.tokens) else None

    def _take(self) -> str:
        token = self._peek()
        if token is None:
            raise ValueError("unexpected end")
        self.at += 1
        return token

    def _alternatives(self) -> tuple:
        options = [self._sequence()]
        while self._peek() == "|":
            self._take()
            options.append(self._sequence())
        return options[0] if len(options) == 1 else ("alt", options)

    def _sequence(self) -> tuple:
        items = []
        while self._peek() not in (None, "|", ")"):
            items.append(self._quantified())
        return ("seq", items)

    def _quantified(self) -> tuple:
        atom = self._atom()
        while self._peek() is not None and (self._peek() in "*+?" or self._peek().startswith("{")):
            quantifier = self._take()
            if quantifier in ("*", "?"):
                atom = ("opt", atom)
            elif quantifier == "+":
                atom = ("plus", atom)
            else:
                atom = ("opt", atom) if int(quantifier[1:].split(",")[0]) <= 0 else ("plus", atom)
        return atom

    def _atom(self) -> tuple:
        token = self._take()
        if token in ("(", "(="):
            inner = self._alternatives()
            if self._take() != ")":
                raise ValueError("unclosed group")
            return ("lit",) if token == "(=" else inner
        if token[0] in '"[':
            return ("lit",)
        if token[0].isalpha() or token[0] == "_":
            return ("ref", token)
        raise ValueError(token)


def schema_problem(schema: Any) -> str | None:
    """What makes `schema` (parsed JSON) admit no value or reach outside itself, in JSON Schema's words; None
    when nothing here is wrong. Walks the schema without recursion (it may be deeply nested)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        problem = _node_problem(node)
        if problem is not None:
            return problem
        for key, value in node.items():
            if key in _NAMED_SCHEMAS and isinstance(value, dict):
                stack.extend(value.values())       # {name: schema}: the names are not keywords
            elif key not in _VALUES:
                stack.append(value)
    return None


_NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUES = ("enum", "const", "default", "examples", "required")     # data, not schemas


def _node_problem(node: dict[str, Any]) -> str | None:
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return f"`$ref` {ref!r} is not supported: only references inside the schema ('#' or '#/...') are."
    for key in ("anyOf", "oneOf"):
        if node.get(key) == []:
            return f"`{key}` must be a non-empty array; an empty one admits no value."
    if node.get("type") == []:
        return "`type` is an empty array, which admits no value."
    if node.get("not") in ({}, True):
        return "`not` of a schema that admits every value admits no value."
    properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    if node.get("additionalProperties") is False and isinstance(node.get("required"), list):
        missing = [p for p in node["required"] if isinstance(p, str) and p not in properties]
        if missing:
            return (f"Required property {missing[0]!r} is not in `properties` and `additionalProperties` is false, "
                    "so the schema admits no value.")
    return None
