"""The demo's cache: a build published whole into its directory, reused while its key is current.

A build is staged in a sibling temporary directory whose last file is the marker; the directory is then renamed
into place in one step, so readers see either nothing or a complete build, and concurrent builders never mix
files. A directory holding a build with another key (an older loraplex, another size) is stale: the new build
replaces it the same way. Reusing a current build imports neither torch nor transformers.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from worker.demo.spec import ADAPTERS, BUILD_VERSION, FULL, SERVED_MODEL_NAME, DemoSize, build_key

logger = logging.getLogger(__name__)

MARKER = "loraplex-demo.json"


@dataclass(frozen=True)
class DemoAssets:
    model_dir: Path
    adapters: dict[str, Path]  # adapter name -> PEFT directory
    served_model_name: str = SERVED_MODEL_NAME

    def to_json(self) -> str:
        return json.dumps({
            "model_dir": str(self.model_dir),
            "adapters": {name: str(path) for name, path in self.adapters.items()},
            "served_model_name": self.served_model_name,
        })

    @classmethod
    def from_json(cls, text: str) -> DemoAssets:
        data = json.loads(text)
        adapters = {name: Path(path) for name, path in data["adapters"].items()}
        return cls(Path(data["model_dir"]), adapters, data["served_model_name"])


def default_cache_dir(size: DemoSize = FULL) -> Path:
    """$LORAPLEX_CACHE/demo-v2 (demo-v2-fast for the fast size), or the same under ~/.cache/loraplex."""
    root = os.environ.get("LORAPLEX_CACHE") or Path.home() / ".cache" / "loraplex"
    suffix = "" if size == FULL else f"-{size.name}"
    return Path(root).expanduser() / f"demo-v{BUILD_VERSION}{suffix}"


def build_demo(cache_dir: str | Path | None = None, size: DemoSize = FULL) -> DemoAssets:
    """The demo assets of `size` in `cache_dir`, built first unless a current build is already there."""
    root = Path(cache_dir).expanduser().absolute() if cache_dir else default_cache_dir(size)
    if is_complete(root, size):
        logger.info("reusing the demo build at %s", root)
    else:
        _check_replaceable(root)
        _build_atomically(root, size)
    return _assets(root)


def is_complete(root: Path, size: DemoSize = FULL) -> bool:
    """Whether `root` holds a finished build of `size` with the current key."""
    marker = _read_marker(root)
    return marker is not None and marker.get("key") == build_key(size)


def _read_marker(root: Path) -> dict | None:
    try:
        return json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _assets(root: Path) -> DemoAssets:
    adapters = {spec.name: root / "adapters" / spec.name for spec in ADAPTERS}
    return DemoAssets(root / "model", adapters)


def _check_replaceable(root: Path) -> None:
    if root.exists() and (not root.is_dir() or (any(root.iterdir()) and _read_marker(root) is None)):
        raise FileExistsError(
            f"{root} exists but is not a loraplex demo build; remove it or pass an empty or new --cache-dir")


def _build_atomically(root: Path, size: DemoSize) -> None:
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.building-", dir=root.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the published build is an ordinary directory
    try:
        started = time.perf_counter()
        _build_into(staging, root, size)
        marker = {"version": BUILD_VERSION, "key": build_key(size), "size": size.name,
                  "adapters": [spec.name for spec in ADAPTERS]}
        (staging / MARKER).write_text(json.dumps(marker))
        _publish(staging, root, size)
        logger.info("built the demo at %s in %.1f s", root, time.perf_counter() - started)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _build_into(staging: Path, final_root: Path, size: DemoSize) -> None:
    from worker.demo.build import build_into   # torch, transformers, peft: only when building
    build_into(staging, final_root, size)


def _publish(staging: Path, root: Path, size: DemoSize) -> None:
    """Rename `staging` to `root`; a stale build at `root` is moved aside first and removed after."""
    stale = None
    if _read_marker(root) is not None and not is_complete(root, size):
        stale = Path(tempfile.mkdtemp(prefix=f".{root.name}.stale-", dir=root.parent))
        try:
            os.rename(root, stale / "build")
        except FileNotFoundError:
            pass  # another builder moved it first
    try:
        os.rename(staging, root)  # atomic; replaces `root` only when it is an empty directory
    except OSError:
        if not is_complete(root, size):
            raise
        logger.info("another builder completed %s first; using its build", root)
    finally:
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)
