"""The demo's cache: a build published whole, reused while current, replaced when stale; the CLI."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from worker.demo import ADAPTERS, FAST, FULL, MARKER, DemoAssets, build_demo, cache, default_cache_dir, is_complete
from worker.demo.spec import build_key

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> DemoAssets:
    root = tmp_path_factory.mktemp("cache") / "demo"
    root.mkdir()  # an existing empty directory is replaced by the build
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # the small model trains faster on one thread than on a shared, oversubscribed pair
    try:
        return build_demo(root, FAST)
    finally:
        torch.set_num_threads(threads)


def fake_build(staging: Path, final_root: Path, size) -> None:
    (staging / "model").mkdir()
    (staging / "model" / "config.json").write_text("{}")


def test_build_publishes_complete_layout(assets):
    root = assets.model_dir.parent
    assert is_complete(root, FAST) and not is_complete(root, FULL)
    assert sorted(p.name for p in root.parent.iterdir()) == [root.name]  # no staging left behind
    for name in ("config.json", "model.safetensors", "generation_config.json",
                 "tokenizer.json", "tokenizer_config.json"):
        assert (assets.model_dir / name).is_file()
    assert list(assets.adapters) == ["doctests", "chat", "asyncio", "docstrings"]
    for path in assets.adapters.values():
        assert (path / "adapter_config.json").is_file()
        assert (path / "adapter_model.safetensors").is_file()
    assert assets.served_model_name == "loraplex-demo"
    marker = json.loads((root / MARKER).read_text())
    assert marker == {"version": 2, "key": build_key(FAST), "size": "fast", "adapters": [a.name for a in ADAPTERS]}


def test_second_build_reuses_without_rebuilding(assets, monkeypatch):
    root = assets.model_dir.parent
    watched = (root / MARKER, assets.model_dir / "model.safetensors")
    before = {p: p.stat().st_mtime_ns for p in watched}

    def fail(*_):
        raise AssertionError("rebuilt a complete demo")

    monkeypatch.setattr(cache, "_build_into", fail)
    assert build_demo(root, FAST) == assets
    assert {p: p.stat().st_mtime_ns for p in before} == before


def test_a_stale_build_is_replaced(tmp_path, monkeypatch):
    root = tmp_path / "demo"
    (root / "model").mkdir(parents=True)
    (root / "model" / "old.bin").write_text("old")
    (root / MARKER).write_text(json.dumps({"version": 1}))   # an older loraplex's build
    monkeypatch.setattr(cache, "_build_into", fake_build)
    build_demo(root, FAST)
    assert is_complete(root, FAST)
    assert sorted(p.name for p in (root / "model").iterdir()) == ["config.json"]
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]   # neither the staging nor the stale build is left


def test_a_build_of_another_size_is_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(cache, "_build_into", fake_build)
    build_demo(tmp_path / "demo", FAST)
    built = []
    monkeypatch.setattr(cache, "_build_into", lambda staging, root, size: built.append(size) or fake_build(
        staging, root, size))
    build_demo(tmp_path / "demo", FULL)
    assert built == [FULL]
    assert is_complete(tmp_path / "demo", FULL)


def test_concurrent_builders_publish_one_build(tmp_path, monkeypatch):
    barrier = threading.Barrier(2, timeout=60)

    def build_then_wait(staging, final_root, size):  # both finish staging before either publishes
        fake_build(staging, final_root, size)
        barrier.wait()

    monkeypatch.setattr(cache, "_build_into", build_then_wait)
    root = tmp_path / "demo"
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(lambda _: build_demo(root, FAST), range(2))
    assert first == second
    assert is_complete(root, FAST)
    assert [p.name for p in tmp_path.iterdir()] == ["demo"]


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    def fail_midway(staging, final_root, size):
        (staging / "partial").write_text("x")
        raise RuntimeError("boom")

    monkeypatch.setattr(cache, "_build_into", fail_midway)
    with pytest.raises(RuntimeError, match="boom"):
        build_demo(tmp_path / "demo", FAST)
    assert list(tmp_path.iterdir()) == []


def test_build_refuses_foreign_nonempty_dir(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="not a loraplex demo build"):
        build_demo(tmp_path, FAST)
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]


@pytest.mark.parametrize("env, size, expected", [
    ("/srv/cache", FULL, Path("/srv/cache/demo-v2")),
    ("/srv/cache", FAST, Path("/srv/cache/demo-v2-fast")),
    (None, FULL, Path("/home/u/.cache/loraplex/demo-v2")),
])
def test_default_cache_dir(monkeypatch, env, size, expected):
    monkeypatch.setenv("HOME", "/home/u")
    if env is None:
        monkeypatch.delenv("LORAPLEX_CACHE", raising=False)
    else:
        monkeypatch.setenv("LORAPLEX_CACHE", env)
    assert default_cache_dir(size) == expected


def test_build_keys_differ_by_size():
    assert build_key(FULL) != build_key(FAST)


def test_cli_prints_paths_as_json(assets):
    result = subprocess.run(
        [sys.executable, "-m", "worker.demo", "--size", "fast", "--cache-dir", str(assets.model_dir.parent)],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True)
    assert DemoAssets.from_json(result.stdout) == assets


def test_reusing_a_build_does_not_import_torch(assets):
    code = ("import sys; from worker.demo import FAST, build_demo; "
            f"build_demo({str(assets.model_dir.parent)!r}, FAST); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True)
