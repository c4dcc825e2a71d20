"""The demo corpus read from a standard library: which files, in which order, and what each slice holds."""
from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from worker.demo.corpus import QUESTIONS, read_corpus

UNLIMITED = 10**9
SHAPES = '''"""Shapes and their areas, for the examples of this module and nothing else."""


def area(width, height):
    """Return the area of a rectangle of the given width and height.

    Both sides are measured in the same unit, and the result is in that unit squared.

    >>> area(2, 3)
    6
    """
    return width * height


def _private(x):
    """Return x unchanged, a helper that callers outside this module never use."""
    return x
'''
LOOP = '''"""An event loop for the examples of this package."""


async def sleep_then(value):
    """Wait for the next turn of the loop, then return the value it was given."""
    return value
'''


@pytest.fixture
def stdlib(tmp_path) -> Path:
    """A small standard library: two modules, a package, and files the corpus must leave out."""
    (tmp_path / "shapes.py").write_text(SHAPES)
    (tmp_path / "asyncio").mkdir()
    (tmp_path / "asyncio" / "__init__.py").write_text(LOOP)
    (tmp_path / "café.py").write_text("x = 1\n")                       # an ASCII file whose name is not
    (tmp_path / "accents.py").write_text('NAME = "café"\n')            # not ASCII: left out
    (tmp_path / "test").mkdir()
    (tmp_path / "test" / "test_shapes.py").write_text("import shapes\n")   # test directories: left out
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "other.py").write_text("import os\n")
    return tmp_path


def path_order(*relative: str) -> list[str]:
    return sorted(relative, key=lambda p: hashlib.sha256(p.encode()).digest())


def test_base_holds_the_ascii_modules_in_the_order_of_their_paths_hashes(stdlib):
    corpus = read_corpus(UNLIMITED, UNLIMITED, stdlib)
    texts = {"shapes.py": SHAPES, "asyncio/__init__.py": LOOP, "café.py": "x = 1\n"}
    assert corpus.base == [texts[p] for p in path_order(*texts)]


def test_slices_hold_prose_examples_one_package_and_conversations(stdlib):
    """Each slice holds one document per file: its docstrings' paragraphs (the module's last, each wrapped at 79
    columns), doctests, or conversations."""
    slices = read_corpus(UNLIMITED, UNLIMITED, stdlib).slices
    by_file = {
        "shapes.py": "Return the area of a rectangle of the given width and height.\n\n"
                     "Both sides are measured in the same unit, and the result is in that unit\nsquared.\n\n"
                     "Return x unchanged, a helper that callers outside this module never use.\n\n"
                     "Shapes and their areas, for the examples of this module and nothing else.\n\n",
        "asyncio/__init__.py": "Wait for the next turn of the loop, then return the value it was given.\n\n"
                               "An event loop for the examples of this package.\n\n",
    }
    assert slices["docstrings"] == [by_file[p] for p in path_order(*by_file)]
    assert slices["doctests"] == [">>> area(2, 3)\n6\n\n"]
    assert slices["asyncio"] == [LOOP]

    def conversation(name: str, answer: str) -> str:   # the question is one of QUESTIONS, picked by the name's hash
        question = QUESTIONS[hashlib.sha256(name.encode()).digest()[0] % len(QUESTIONS)].format(name=name)
        return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>\n"

    by_file = {
        "shapes.py": conversation("shapes.area", "Return the area of a rectangle of the given width and height."),
        "asyncio/__init__.py": conversation(
            "asyncio.sleep_then", "Wait for the next turn of the loop, then return the value it was given."),
    }
    assert slices["chat"] == [by_file[p] for p in path_order(*by_file)]


def test_doctests_with_escapes_are_left_out(tmp_path):
    (tmp_path / "raw.py").write_text('def f():\n    r"""Bytes.\n\n    >>> f()\n    b\'\\x00\'\n    """\n')
    assert read_corpus(UNLIMITED, UNLIMITED, tmp_path).slices["doctests"] == []


def test_budgets_cut_the_last_document_at_a_line_end(stdlib):
    corpus = read_corpus(UNLIMITED, 60, stdlib)
    assert corpus.slices["asyncio"] == ['"""An event loop for the examples of this package."""\n\n\n']
    assert read_corpus(UNLIMITED, 10, stdlib).slices["asyncio"] == []   # not even its first line fits


def test_reading_twice_gives_the_same_corpus(stdlib):
    assert read_corpus(UNLIMITED, 200, stdlib) == read_corpus(UNLIMITED, 200, stdlib)
