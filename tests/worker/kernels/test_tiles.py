"""kernels/row_tiles.py: the tile lookup that lets prefill grids be sized by host bounds, against its reference;
and the host's tile map (row_tiles_host.host_tile_map), which the LoRA kernels read instead, against the same."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after TRITON_INTERPRET is set)
import triton.language as tl  # noqa: E402

from worker.kernels import row_tiles  # noqa: E402
from worker.kernels.row_tiles_host import host_tile_map, max_tiles  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def reference_tiles(indptr: list[int], num_groups: int, block: int, num_tiles: int) -> list[tuple[int, int]]:
    """Semantics of row_tiles.locate_tile for tiles 0..num_tiles-1: groups [indptr[i], indptr[i+1]) cut into
    block-row tiles, numbered group after group; (group, first row) of each tile, (-1, 0) past the last."""
    tiles = [(i, row) for i in range(num_groups) for row in range(indptr[i], indptr[i + 1], block)]
    return (tiles + [(-1, 0)] * num_tiles)[:num_tiles]


@triton.jit(do_not_specialize=["num_groups"])
def _locate_each_tile(indptr_ptr, out_ptr, num_groups, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """out[tile] = row_tiles.locate_tile's (group, first row) for tile = program_id(0)."""
    tile = tl.program_id(0)
    group, row0 = row_tiles.locate_tile(indptr_ptr, num_groups, tile, BLOCK, CHUNK)
    tl.store(out_ptr + 2 * tile, group)
    tl.store(out_ptr + 2 * tile + 1, row0)


def located_tiles(indptr: list[int], num_groups: int, block: int, num_tiles: int, chunk: int) -> list[tuple[int, int]]:
    """locate_tile's answers for tiles 0..num_tiles-1, one program each."""
    out = torch.empty(num_tiles, 2, dtype=torch.int32, device=DEVICE)
    _locate_each_tile[(num_tiles,)](torch.tensor(indptr, dtype=torch.int32, device=DEVICE), out, num_groups,
                                    BLOCK=block, CHUNK=chunk)
    return [tuple(t) for t in out.tolist()]


@pytest.mark.parametrize("lens,block,chunk", [
    ([3, 0, 17, 1, 1, 40], 16, 64),      # empty group, partial and whole tiles
    ([0, 0, 5], 4, 64),                  # leading empty groups
    ([1] * 70 + [33], 16, 64),           # two vector steps
    ([2, 9, 0, 4, 1, 16, 3], 4, 2),      # many steps of a small chunk, a group ending on a chunk edge
    ([64], 64, 64),                      # exactly one tile
], ids=["mixed", "leading-empty", "71-groups", "chunk-2", "one-tile"])
@pytest.mark.parametrize("pad_groups,pad_rows", [(0, 0), (3, 5)], ids=["exact", "graph-padded"])
def test_locate_tile_matches_reference(lens, block, chunk, pad_groups, pad_rows):
    indptr = [0]
    for n in lens:
        indptr.append(indptr[-1] + n)
    indptr += [indptr[-1]] * pad_groups                # padding groups are empty
    num_groups = len(lens) + pad_groups
    num_tiles = max_tiles(indptr[-1] + pad_rows, num_groups, block)
    assert num_tiles >= sum(-(-n // block) for n in lens)
    got = located_tiles(indptr, num_groups, block, num_tiles, chunk)
    assert got == reference_tiles(indptr, num_groups, block, num_tiles)


def test_host_tile_map_matches_the_kernels_search():
    """host_tile_map agrees with locate_tile's answers (reference_tiles) on segment mixes."""
    for lens in ([1] * 5, [17, 0, 3, 40], [0, 0, 16, 16, 1], [64, 1, 65]):
        indptr = [0]
        for n in lens:
            indptr.append(indptr[-1] + n)
        num_tiles = max_tiles(indptr[-1], len(lens), 16)
        expected = reference_tiles(indptr, len(lens), 16, num_tiles)
        assert host_tile_map(indptr, 16, num_tiles) == [v for tile in expected for v in tile]
