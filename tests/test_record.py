"""The record speaks to users: current figures with their command, commit and GPU, history in git.

No tracked text file names a stage of the project's development (a session, a round, a labelled run); BENCHMARKS.md
stays one page; the result files it and the README name exist, and bench/results holds only those, named by
date, GPU and benchmark. (pytest's "session" scope and a "test session" name no development session.)
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".json", ".txt"}
MAX_BENCHMARKS_LINES = 300

# What names a stage of the project's own development rather than something a user runs.
DIARY = {
    "a numbered session": re.compile(r"\bsessions?[ _-]?\d+", re.IGNORECASE),
    "an ordinal session or round": re.compile(
        r"\b(first|second|third|next|previous|earlier|later|last) (development )?(session|round)\b", re.IGNORECASE),
    "a numbered round": re.compile(r"\brounds? \d+\b", re.IGNORECASE),
    "work counted in rounds": re.compile(r"\brounds? of (work|development)\b", re.IGNORECASE),
    "a lettered run": re.compile(r"\bruns? [A-Z]{1,2}\d?\b(?!/)"),
    "a lettered run in a name": re.compile(r"[_-]run[A-Z]{1,2}\d?\b"),
    "a numbered run": re.compile(r"\bruns? \d+\b(?!-)", re.IGNORECASE),
}
# bench/results/DATE-GPU-BENCHMARK.json
RESULT_NAME = re.compile(r"\d{4}-\d\d-\d\d-(h100|h200|2xh200|h200host|cpu)-[a-z0-9]+(-[a-z0-9]+)*\.json")
# a result file as BENCHMARKS.md and the README name it in backticks: a whole name, `...-tail.json` for a name
# given in full nearby, `{a,b}` for several, an upper-case word (`PRESET`) for a family
CITED = re.compile(r"`((?:bench/results/)?(?:\d{4}-\d\d-\d\d-|\.\.\.-)[^`\s]*\.json)`")


def tracked_text_files() -> list[Path]:
    """The text files git tracks; outside a git checkout, every such file not under a hidden or build folder."""
    try:
        names = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                               text=True).stdout.split("\0")
        paths = [ROOT / name for name in names if name]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in ROOT.rglob("*") if p.is_file() and not any(
            part.startswith(".") or part in ("__pycache__", "build", "dist") or part.endswith(".egg-info")
            for part in p.relative_to(ROOT).parts[:-1])]
    return sorted(p for p in paths if p.suffix in TEXT_SUFFIXES and p.is_file())


def diary_mentions(text: str) -> list[str]:
    return [f"{what}: {m.group(0)!r}" for what, pattern in DIARY.items() for m in pattern.finditer(text)]


def expand(cited: str) -> list[str]:
    """A cited name as the file-name patterns it stands for, each a regex over bench/results' file names."""
    name = cited.removeprefix("bench/results/")
    braces = re.search(r"\{([^}]*)\}", name)
    if braces:
        return [p for alt in braces.group(1).split(",")
                for p in expand(name[:braces.start()] + alt + name[braces.end():])]
    pattern = re.escape(name)
    pattern = re.sub(r"[A-Z]+", "[a-z0-9-]+", pattern)           # PRESET, RUN: a family of files
    if name.startswith("..."):
        pattern = ".*" + pattern[len(re.escape("...")):]
    return [pattern]


def cited_patterns(doc: Path) -> list[tuple[str, str]]:
    return [(cited, pattern) for cited in CITED.findall(doc.read_text(encoding="utf-8")) for pattern in expand(cited)]


def result_files() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir() if p.is_file())


def test_diary_patterns_catch_what_they_are_for_and_not_pytest_or_english():
    named = ["in " + "session" + " 17", "the " + "first" + " session", "(" + "run" + " BI,", "run" + " 5 (abc)",
             "round" + " 3 of", "lora_loading_r16_" + "run" + "G-h100.json", "tp-" + "session" + "18.json"]
    assert not [t for t in named if not diary_mentions(t)]
    plain = ['@pytest.fixture(scope="session")', "built in the test session", "the grouped GEMMs run 64-row tiles",
             "a top_p that rounds to 0", "round(t.item(), 2)", "interleaved rounds of --compare", "run A/B tests"]
    assert not [t for t in plain if diary_mentions(t)]


@pytest.mark.parametrize("path", tracked_text_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_tracked_file_names_a_development_session_round_or_run(path: Path):
    mentions = diary_mentions(str(path.relative_to(ROOT)))
    try:
        mentions += diary_mentions(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        pytest.skip("not text")
    assert not mentions, f"{path.relative_to(ROOT)} names the project's history (git keeps it): {mentions}"


def test_benchmarks_is_one_page():
    lines = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_BENCHMARKS_LINES, f"BENCHMARKS.md has {lines} lines; keep the current figures only"


@pytest.mark.parametrize("doc", ["BENCHMARKS.md", "README.md"])
def test_every_result_file_named_exists(doc: str):
    files = result_files()
    missing = [cited for cited, pattern in cited_patterns(ROOT / doc)
               if not any(re.fullmatch(pattern, f) for f in files)]
    assert not missing, f"{doc} names result files that bench/results lacks: {missing}"
    explicit = re.findall(r"bench/results/[\w.{},/-]+\.\w+", (ROOT / doc).read_text(encoding="utf-8"))
    assert not [p for p in explicit if not re.search(r"[A-Z{]", p) and not (ROOT / p).exists()]


def test_bench_results_holds_only_cited_files_named_by_date_gpu_and_benchmark():
    patterns = [pattern for _, pattern in cited_patterns(ROOT / "BENCHMARKS.md")]
    files = result_files()
    assert not [f for f in files if not RESULT_NAME.fullmatch(f)], "name results DATE-GPU-BENCHMARK.json"
    uncited = [f for f in files if not any(re.fullmatch(p, f) for p in patterns)]
    assert not uncited, f"bench/results files BENCHMARKS.md does not cite (git rm them): {uncited}"
