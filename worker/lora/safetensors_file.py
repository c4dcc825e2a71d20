"""adapter_model.safetensors read with plain file I/O: the header is JSON, the data one buffer that a single
`split` cuts into every tensor's bytes. Reads run on reader threads beside a busy step loop, and every tensor
operation releases and retakes the GIL, so the reading path makes a handful of them, not one per tensor.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from worker.lora.errors import AdapterError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def tensor_file(path: str | Path) -> Path:
    """The adapter's adapter_model.safetensors; AdapterError (404) when it is missing."""
    path = Path(path)
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        if (path / "adapter_model.bin").is_file():
            raise AdapterError(f"{path} holds adapter_model.bin; only adapter_model.safetensors is supported")
        raise AdapterError(f"No adapter found at {path}: adapter_model.safetensors is missing", status_code=404)
    return file


def read_header(path: Path) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], int]:
    """key -> (dtype, shape, begin, end) of adapter_model.safetensors (byte offsets into its data
    section), and the file offset where that section starts."""
    return parse_header(*read_header_bytes(path), path)


def read_header_bytes(path: Path) -> tuple[bytes, int]:
    """adapter_model.safetensors' JSON header as stored, and the size of the data section after it."""
    file = tensor_file(path)
    try:
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            size = f.seek(0, 2) - 8 - length
            if size < 0:
                raise ValueError(f"a header of {length} bytes does not fit the file")
            f.seek(8)
            raw = f.read(length)
    except (OSError, ValueError) as e:
        raise AdapterError(f"adapter_model.safetensors in {path} is unreadable: {e!r}") from e
    return raw, size


def parse_header(raw: bytes, size: int, path: Path) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]],
                                                             int]:
    """read_header's answer from read_header_bytes'."""
    try:
        entries = json.loads(raw)
        header = {}
        for key, entry in entries.items():
            if key == "__metadata__":
                continue
            if entry["dtype"] not in DTYPES:
                raise ValueError(f"tensor {key!r} is {entry['dtype']}; LoRA weights must be F32, F16 or BF16")
            dtype, shape, (begin, end) = DTYPES[entry["dtype"]], tuple(entry["shape"]), entry["data_offsets"]
            if not 0 <= begin <= end <= size or end - begin != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"tensor {key!r} lies outside the data or does not match its shape")
            header[key] = (dtype, shape, begin, end)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise AdapterError(f"adapter_model.safetensors in {path} is unreadable: {e!r}") from e
    return header, 8 + len(raw)


def read_data(path: Path, start: int) -> torch.Tensor:
    """The data section of adapter_model.safetensors: [bytes] uint8, read in one call."""
    try:
        with open(tensor_file(path), "rb") as f:
            data = torch.empty(f.seek(0, 2) - start, dtype=torch.uint8)
            f.seek(start)
            if f.readinto(data.numpy()) != len(data):
                raise OSError("the file ended early")
    except OSError as e:
        raise AdapterError(f"adapter_model.safetensors in {path} is unreadable: {e!r}") from e
    return data


def tensor_bytes(header: dict, data: torch.Tensor, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor's bytes converted to `dtype`, as views of one buffer cut by one split.

    The whole data section is converted at once when its tensors share a dtype, so byte offsets scale
    by the ratio of item sizes: tensors [A: F32 0..16, B: F32 16..48] as BF16 sit at [0..8, 8..24].
    """
    sources = {entry[0] for entry in header.values()}
    if len(sources) > 1:       # a file mixing dtypes: convert tensor by tensor
        return {key: data[begin:end].clone().view(src).to(dtype).view(torch.uint8)   # clone: aligned
                for key, (src, _, begin, end) in header.items()}
    scale = 1.0
    if sources and sources != {dtype}:
        (src,) = sources
        used = max(end for *_, end in header.values())
        data, scale = data[:used].view(src).to(dtype).view(torch.uint8), dtype.itemsize / src.itemsize
    order = sorted(header, key=lambda key: header[key][2])
    cuts, pieces, offset = [], {}, 0
    for key in order:
        begin, end = int(header[key][2] * scale), int(header[key][3] * scale)
        if begin > offset:
            cuts.append(begin - offset)       # a gap between tensors
        pieces[key] = len(cuts)
        cuts.append(end - begin)
        offset = end
    cuts.append(len(data) - offset)
    parts = data.split(cuts)
    return {key: parts[i] for key, i in pieces.items()}
