"""GrammarCompiler: StructuredOutput specs compiled by xgrammar on a thread pool, cached by spec.

Compiling a JSON schema can take from a millisecond to a second, so it never runs on the step loop: `submit`
returns a future at once and the engine holds the request until it is done. The tokenizer's vocabulary
(xgrammar's TokenizerInfo) is read on the pool too, once, as soon as the compiler is made (the engine makes it while
its model loads: xgrammar's and the tokenizer's imports hold the interpreter for seconds, which a first constrained
request arriving among others would make them all wait for). A spec
xgrammar refuses, or one that no output satisfies (worker/structured/empty_language.py), becomes a ValueError
naming the problem, answered to its request as a 400. `json_object` is a JSON schema of any object, as vLLM
compiles it.
"""
from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait

import msgspec

from worker.ipc.messages import StructuredOutput
from worker.structured.empty_language import schema_problem, unproductive_rules

logger = logging.getLogger(__name__)

CACHE_SIZE = 1024        # compiled grammars kept (xgrammar's own cache keeps their token masks)
COMPILE_THREADS = 2
# xgrammar's "[time] file.cc:line: " and "Check failed: (cond) is false: " prefixes
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")


class GrammarCompiler:
    def __init__(self, tokenizer_path: str, vocab_size: int, stop_token_ids: list[int],
                 disable_any_whitespace: bool = False):
        self._disable_any_whitespace = disable_any_whitespace   # --structured-outputs-config: every JSON grammar
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        self._compiler = self._pool.submit(_make_compiler, tokenizer_path, vocab_size, stop_token_ids)
        self._cache: OrderedDict[StructuredOutput, Future] = OrderedDict()   # spec -> compiled grammar

    def wait_ready(self) -> None:
        """Return once the compiler is made or has failed to be (a failure is each constrained request's error)."""
        wait([self._compiler])

    def submit(self, spec: StructuredOutput) -> Future:
        """The compiled grammar of `spec` (a cached future when it was asked for before)."""
        future = self._cache.get(spec)
        if future is None:
            future = self._cache[spec] = self._pool.submit(self._compile, spec)
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec)
        return future

    def _compile(self, spec: StructuredOutput):
        compiler = self._compiler.result()
        try:
            grammar = _grammar(msgspec.structs.replace(spec, any_whitespace=False)
                               if self._disable_any_whitespace else spec)
            unproductive = unproductive_rules(str(grammar))
            if "root" in unproductive:        # another such rule is a branch no output can finish
                raise ValueError(f"Invalid {_NAMES[spec.kind]}: no output satisfies it: "
                                 f"{_never_ends(spec, unproductive)}")
            return compiler.compile_grammar(grammar)
        except RuntimeError as e:
            raise ValueError(f"Invalid {_NAMES[spec.kind]}: {_LOCATION.sub('', str(e).strip())}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex", "choice": "choice",
          "grammar": "grammar"}


def _never_ends(spec: StructuredOutput, rules: list[str]) -> str:
    if spec.kind == "json":
        return "every value must hold itself without end (a `$ref` cycle with no optional way out)."
    names = ", ".join(f"`{r}`" for r in rules[:5])
    return f"rule(s) {names} never end (each alternative needs a rule that never ends)."


def _grammar(spec: StructuredOutput):
    """xgrammar's Grammar of `spec`; a ValueError for a schema that admits nothing or reaches outside itself,
    a RuntimeError for one xgrammar refuses."""
    import xgrammar
    if spec.kind == "json":
        try:
            problem = schema_problem(json.loads(spec.spec))
        except (json.JSONDecodeError, RecursionError):
            problem = None            # xgrammar names the parse error; the gateway bounds the depth
        if problem is not None:
            raise ValueError(f"Invalid JSON schema: {problem}")
    if spec.kind in ("json", "json_object"):
        schema = spec.spec if spec.kind == "json" else '{"type": "object"}'
        return xgrammar.Grammar.from_ebnf(json_schema_ebnf(schema, spec.any_whitespace))
    if spec.kind == "regex":
        return xgrammar.Grammar.from_regex(spec.spec)
    if spec.kind == "choice":
        return xgrammar.Grammar.from_ebnf(choice_grammar(json.loads(spec.spec)))
    if spec.kind == "grammar":
        return xgrammar.Grammar.from_ebnf(spec.spec)
    raise ValueError(f"Unknown structured output kind {spec.kind!r}.")


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose sentences are exactly `choices`: ["yes", "no"] -> root ::= "yes" | "no"."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


# xgrammar (<= 0.2.8, mlc-ai/xgrammar#800) lowers a string with minLength/maxLength to a repetition of this class,
# which admits the raw control characters U+0000-U+001F that JSON strings forbid (json.loads refuses the output);
# its unbounded strings use the second. EBNF string literals and character classes are matched whole, so only a
# class of the grammar itself is rewritten, never text inside a literal (an enum value, a pattern).
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'
_EBNF_LITERAL_OR_CLASS = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]')


def json_schema_ebnf(schema: str, any_whitespace: bool) -> str:
    """xgrammar's grammar of `schema` (as compile_json_schema builds it) as EBNF, with the characters of its
    length-bounded strings limited to those JSON allows unescaped."""
    import xgrammar
    ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=any_whitespace))
    return _EBNF_LITERAL_OR_CLASS.sub(
        lambda m: _JSON_STRING_CHAR if m.group() == _BOUNDED_STRING_CHAR else m.group(), ebnf)


def _make_compiler(tokenizer_path: str, vocab_size: int, stop_token_ids: list[int]):
    import xgrammar
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    logger.info("grammar compiler ready (%s vocabulary of %d tokens)", info.vocab_type.name, vocab_size)
    return xgrammar.GrammarCompiler(info, max_threads=COMPILE_THREADS)
