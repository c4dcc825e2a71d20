"""The demo's training text, read from the Python standard library that every machine running loraplex has.

Files are chosen by a hash of their path inside the standard library, not by what a directory listing returns,
so that the choice is the same on every machine and, for files every Python version has, the same across
versions. Only ASCII files are read: a model that never saw a non-ASCII byte never writes half of a UTF-8
character, so its text decodes without replacement characters. Four slices train the adapters:
    docstrings   the prose of docstrings, one paragraph after another
    doctests     the interactive examples (`>>> ...` and their output) inside docstrings
    asyncio      the source of one package, `asyncio`
    chat         ChatML conversations: a question about a function, its docstring's summary as the answer
"""
from __future__ import annotations

import ast
import hashlib
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
                          "encodings", "pydoc_data", "lib2to3", "turtledemo", "__phello__"})
MAX_FILE_BYTES = 120_000       # larger files are generated tables or one module's long tail
SLICE_PACKAGE = "asyncio"
SLICES = ("docstrings", "doctests", SLICE_PACKAGE, "chat")
QUESTIONS = ("What does {name} do?", "Explain {name}.", "What is {name} for?", "Tell me about {name}.")
MAX_ANSWER_CHARS = 400


@dataclass(frozen=True)
class SourceFile:
    module: str         # dotted name: "json", "asyncio.tasks"
    text: str


@dataclass(frozen=True)
class Corpus:
    """The texts one build trains on: documents, one per source file."""
    base: list[str]                 # whole source files, for the base model
    slices: dict[str, list[str]]    # adapter slice name -> what it holds of each file


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def read_corpus(max_base_bytes: int, max_slice_bytes: int, root: Path | None = None) -> Corpus:
    """The base files (at most `max_base_bytes`) and each slice (at most `max_slice_bytes`), read in one pass that
    stops parsing files once every slice is full."""
    base = _Budget(max_base_bytes)
    slices = {name: _Budget(max_slice_bytes) for name in SLICES}
    for source in _source_files(root or stdlib_root()):
        base.add([source.text])
        if source.module.split(".")[0] == SLICE_PACKAGE:
            slices[SLICE_PACKAGE].add([source.text])
        if slices["docstrings"].full and slices["chat"].full and (slices["doctests"].full or ">>>" not in source.text):
            continue
        docstrings = list(_docstrings(source.text))
        for name, documents in (("docstrings", _docstring_paragraphs(docstrings)), ("doctests", _doctests(docstrings)),
                                ("chat", _conversations(source.module, docstrings))):
            slices[name].add(["".join(documents)] if documents else [])
    return Corpus(base.documents, {name: s.documents for name, s in slices.items()})


class _Budget:
    """Documents collected up to `max_bytes`, the last one cut at the end of a line."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.size, self.full = max_bytes, 0, False
        self.documents: list[str] = []

    def add(self, documents: list[str]) -> None:
        for document in documents:
            if self.full:
                return
            if self.size + len(document) > self.max_bytes:
                document = document[:document.rfind("\n", 0, self.max_bytes - self.size) + 1]
                self.full = True
                if not document:
                    return
            self.documents.append(document)
            self.size += len(document)


def _source_files(root: Path):
    """The ASCII modules of the standard library, in the order of their paths' hashes."""
    paths = [p for p in root.rglob("*.py") if not SKIPPED_DIRS.intersection(p.relative_to(root).parts[:-1])]
    for path in sorted(paths, key=lambda p: hashlib.sha256(p.relative_to(root).as_posix().encode()).digest()):
        raw = path.read_bytes()
        if len(raw) > MAX_FILE_BYTES or not raw.isascii():
            continue
        text = "\n".join(line.rstrip() for line in raw.decode("ascii").splitlines()).strip("\n") + "\n"
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield SourceFile(module, text)


def _docstrings(text: str):
    """(qualified name, docstring) of the module, classes and functions in `text`; none if it does not parse."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return
    stack = [("", tree)]
    while stack:
        prefix, node = stack.pop(0)
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if docstring := ast.get_docstring(child):
                    yield name, docstring
                if isinstance(child, ast.ClassDef):
                    stack.append((f"{name}.", child))
        if node is tree and (docstring := ast.get_docstring(tree)):
            yield "", docstring


def _docstring_paragraphs(docstrings: list[tuple[str, str]]) -> list[str]:
    """The prose paragraphs of `docstrings`, each re-wrapped at 79 columns; examples and lists left out."""
    paragraphs = []
    for _, docstring in docstrings:
        for paragraph in docstring.split("\n\n"):
            lines = paragraph.strip().splitlines()
            if len(lines) == 0 or any(line.startswith((" ", ">>>", "-", "*")) for line in lines):
                continue
            words = " ".join(lines).split()
            if len(words) >= 6 and words[0][:1].isupper():
                paragraphs.append(textwrap.fill(" ".join(words), 79) + "\n\n")
    return paragraphs


def _doctests(docstrings: list[tuple[str, str]]) -> list[str]:
    """The interactive examples in `docstrings`: runs of `>>>` and `...` lines with the output after them."""
    examples = []
    for _, docstring in docstrings:
        if ">>>" not in docstring:
            continue
        for block in textwrap.dedent(docstring).split("\n\n"):
            block = textwrap.dedent(block).strip("\n")
            if block.startswith(">>>") and "\\" not in block:   # escaped bytes teach runs of backslashes
                examples.append(block + "\n\n")
    return examples


def _conversations(module: str, docstrings: list[tuple[str, str]]) -> list[str]:
    """One ChatML conversation per public documented function or class of `module`: a question about it, its
    docstring's summary as the answer."""
    conversations = []
    for name, docstring in docstrings:
        if not name or any(part.startswith("_") for part in f"{module}.{name}".split(".")):
            continue
        answer = " ".join(docstring.split("\n\n")[0].split())
        if len(answer) < 20 or len(answer) > MAX_ANSWER_CHARS or ">>>" in answer:
            continue
        qualified = f"{module}.{name}"
        question = QUESTIONS[hashlib.sha256(qualified.encode()).digest()[0] % len(QUESTIONS)]
        conversations.append(f"<|im_start|>user\n{question.format(name=qualified)}<|im_end|>\n"
                             f"<|im_start|>assistant\n{answer}<|im_end|>\n")
    return conversations
