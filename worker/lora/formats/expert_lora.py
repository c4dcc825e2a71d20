"""Expert LoRA normalised: one MoE layer's LoRA on its experts' gate, up and down projections, as the expert
formats (lora/formats/experts.py) find it in an adapter's tensor file, and `materialise`, which reads one matrix.

Every format gives, for each projection, an A [n, r, in] and a B [n, out, r], n = num_experts, or 1 where one
matrix serves every expert; the stored tensors stay where they are in the file until a slot is packed
(lora/expert_layout.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from worker.lora.errors import AdapterError


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of adapter_model.safetensors: its dtype, stored shape and absolute byte range [begin, end)."""
    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    span: tuple[int, int]


@dataclass(frozen=True)
class ExpertMatrix:
    """One LoRA factor of one projection for all its experts, [n, rows, cols] once assembled.

    layout says how the stored tensors give it:
      "peft_a":     one [n*rows, cols] tensor; expert e is rows e*rows:(e+1)*rows
      "peft_b":     one [total, cols*n] tensor; expert e is rows row_offset:row_offset+rows, columns e::n
      "stacked":    one [n, rows, cols] tensor
      "per_expert": one [rows, cols] tensor per expert (None: that expert is not adapted, zeros)
    `part` (tensor parallelism, lora/shards.py): (dim, start, length), the rows (dim 1) or columns
    (dim 2) of the assembled [n, rows, cols] that one rank keeps; None: all of it. `shape` stays the stored one.
    """
    shape: tuple[int, int, int]
    layout: str
    sources: tuple[StoredTensor | None, ...]
    row_offset: int = 0
    part: tuple[int, int, int] | None = None


@dataclass(frozen=True)
class ExpertProjection:
    """LoRA on one projection of every expert of a layer: delta_e = scaling * b[e or 0] @ a[e or 0]."""
    a: ExpertMatrix              # [n_a, rank, in_features]
    b: ExpertMatrix              # [n_b, out_features, rank]
    rank: int
    scaling: float


@dataclass(frozen=True)
class ExpertLayerLoRA:
    """One MoE layer's expert LoRA, normalised; a projection the adapter leaves alone is None."""
    layer: int
    format: str                  # "target_parameters", "per_expert" or "stacked"
    gate: ExpertProjection | None
    up: ExpertProjection | None
    down: ExpertProjection | None

    @property
    def shared_outer(self) -> bool:
        """Whether the gate/up A's and the down B serve every expert (expert dimension 1)."""
        parts = [p.a for p in (self.gate, self.up) if p] + ([self.down.b] if self.down else [])
        return bool(parts) and all(m.shape[0] == 1 for m in parts)


def materialise(matrix: ExpertMatrix, file: Path) -> torch.Tensor:
    """Read one ExpertMatrix from the adapter's tensor file as float32 [n, rows, cols] (its `part` of them, when
    it has one: [n, length, cols] or [n, rows, length])."""
    whole = _assemble(matrix, file)
    return whole if matrix.part is None else whole.narrow(*matrix.part).contiguous()


def _assemble(matrix: ExpertMatrix, file: Path) -> torch.Tensor:
    """The whole [n, rows, cols] of one ExpertMatrix, float32."""
    n, rows, cols = matrix.shape
    if matrix.layout == "per_expert":
        out = torch.zeros(n, rows, cols)
        for e, source in enumerate(matrix.sources):
            if source is not None:
                out[e] = _read(file, source)
        return out
    t = _read(file, matrix.sources[0])
    if matrix.layout == "peft_a":
        return t.view(n, rows, cols)                       # [n*rows, cols] -> expert-major blocks of rows
    if matrix.layout == "peft_b":
        t = t[matrix.row_offset:matrix.row_offset + rows]  # [rows, cols*n]: column k*n + e is expert e's k
        return t.view(rows, cols, n).permute(2, 0, 1).contiguous()
    return t                                               # "stacked": [n, rows, cols] as stored


def _read(file: Path, tensor: StoredTensor) -> torch.Tensor:
    """One stored tensor as float32 in its stored shape."""
    begin, end = tensor.span
    with open(file, "rb") as f:
        f.seek(begin)
        raw = bytearray(f.read(end - begin))
    if len(raw) != end - begin:
        raise AdapterError(f"adapter tensor {tensor.key!r} lies past the end of {file}")
    return torch.frombuffer(raw, dtype=tensor.dtype).float().view(tensor.shape)
