"""Constraints the structured-output tests share (worker, e2e): JSON schemas with enums, nested objects, arrays
and numbers, a regex, a choice and a grammar, each with a check of an output against it."""
from __future__ import annotations

import json
import re

import jsonschema

SCHEMAS = {
    "enum": {"type": "object", "properties": {"label": {"enum": ["positive", "negative", "neutral"]}},
             "required": ["label"], "additionalProperties": False},
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "ok"],
               "properties": {"user": {"type": "object", "additionalProperties": False, "required": ["id", "role"],
                                       "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                      "role": {"enum": ["admin", "guest"]}}},
                              "ok": {"type": "boolean"}}},
    "array": {"type": "object", "additionalProperties": False, "required": ["tags", "score"],
              "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                                      "maxItems": 3},
                             "score": {"type": "integer", "minimum": -50, "maximum": 50}}},
    "string": {"type": "object", "additionalProperties": False, "required": ["name"],
               "properties": {"name": {"type": "string", "maxLength": 4}}},
}
REGEX = r"(cat|dog)-[0-9]{2,3}"
CHOICES = ["yes", "no", "maybe so"]
GRAMMAR = 'root ::= "(" num (" + " num)? ")"\nnum ::= [1-9] [0-9]?'
GRAMMAR_MATCH = re.compile(r"\([1-9][0-9]?( \+ [1-9][0-9]?)?\)")
# A small model can fill an open-ended JSON object for ever; nudged towards closing quotes and braces it ends.
CLOSERS = {4: 4.0, 63: 4.0, 95: 4.0}     # '"', ']', '}': bytes, at the same ids in every byte-level BPE of the demo


# Specs a greedy row may end early, each with the text an `ending_bias` drives it to before its end
ENDS_EARLY = [("regex", "[a-z]{0,3}", "aaa"), ("json_object", "", "{}")]


def ending_bias(tokenizer, forced: str, eos: int) -> dict[int, float]:
    """A logit_bias under which a greedy row of an ENDS_EARLY spec takes `forced`'s characters, then its end (`eos`);
    past the end an unconstrained row would take "Z", which no ENDS_EARLY spec allows (`tokenizer` is a
    tokenizers.Tokenizer)."""
    return ({tokenizer.token_to_id(c): 60.0 + i for i, c in enumerate(dict.fromkeys(forced))}
            | {eos: 50.0, tokenizer.token_to_id("Z"): 100.0})


def whitespace_ban(tokenizer) -> dict[str, int]:
    """A logit_bias that bans every token made of whitespace alone (`tokenizer` is a tokenizers.Tokenizer): JSON
    allows any whitespace between its tokens (vLLM's default), and a model trained on Python source, which indents
    after every brace, can fill that room until max_tokens."""
    return {str(i): -100 for i in range(tokenizer.get_vocab_size())
            if (text := tokenizer.decode([i])) and not text.strip()}


def check(kind: str, spec: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), json.loads(spec))
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(spec, text), text
    elif kind == "choice":
        assert text in json.loads(spec)
    else:
        assert GRAMMAR_MATCH.fullmatch(text), text


SPECS = ([("json", json.dumps(s)) for s in SCHEMAS.values()]
         + [("json_object", ""), ("regex", REGEX), ("choice", json.dumps(CHOICES)), ("grammar", GRAMMAR)])


