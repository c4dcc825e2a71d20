"""Row tiles of variable-length groups, numbered group after group, for grids sized by host bounds alone.

A step's token rows fall into groups given by an indptr on the device: sequences for attention, adapter
segments for LoRA. Cut every group into BLOCK-row tiles (the last one of a group may be partial) and number
the tiles group after group; `locate_tile` finds a tile from its number. A launch of
`row_tiles_host.max_tiles(num_rows, num_groups, BLOCK)` programs then covers every tile whatever the group lengths (each
group adds at most one partial tile), so the grid depends only on the row and group counts: a CUDA graph
fixes them at capture (padding rows that belong to no group, padding groups that are empty) and one graph
serves any mix of prefill lengths. Programs past the last tile find no group and exit.
"""
from __future__ import annotations

import triton
import triton.language as tl

CHUNK = tl.constexpr(64)   # groups read per vector step (batches of up to 64 sequences take one); kernels read it


@triton.jit
def locate_tile(indptr_ptr, num_groups, tile, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Semantics: with n_i = cdiv(indptr[i+1] - indptr[i], BLOCK) tiles in group i (i < num_groups), tile
    number `tile` is tile j of group g, where sum_{i<g} n_i + j = tile and j < n_g; returns
    (g, indptr[g] + j * BLOCK), its group and first row, or (-1, 0) when tile >= sum_i n_i.
    Reads indptr[0 : num_groups + 1], CHUNK groups per step."""
    offs = tl.arange(0, CHUNK)
    group = tl.full([], -1, tl.int32)
    row0 = tl.full([], 0, tl.int32)
    before = tl.full([], 0, tl.int32)           # tiles of the groups in earlier chunks
    for c0 in range(0, num_groups, CHUNK):
        ok = c0 + offs < num_groups
        lo = tl.load(indptr_ptr + c0 + offs, mask=ok, other=0)
        hi = tl.load(indptr_ptr + c0 + offs + 1, mask=ok, other=0)
        n = tl.where(ok, (hi - lo + BLOCK - 1) // BLOCK, 0)
        end = before + tl.cumsum(n, 0)          # end: [CHUNK] tiles up to and including each group
        mine = (end - n <= tile) & (tile < end)  # at most one group of all holds the tile
        found = tl.sum(mine.to(tl.int32), 0) > 0
        group = tl.where(found, c0 + tl.sum(tl.where(mine, offs, 0), 0), group)
        row0 = tl.where(found, tl.sum(tl.where(mine, lo + (tile - (end - n)) * BLOCK, 0), 0), row0)
        before += tl.sum(n, 0)
    return group, row0


@triton.jit
def group_tile(indptr_ptr, num_groups, tile, FLAT: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Semantics: (g, first row, indptr[g + 1]) of the row tile a program owns, g = -1 when it owns none.
    FLAT: `tile` numbers all groups' tiles in turn (locate_tile); else the program owns tile `tile` of
    group program_id(1), if that group has one."""
    if FLAT:
        group, row0 = locate_tile(indptr_ptr, num_groups, tile, BLOCK, CHUNK)
        end = tl.load(indptr_ptr + tl.maximum(group, 0) + 1)
    else:
        group = tl.program_id(1)
        end = tl.load(indptr_ptr + group + 1)
        row0 = tl.load(indptr_ptr + group) + tile * BLOCK
        group = tl.where(row0 < end, group, -1)
    return group, row0, end


@triton.jit
def mapped_tile(tile_map_ptr, indptr_ptr, tile):
    """Semantics: group_tile's (g, first row, indptr[g + 1]) read from a tile map the host built
    (row_tiles_host.host_tile_map: tile_map[2 * tile], tile_map[2 * tile + 1] = g, first row; g = -1 past the
    last tile): no search."""
    group = tl.load(tile_map_ptr + 2 * tile)
    row0 = tl.load(tile_map_ptr + 2 * tile + 1)
    end = tl.load(indptr_ptr + tl.maximum(group, 0) + 1)
    return group, row0, end
