"""kernels/row_tiles.py: the tile lookup that lets prefill grids be sized by host bounds, against its reference."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from worker.kernels import reference  # noqa: E402  (after TRITON_INTERPRET is set)
from worker.kernels.row_tiles import max_tiles, tile_map  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("lens,block,chunk", [
    ([3, 0, 17, 1, 1, 40], 16, 64),      # empty group, partial and whole tiles
    ([0, 0, 5], 4, 64),                  # leading empty groups
    ([1] * 70 + [33], 16, 64),           # two vector steps
    ([2, 9, 0, 4, 1, 16, 3], 4, 2),      # many steps of a small chunk, a group ending on a chunk edge
    ([64], 64, 64),                      # exactly one tile
], ids=["mixed", "leading-empty", "71-groups", "chunk-2", "one-tile"])
@pytest.mark.parametrize("pad_groups,pad_rows", [(0, 0), (3, 5)], ids=["exact", "graph-padded"])
def test_tile_map_matches_reference(lens, block, chunk, pad_groups, pad_rows):
    indptr = [0]
    for n in lens:
        indptr.append(indptr[-1] + n)
    indptr += [indptr[-1]] * pad_groups                # padding groups are empty
    num_groups = len(lens) + pad_groups
    num_tiles = max_tiles(indptr[-1] + pad_rows, num_groups, block)
    assert num_tiles >= sum(-(-n // block) for n in lens)
    got = tile_map(torch.tensor(indptr, dtype=torch.int32, device=DEVICE), num_groups, block, num_tiles, chunk)
    assert [tuple(t) for t in got.tolist()] == reference.tile_map(indptr, num_groups, block, num_tiles)
