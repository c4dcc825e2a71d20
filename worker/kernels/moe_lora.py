"""LoRA on the experts of a sparse MoE block: two in-place hooks fused_moe calls (kernels/fused_moe.py).

Rows are FLAT by (token, choice): row t*K + j is token t's j-th chosen expert e = topk_ids[t, j], and its
adapter is w = token_lora_slots[t] (-1: base only, the row is not touched). With W = the step's MoELoRAWeights
and R = max_lora_rank:

    add_gate_up_lora:  for s in (gate 0, up 1), ea = 0 if W.shared_outer[w] else e:
        h[row, s*I:(s+1)*I] = round(h[row, s*I:(s+1)*I] + W.scalings[w, s] *
                                    (x[t] @ W.gate_up_a[w, ea, s*R:(s+1)*R].T) @ W.gate_up_b[w, e, s*I:(s+1)*I].T)
    add_down_lora:     eb = 0 if W.shared_outer[w] else e:
        y[row] = round(y[row] + W.scalings[w, 2] * (act[row] @ W.down_a[w, e].T) @ W.down_b[w, eb].T)

(float32 products, one rounding into h or y). Each hook is a shrink launch (xa = rows @ A^T into the
workspace, float32) and an expand launch (out += scaling * xa @ B^T). A shared-outer slot shrinks only the
rows of choice 0, once per token; its other rows read that token's xa.

Two strategies, chosen by the host-known row count T*K:
- per row (decode): one program per (row, slice, rank tile) in the shrink and per (row, column tile) in the
  expand, GEMVs without tensor cores. A (slot, expert) pair's A and B are read once per row that uses it,
  i.e. about once at decode, where pairs rarely repeat.
- grouped (prefill): rows are counting-sorted by key w*E + e into workspace buffers, each key's rows
  padded to whole BLOCK_M tiles; programs walk the tiles with tl.dot, reading A and B once per tile.

Grids depend only on host ints (T, K, E, R, max_rank, num_slots), no host-device syncs, no allocations:
a CUDA graph captured once replays any adapter mix and any routing.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from worker.lora.weights import MoELoRAWeights
from worker.kernels import pdl
from worker.kernels.lora_shrink import _tile_matmul
from worker.kernels.moe_lora_sort import sort_rows_by_key

GROUPED_MIN_ROWS = 512      # T*K from which the grouped (sorted, tl.dot) kernels run
_BLOCKS_M = (16, 64)        # the grouped kernels' row tiles; the workspace is sized for each


@dataclass
class MoELoRAStep:
    """What the MoE-LoRA kernels read in one step."""
    weights: MoELoRAWeights        # one layer's (worker/batch.py)
    token_lora_slots: torch.Tensor      # [T] int32, -1 = no adapter
    ranks: torch.Tensor            # [S] int32, each slot's rank (0 = empty)
    max_rank: int                  # host int: the largest rank among this step's slots (grids use it; not 0)
    workspace: MoELoRAWorkspace


def _max_tiles(num_rows: int, num_keys: int, block_m: int) -> int:
    """Tiles of any grouping of num_rows rows into num_keys keys, each key padded to whole block_m tiles:
    every non-empty key adds at most one partial tile, and at most min(num_rows, num_keys) are non-empty."""
    return triton.cdiv(num_rows, block_m) + min(num_rows, num_keys)


def _grouping_sizes(num_rows: int, num_keys: int) -> tuple[int, int]:
    """(tile_key, sorted_rows) lengths that fit the grouping at every row tile of _BLOCKS_M."""
    return (max(_max_tiles(num_rows, num_keys, b) for b in _BLOCKS_M),
            max(_max_tiles(num_rows, num_keys, b) * b for b in _BLOCKS_M))


class MoELoRAWorkspace:
    """Intermediates (xa buffers, the grouping by (slot, expert)) allocated once at startup, shared by all
    layers. Running example of the grouping, BLOCK_M = 2, E = 4, rows with keys w*E + e
    [5, 1, 5, 5, -, 1] (row 4 base only): counts[1] = 2, counts[5] = 3; key 1 takes tile 0, key 5 tiles 1-2:
    tile_start[1] = 0, tile_start[5] = 1; sorted_rows = [1, 5, 0, 2, 3, -1], tile_key = [1, 5, 5]
    (rows in a key's tiles in any order: atomics number them)."""

    def __init__(self, max_tokens: int, num_experts: int, top_k: int, max_rank: int, num_slots: int, device):
        rows, keys = max_tokens * top_k, num_slots * num_experts
        tiles, padded_rows = _grouping_sizes(rows, keys)
        i32 = dict(dtype=torch.int32, device=device)
        self.max_tokens, self.num_experts, self.top_k, self.num_slots = max_tokens, num_experts, top_k, num_slots
        self.max_rank = max_rank
        self.xa = torch.empty(rows, 2 * max_rank, dtype=torch.float32, device=device)  # [rows, 2R]: x @ A^T
        self.counts = torch.empty(keys, **i32)                # [S*E] rows of each (slot, expert) key
        self.tile_start = torch.empty(keys, **i32)            # [S*E] first tile of each key
        self.row_pos = torch.empty(rows, **i32)               # [rows] each row's place among its key's rows
        self.sorted_rows = torch.empty(padded_rows, **i32)    # [tiles * BLOCK_M] flat rows; -1 padding
        self.tile_key = torch.empty(tiles, **i32)             # [tiles] key of each tile; -1 past the last

    @staticmethod
    def num_bytes(max_tokens, num_experts, top_k, max_rank, num_slots) -> int:
        rows, keys = max_tokens * top_k, num_slots * num_experts
        tiles, padded_rows = _grouping_sizes(rows, keys)
        return 4 * (rows * 2 * max_rank + 2 * keys + rows + tiles + padded_rows)


@triton.jit
def _tile_rows(tile, token_lora_slots_ptr, topk_ids_ptr, sorted_rows_ptr, tile_key_ptr, K, E,
               GROUPED: tl.constexpr, BLOCK_M: tl.constexpr):
    """Semantics: the flat rows a program owns, their slot w and expert e (one pair per tile).
    Per row: rows = [tile], w = token_lora_slots[tile // K], e = topk_ids.flat[tile].
    GROUPED: rows = sorted_rows[tile*BLOCK_M : (tile+1)*BLOCK_M] (-1: padding), w, e = divmod(tile_key[tile], E).
    Returns (rows [BLOCK_M] int32, valid [BLOCK_M], w, e); w < 0: nothing to do."""
    if GROUPED:
        key = tl.load(tile_key_ptr + tile)
        rows = tl.load(sorted_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        w = tl.where(key >= 0, key // E, -1)
        e = tl.where(key >= 0, key % E, 0)
        valid = rows >= 0
    else:
        w = tl.load(token_lora_slots_ptr + tile // K)
        e = tl.load(topk_ids_ptr + tile).to(tl.int32)
        rows = tile + tl.arange(0, BLOCK_M)
        valid = rows == tile
    return rows, valid, w, e


@triton.jit
def _shrink_kernel(
        src_ptr, a_ptr, xa_ptr, token_lora_slots_ptr, topk_ids_ptr, ranks_ptr, shared_ptr, sorted_rows_ptr, tile_key_ptr,
        in_dim, K, E, stride_src, stride_aw, stride_ae, stride_ar, stride_xa, stride_shared,
        GATE_UP: tl.constexpr, MAX_RANK: tl.constexpr, GROUPED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Semantics: for each owned row (t, j) with w >= 0, slice s = program_id(1), r < ranks[w] in the rank tile:
        GATE_UP: src = x[t], A = gate_up_a[w, 0 if shared_outer[w] else e, s*R + r]; shared-outer rows with
                 j > 0 are skipped (their token's choice-0 row holds the xa)
        else:    src = act[row], A = down_a[w, e, r]
        xa[row, s*R + r] = src @ A   (float32; entries past the rank are not written)
    Program (tile, slice, rank tile). PDL: kernels/pdl.py (the per-row shrink of kernels/moe_gemv.py's chain)."""
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    tile, s = tl.program_id(0), tl.program_id(1)
    rows, valid, w, e = _tile_rows(tile, token_lora_slots_ptr, topk_ids_ptr, sorted_rows_ptr, tile_key_ptr, K, E,
                                   GROUPED, BLOCK_M)
    if w < 0:
        return
    rank = tl.load(ranks_ptr + w)
    r0 = tl.program_id(2) * BLOCK_R
    if r0 >= rank:
        return
    if GATE_UP:
        shared = tl.load(shared_ptr + w.to(tl.int64) * stride_shared)
        ea = tl.where(shared != 0, 0, e)
        valid = valid & ((rows % K == 0) | (shared == 0))
        src_rows = rows // K
    else:
        ea = e
        src_rows = rows
    offs_r = r0 + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    mask_r = offs_r < rank
    # src_ptrs: [BLOCK_M, BLOCK_K]; a_ptrs: [BLOCK_K, BLOCK_R] (A rows read transposed)
    src_ptrs = src_ptr + tl.maximum(src_rows, 0).to(tl.int64)[:, None] * stride_src + offs_k[None, :]
    a_ptrs = (a_ptr + w.to(tl.int64) * stride_aw + ea.to(tl.int64) * stride_ae
              + (s * MAX_RANK + offs_r)[None, :] * stride_ar + offs_k[:, None])
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_dim, BLOCK_K):
        mask_k = offs_k < in_dim - k0
        src = tl.load(src_ptrs, mask=valid[:, None] & mask_k[None, :], other=0.0)
        a = tl.load(a_ptrs, mask=mask_k[:, None] & mask_r[None, :], other=0.0)
        acc += _tile_matmul(src, a, BLOCK_M >= 16)
        src_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    xa_ptrs = xa_ptr + tl.maximum(rows, 0).to(tl.int64)[:, None] * stride_xa + (s * MAX_RANK + offs_r)[None, :]
    tl.store(xa_ptrs, acc, mask=valid[:, None] & mask_r[None, :])


@triton.jit
def _expand_kernel(
        out_ptr, xa_ptr, b_ptr, scalings_ptr, token_lora_slots_ptr, topk_ids_ptr, ranks_ptr, shared_ptr,
        sorted_rows_ptr, tile_key_ptr,
        slice_width, K, E, stride_out, stride_xa, stride_bw, stride_be, stride_bo, stride_sw, stride_shared,
        GATE_UP: tl.constexpr, NUM_SLICES: tl.constexpr, MAX_RANK: tl.constexpr, SCALING0: tl.constexpr,
        GROUPED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """Semantics: for each owned row (t, j) with w >= 0, output columns o of the column tile, slice s = o // width:
        GATE_UP: xa_row = t*K if shared_outer[w] else row, B = gate_up_b[w, e]
        else:    xa_row = row, B = down_b[w, 0 if shared_outer[w] else e]
        out[row, o] = round(out[row, o] + scalings[w, SCALING0 + s] *
                            sum(xa[xa_row, s*R + r] * B[o, r] for r < ranks[w]))
    Slices whose scaling is 0 add nothing. Program (tile, column tile)."""
    tile = tl.program_id(0)
    rows, valid, w, e = _tile_rows(tile, token_lora_slots_ptr, topk_ids_ptr, sorted_rows_ptr, tile_key_ptr, K, E,
                                   GROUPED, BLOCK_M)
    if w < 0:
        return
    rank = tl.load(ranks_ptr + w)
    if rank == 0:
        return
    shared = tl.load(shared_ptr + w.to(tl.int64) * stride_shared) != 0
    if GATE_UP:
        eb = e
        xa_rows = tl.where(shared, rows - rows % K, rows)
    else:
        eb = tl.where(shared, 0, e)
        xa_rows = rows
    n0 = tl.program_id(1) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    b_pair_ptr = b_ptr + w.to(tl.int64) * stride_bw + eb.to(tl.int64) * stride_be
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(NUM_SLICES):
        lo = s * slice_width
        scaling = tl.load(scalings_ptr + w.to(tl.int64) * stride_sw + SCALING0 + s)
        if (n0 < lo + slice_width) & (n0 + BLOCK_N > lo) & (scaling != 0):
            mask_n = (offs_n >= lo) & (offs_n < lo + slice_width)
            # xa_ptrs: [BLOCK_M, BLOCK_R]; b_ptrs: [BLOCK_R, BLOCK_N] (B rows read transposed)
            xa_ptrs = (xa_ptr + tl.maximum(xa_rows, 0).to(tl.int64)[:, None] * stride_xa
                       + s * MAX_RANK + offs_r[None, :])
            b_ptrs = b_pair_ptr + offs_n[None, :] * stride_bo + offs_r[:, None]
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                mask_r = offs_r < rank - r0
                xa = tl.load(xa_ptrs, mask=valid[:, None] & mask_r[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=mask_r[:, None] & mask_n[None, :], other=0.0)
                if BLOCK_M >= 16:
                    xa = xa.to(b_ptr.dtype.element_ty)     # tensor cores take the weights' dtype
                acc += _tile_matmul(xa, b, BLOCK_M >= 16)
                xa_ptrs += BLOCK_R
                b_ptrs += BLOCK_R
            delta += acc * scaling
    out_ptrs = out_ptr + tl.maximum(rows, 0).to(tl.int64)[:, None] * stride_out + offs_n[None, :]
    mask = valid[:, None] & (offs_n < NUM_SLICES * slice_width)[None, :]
    out = tl.load(out_ptrs, mask=mask, other=0.0).to(tl.float32) + delta
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _group_rows(topk_ids: torch.Tensor, lora: MoELoRAStep, block_m: int) -> int:
    """Sort the flat rows by (slot, expert) into the workspace, padded to block_m-row tiles; -> grid tiles."""
    ws, num_rows = lora.workspace, topk_ids.numel()
    tiles = _max_tiles(num_rows, ws.counts.numel(), block_m)
    assert tiles <= ws.tile_key.numel() and tiles * block_m <= ws.sorted_rows.numel()
    sort_rows_by_key(lora.token_lora_slots, topk_ids, ws, block_m, tiles)
    return tiles


def _grouped_block_m(num_rows: int, num_experts: int) -> int:
    """Row tile of the grouped kernels: 64 when an expert averages 64 rows or more, else 16."""
    return 64 if num_rows >= 64 * num_experts else 16


def _layout(topk_ids: torch.Tensor, lora: MoELoRAStep, grouped: bool | None) -> tuple[dict, int]:
    """(the kernels' row-layout arguments, number of tiles of the grid's first axis)."""
    ws, num_rows = lora.workspace, topk_ids.numel()
    assert topk_ids.is_contiguous() and topk_ids.shape[0] == lora.token_lora_slots.shape[0]
    assert num_rows <= ws.xa.shape[0], f"{num_rows} MoE rows exceed the workspace's {ws.xa.shape[0]}"
    assert lora.max_rank > 0, "max_rank 0: skip the MoE-LoRA hooks when no slot of the step is adapted"
    assert lora.weights.down_a.shape[2] == ws.max_rank, "the workspace's max_rank must be the slots' R"
    if grouped is None:
        grouped = num_rows >= GROUPED_MIN_ROWS
    if not grouped:
        return dict(GROUPED=False, BLOCK_M=1), num_rows
    block_m = _grouped_block_m(num_rows, ws.num_experts)
    return dict(GROUPED=True, BLOCK_M=block_m), _group_rows(topk_ids, lora, block_m)


@functools.lru_cache(maxsize=None)     # called per launch; eager steps are bound by host time
def _shrink_config(max_rank: int, in_dim: int, grouped: bool) -> dict:
    """Per row: the dense decode shrink's tuned GEMV (kernels/lora_shrink.default_config, one token per
    segment): 2 rank rows per program over long K steps, parallelism from the rank axis. Grouped: tl.dot
    tiles over the whole rank (up to 64) in K steps of 64."""
    k_cap = max(16, triton.next_power_of_2(in_dim))
    if not grouped:
        return dict(BLOCK_R=2, BLOCK_K=min(2048, k_cap), num_warps=4, num_stages=3)
    return dict(BLOCK_R=_grouped_rank_tile(max_rank), BLOCK_K=min(64, k_cap), num_warps=4, num_stages=3)


def _grouped_rank_tile(max_rank: int) -> int:
    return min(64, max(16, triton.next_power_of_2(max_rank)))


def _shrink(src, a, topk_ids, lora: MoELoRAStep, layout: dict, tiles: int, gate_up: bool, launch=None) -> None:
    """xa of every owned row into lora.workspace.xa (module docstring); launch: pdl.launch_options or None."""
    ws, w = lora.workspace, lora.weights
    num_slices, in_dim = (2, a.shape[3]) if gate_up else (1, a.shape[3])
    cfg = _shrink_config(lora.max_rank, in_dim, layout["GROUPED"])
    assert src.stride(1) == 1 and a.stride(3) == 1
    grid = (tiles, num_slices, triton.cdiv(lora.max_rank, cfg["BLOCK_R"]))
    _shrink_kernel[grid](
        src, a, ws.xa, lora.token_lora_slots, topk_ids, lora.ranks, w.shared_outer, ws.sorted_rows, ws.tile_key,
        in_dim, topk_ids.shape[1], ws.num_experts, src.stride(0), a.stride(0), a.stride(1), a.stride(2),
        ws.xa.stride(0), w.shared_outer.stride(0),
        GATE_UP=gate_up, MAX_RANK=ws.max_rank, **cfg, **layout, **(launch or {}))


def shrink_rows(src: torch.Tensor, topk_ids: torch.Tensor, lora: MoELoRAStep, gate_up: bool,
                programmatic_launch: bool = True) -> None:
    """The per-row shrink alone, for kernels/moe_gemv.py, whose GEMVs expand: xa of every row into
    lora.workspace.xa; src: x [T, H] (gate_up) or act [T*K, I] (down)."""
    layout, tiles = _layout(topk_ids, lora, grouped=False)
    a = lora.weights.gate_up_a if gate_up else lora.weights.down_a
    _shrink(src, a, topk_ids, lora, layout, tiles, gate_up, pdl.launch_options(src.device, programmatic_launch))


def _expand(out, b, topk_ids, lora: MoELoRAStep, layout: dict, tiles: int, gate_up: bool) -> None:
    """out += scaling * xa @ B^T on every owned row (module docstring)."""
    ws, w = lora.workspace, lora.weights
    num_slices, scaling0 = (2, 0) if gate_up else (1, 2)
    block_n = 64 if layout["GROUPED"] else 128
    block_r = _grouped_rank_tile(lora.max_rank) if layout["GROUPED"] else 16
    assert out.stride(1) == 1 and b.stride(3) == 1 and w.scalings.stride(1) == 1
    grid = (tiles, triton.cdiv(out.shape[1], block_n))
    _expand_kernel[grid](
        out, ws.xa, b, w.scalings, lora.token_lora_slots, topk_ids, lora.ranks, w.shared_outer, ws.sorted_rows,
        ws.tile_key, out.shape[1] // num_slices, topk_ids.shape[1], ws.num_experts, out.stride(0), ws.xa.stride(0),
        b.stride(0), b.stride(1), b.stride(2), w.scalings.stride(0), w.shared_outer.stride(0),
        GATE_UP=gate_up, NUM_SLICES=num_slices, MAX_RANK=ws.max_rank, SCALING0=scaling0, BLOCK_N=block_n,
        BLOCK_R=block_r, num_warps=4 if layout["BLOCK_M"] < 64 else 8, **layout)


def add_gate_up_lora(h: torch.Tensor, x: torch.Tensor, topk_ids: torch.Tensor, lora: MoELoRAStep,
                     grouped: bool | None = None) -> None:
    """h += the gate and up deltas of every row's adapter, in place (module docstring); no host-device sync.

    h: [T*K, 2I] (x.dtype); x: [T, H]; topk_ids: [T, K] int32 (contiguous). grouped: the strategy (None:
    grouped from GROUPED_MIN_ROWS rows on; the tests force each).
    """
    assert h.shape[0] == topk_ids.numel() and x.shape[0] == topk_ids.shape[0]
    layout, tiles = _layout(topk_ids, lora, grouped)
    _shrink(x, lora.weights.gate_up_a, topk_ids, lora, layout, tiles, gate_up=True)
    _expand(h, lora.weights.gate_up_b, topk_ids, lora, layout, tiles, gate_up=True)


def add_down_lora(y: torch.Tensor, act: torch.Tensor, topk_ids: torch.Tensor, lora: MoELoRAStep,
                  grouped: bool | None = None) -> None:
    """y += the down delta of every row's adapter, in place (module docstring); no host-device sync.

    y: [T*K, H] (before the routing weights); act: [T*K, I]; topk_ids: [T, K] int32 (contiguous).
    Regroups the rows itself (the grouping add_gate_up_lora left is not trusted to match topk_ids).
    """
    assert y.shape[0] == act.shape[0] == topk_ids.numel()
    layout, tiles = _layout(topk_ids, lora, grouped)
    _shrink(act, lora.weights.down_a, topk_ids, lora, layout, tiles, gate_up=False)
    _expand(y, lora.weights.down_b, topk_ids, lora, layout, tiles, gate_up=False)
