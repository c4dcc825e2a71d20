"""The grouped MoE-LoRA kernels' row sort (kernels/moe_lora.py, prefill): the flat (token, choice) rows counting-sorted
by key w*E + e (adapter slot w, expert e) into the workspace, each key's rows padded to whole BLOCK_M tiles, so a
program of the grouped shrink or expand walks one tile of one (slot, expert) pair and reads its A and B once.
Three launches, grids from host ints alone (CUDA-graph safe)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_SORT_BLOCK = 256           # rows per program of the sorting kernels


@triton.jit
def _row_keys(rows, token_lora_slots_ptr, topk_ids_ptr, num_rows, K, E):
    """(key = w*E + e, valid = row in range and w >= 0) of flat rows [BLOCK]."""
    in_range = rows < num_rows
    w = tl.load(token_lora_slots_ptr + rows // K, mask=in_range, other=-1)
    e = tl.load(topk_ids_ptr + rows, mask=in_range, other=0).to(tl.int32)
    return w * E + e, w >= 0


@triton.jit
def _count_rows_kernel(token_lora_slots_ptr, topk_ids_ptr, counts_ptr, row_pos_ptr, num_rows, K, E, BLOCK: tl.constexpr):
    """Semantics: for each flat row with w >= 0, key = w*E + e: row_pos[row] = counts[key]++ (atomically, so
    rows of one key are numbered 0, 1, ... in any order). counts must start at 0."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    key, valid = _row_keys(rows, token_lora_slots_ptr, topk_ids_ptr, num_rows, K, E)
    pos = tl.atomic_add(counts_ptr + key, 1, mask=valid)
    tl.store(row_pos_ptr + rows, pos, mask=valid)


@triton.jit
def _tile_starts_kernel(counts_ptr, tile_start_ptr, num_keys, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """Semantics: tile_start[key] = sum over keys k < key of cdiv(counts[k], BLOCK_M). One program."""
    offs = tl.arange(0, CHUNK)
    before = tl.full([], 0, tl.int32)       # tiles of the keys in earlier chunks
    for c0 in range(0, num_keys, CHUNK):
        ok = c0 + offs < num_keys
        n = (tl.load(counts_ptr + c0 + offs, mask=ok, other=0) + BLOCK_M - 1) // BLOCK_M
        end = before + tl.cumsum(n, 0)
        tl.store(tile_start_ptr + c0 + offs, end - n, mask=ok)
        before += tl.sum(n, 0)


@triton.jit
def _scatter_rows_kernel(token_lora_slots_ptr, topk_ids_ptr, tile_start_ptr, row_pos_ptr, sorted_rows_ptr, tile_key_ptr,
                         num_rows, K, E, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    """Semantics: for each flat row with w >= 0, key = w*E + e, p = tile_start[key]*BLOCK_M + row_pos[row]:
    sorted_rows[p] = row; tile_key[p // BLOCK_M] = key (written by the row that opens the tile).
    sorted_rows and tile_key must start at -1."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    key, valid = _row_keys(rows, token_lora_slots_ptr, topk_ids_ptr, num_rows, K, E)
    pos = tl.load(row_pos_ptr + rows, mask=valid, other=0)
    p = tl.load(tile_start_ptr + key, mask=valid, other=0) * BLOCK_M + pos
    tl.store(sorted_rows_ptr + p, rows, mask=valid)
    tl.store(tile_key_ptr + p // BLOCK_M, key, mask=valid & (pos % BLOCK_M == 0))


def sort_rows_by_key(token_lora_slots: torch.Tensor, topk_ids: torch.Tensor, ws, block_m: int, tiles: int) -> None:
    """Fill ws.sorted_rows[:tiles * block_m] (-1: padding) and ws.tile_key[:tiles] (-1: no tile) with the flat rows
    of adapted tokens sorted by key; `ws`: kernels/moe_lora.MoELoRAWorkspace (counts, row_pos, tile_start)."""
    num_rows, num_keys = topk_ids.numel(), ws.counts.numel()
    ws.counts.zero_()
    ws.sorted_rows[:tiles * block_m].fill_(-1)
    ws.tile_key[:tiles].fill_(-1)
    grid = (triton.cdiv(num_rows, _SORT_BLOCK),)
    k, e = topk_ids.shape[1], ws.num_experts
    _count_rows_kernel[grid](token_lora_slots, topk_ids, ws.counts, ws.row_pos, num_rows, k, e, BLOCK=_SORT_BLOCK)
    _tile_starts_kernel[(1,)](ws.counts, ws.tile_start, num_keys, BLOCK_M=block_m, CHUNK=1024)
    _scatter_rows_kernel[grid](token_lora_slots, topk_ids, ws.tile_start, ws.row_pos, ws.sorted_rows, ws.tile_key,
                               num_rows, k, e, BLOCK_M=block_m, BLOCK=_SORT_BLOCK)
