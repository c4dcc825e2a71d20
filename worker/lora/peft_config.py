"""adapter_config.json: reading it, and PEFT's scaling rule for one module (shared by lora/adapter.py and
lora/formats/experts.py)."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

from worker.lora.errors import AdapterError


def read_config(path: Path) -> dict:
    return parse_config(read_config_bytes(path), path)


def read_config_bytes(path: Path) -> bytes:
    """adapter_config.json as stored; AdapterError (404) when it or the directory is missing."""
    cfg_file = path / "adapter_config.json"
    if not path.is_dir():
        raise AdapterError(f"No adapter found at {path}: the directory does not exist", status_code=404)
    if not cfg_file.is_file():
        raise AdapterError(f"No adapter found at {path}: adapter_config.json is missing", status_code=404)
    try:
        return cfg_file.read_bytes()
    except OSError as e:
        raise AdapterError(f"adapter_config.json in {path} is unreadable: {e}") from e


def parse_config(raw: bytes, path: Path) -> dict:
    try:
        return json.loads(raw)
    except ValueError as e:
        raise AdapterError(f"adapter_config.json in {path} is unreadable: {e}") from e


def module_scaling(config: dict, module_key: str, rank: int) -> float:
    """PEFT's rule: alpha (alpha_pattern overrides lora_alpha) / r, or / sqrt(r) with use_rslora."""
    alpha = config.get("lora_alpha", 8)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module_key):
            alpha = value
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
