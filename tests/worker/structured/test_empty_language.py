"""Grammars and schemas that no output satisfies, found on xgrammar's normalized EBNF and on the schema itself."""
import json

import pytest

from worker.structured.empty_language import schema_problem, unproductive_rules

xgrammar = pytest.importorskip("xgrammar")


def normalized(ebnf: str) -> str:
    return str(xgrammar.Grammar.from_ebnf(ebnf))


@pytest.mark.parametrize("ebnf, unproductive", [
    ('root ::= x\nx ::= y\ny ::= x', ["root", "x", "y"]),            # a cycle with no way out
    ('root ::= root "a"', ["root"]),                                   # left recursion with no base case
    ('root ::= "a" x\nx ::= "b" x', ["root", "x"]),                    # right recursion with no base case
    ('root ::= x+\nx ::= "a" x', ["root", "x"]),                       # one or more of what never ends
    ('root ::= x{1,3}\nx ::= x', ["root", "x"]),
    ('root ::= "a" | root "b"', []),                                   # left recursion with a base case
    ('root ::= x? "a"\nx ::= x', ["x"]),                               # the unending rule is optional...
    ('root ::= x* "a"\nx ::= x', ["x"]),
    ('root ::= x{0,3}\nx ::= x', ["x"]),
    ('root ::= "a" | "b" x\nx ::= "c" x', ["x"]),                      # ...or one branch of several
    ('root ::= [a-z]+ "\\"|)(" x\nx ::= "q" | x', []),                 # punctuation inside literals is text
    ('root ::= "(" num (" + " num)? ")"\nnum ::= [1-9] [0-9]?', []),
])
def test_unproductive_rules_are_those_that_derive_no_finite_string(ebnf, unproductive):
    written = {line.split(" ::= ")[0] for line in ebnf.splitlines()}         # less the rules xgrammar adds
    assert sorted(set(unproductive_rules(normalized(ebnf))) & written) == sorted(unproductive)


@pytest.mark.parametrize("schema, unproductive_root", [
    ({"$ref": "#"}, True),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, True),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}},
      "$ref": "#/$defs/n"}, True),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, False),    # a tree whose children are optional
    ({"type": "array", "items": {"$ref": "#"}}, False),
    ({"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}, False),
])
def test_a_schema_that_requires_itself_without_end_has_an_unproductive_root(schema, unproductive_root):
    ebnf = str(xgrammar.Grammar.from_json_schema(json.dumps(schema)))
    assert ("root" in unproductive_rules(ebnf)) == unproductive_root


@pytest.mark.parametrize("schema, problem", [
    ({"$ref": "https://example.com/a.json"}, "`$ref` 'https://example.com/a.json' is not supported"),
    ({"items": [{"$ref": "a.json#/b"}]}, "`$ref` 'a.json#/b' is not supported"),
    ({"anyOf": []}, "`anyOf` must be a non-empty array"),
    ({"properties": {"a": {"oneOf": []}}}, "`oneOf` must be a non-empty array"),
    ({"type": []}, "`type` is an empty array"),
    ({"not": {}}, "`not` of a schema that admits every value"),
    ({"not": True}, "`not` of a schema that admits every value"),
    ({"required": ["a"], "properties": {"b": {}}, "additionalProperties": False}, "Required property 'a'"),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "http://x/y"}}}, "`$ref` 'http://x/y' is not supported"),
])
def test_schema_problem_names_what_admits_nothing_or_reaches_outside(schema, problem):
    assert problem in schema_problem(schema)


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},                                                     # the grammar check's to find
    {"$ref": "#/$defs/a", "$defs": {"a": {"type": "string"}}},
    {"properties": {"not": {}, "$ref": {"type": "string"}, "anyOf": {}}, "required": ["not"]},   # property names
    {"enum": [{"$ref": "http://x"}, {"not": {}}]},                     # values, not schemas
    {"const": {"anyOf": []}, "default": {"type": []}},
    {"required": ["a"], "properties": {"a": {}}, "additionalProperties": False},
    {"not": {"type": "string"}},
])
def test_schema_problem_leaves_sound_schemas_alone(schema):
    assert schema_problem(schema) is None


def test_schema_problem_walks_a_deep_schema_without_recursion():
    schema: dict = {"type": "string"}
    for _ in range(100_000):
        schema = {"type": "array", "items": schema}
    assert schema_problem(schema) is None
    schema["items"]["items"]["not"] = {}
    assert "`not`" in schema_problem(schema)


def test_an_unknown_form_is_left_to_xgrammar():
    assert unproductive_rules("root ::= @@@") == []
