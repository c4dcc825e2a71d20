"""Row-tile arithmetic the host does for the kernels of kernels/row_tiles.py (pure Python: the input builder
imports it, and CPU installs have no Triton).

TILE_ROWS: the row tiles of a decode graph whose rows are grouped by adapter; the host writes their map
(host_tile_map) and the LoRA kernels read it instead of searching the segments.
"""
from __future__ import annotations

TILE_ROWS = 16


def max_tiles(num_rows: int, num_groups: int, block: int) -> int:
    """An upper bound on the tiles of any split of num_rows rows into num_groups groups:
    sum_i cdiv(n_i, block) <= sum_i (n_i / block + 1)."""
    return -(-num_rows // block) + num_groups


def host_tile_map(indptr: list[int], block: int, num_tiles: int) -> list[int]:
    """kernels/row_tiles.locate_tile's answers for tiles 0..num_tiles-1, flattened [g0, row0, g1, row1, ...] ((-1, 0)
    past the last tile). indptr [0, 3, 3, 20] with block 16: groups 0 and 2 have 1 and 2 tiles ->
    [0, 0, 2, 3, 2, 19, -1, 0, ...]."""
    out = []
    for g, (lo, hi) in enumerate(zip(indptr, indptr[1:])):
        for row0 in range(lo, hi, block):
            out += (g, row0)
    assert len(out) <= 2 * num_tiles, "more tiles than the grid has programs"
    return out + [-1, 0] * (num_tiles - len(out) // 2)
