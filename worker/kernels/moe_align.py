"""Token -> expert grouping for the MoE grouped GEMMs (kernels/fused_moe.py): a counting sort of the flat rows
(row t*K + j chose expert topk_ids[t, j]) by expert, each expert's rows padded to whole BLOCK_M tiles.

Running example, E = 3, BLOCK_M = 4, flat expert ids [2, 0, 2, 2, 0] (5 rows):
    counts       [2, 0, 3]        padded [4, 0, 4]       expert_start [0, 4, 4]     total_padded 8
    sorted_rows  [1, 4, P, P, 0, 2, 3, P]               (P = num_rows: a pad slot, masked by the GEMM)
    block_expert [0, 2]                                  (one expert per BLOCK_M tile)

Three launches, all deterministic (no atomics; rows keep their flat order within an expert), graph safe
(grids from host ints only, every buffer in the workspace):
    1. per chunk of ROW_CHUNK rows: each row's rank among its chunk's rows of the same expert, and the
       chunk's histogram;
    2. one program: the exclusive prefix of the histograms over chunks, the padded expert offsets, the total;
    3. per chunk: scatter each row to expert_start[e] + its chunk's base + its rank; and per BLOCKS_PER_PROG
       tiles: each tile's expert and the pad slots of that tile.
"""
from __future__ import annotations

import triton
import triton.language as tl

ROW_CHUNK = 256          # rows per program of launches 1 and 3
BLOCKS_PER_PROG = 16     # BLOCK_M tiles per program of launch 3


def max_padded_rows(num_rows: int, num_experts: int, block_m: int) -> int:
    """The most slots sorted_rows can need: every used expert pads at most block_m - 1 rows."""
    return num_rows + min(num_experts, num_rows) * (block_m - 1)


def num_chunks(num_rows: int) -> int:
    return triton.cdiv(num_rows, ROW_CHUNK)


@triton.jit
def _chunk_rank_kernel(ids_ptr, rank_ptr, hist_ptr, num_rows, num_experts, ROWS: tl.constexpr,
                       BLOCK_E: tl.constexpr):
    """Semantics, chunk c = rows [c*ROWS, (c+1)*ROWS):
        rank[r] = #{r' in chunk c, r' < r : ids[r'] == ids[r]}
        hist[c, e] = #{r in chunk c : ids[r] == e}
    """
    c = tl.program_id(0)
    rows = c * ROWS + tl.arange(0, ROWS)                                    # [ROWS]
    valid = rows < num_rows
    ids = tl.load(ids_ptr + rows, mask=valid, other=0)
    experts = tl.arange(0, BLOCK_E)                                          # [BLOCK_E]
    onehot = ((ids[:, None] == experts[None, :]) & valid[:, None]).to(tl.int32)   # [ROWS, BLOCK_E]
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1            # [ROWS]
    tl.store(rank_ptr + rows, rank, mask=valid)
    tl.store(hist_ptr + c * num_experts + experts, tl.sum(onehot, axis=0), mask=experts < num_experts)


@triton.jit
def _expert_offsets_kernel(hist_ptr, chunk_base_ptr, start_ptr, count_ptr, total_ptr, n_chunks, num_experts,
                           BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr):
    """Semantics:
        chunk_base[c, e] = sum(hist[:c, e]);  count[e] = sum(hist[:, e])
        padded[e] = ceil(count[e] / BLOCK_M) * BLOCK_M;  start[e] = sum(padded[:e]);  total = sum(padded)
    """
    chunks = tl.arange(0, BLOCK_C)
    experts = tl.arange(0, BLOCK_E)
    mask = (chunks[:, None] < n_chunks) & (experts[None, :] < num_experts)
    offs = chunks[:, None] * num_experts + experts[None, :]                  # [BLOCK_C, BLOCK_E]
    hist = tl.load(hist_ptr + offs, mask=mask, other=0)
    tl.store(chunk_base_ptr + offs, tl.cumsum(hist, axis=0) - hist, mask=mask)
    count = tl.sum(hist, axis=0)                                             # [BLOCK_E]
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    e_mask = experts < num_experts
    tl.store(start_ptr + experts, ends - padded, mask=e_mask)
    tl.store(count_ptr + experts, count, mask=e_mask)
    tl.store(total_ptr, tl.sum(padded, axis=0))


@triton.jit
def _scatter_kernel(ids_ptr, rank_ptr, chunk_base_ptr, start_ptr, count_ptr, total_ptr, sorted_ptr,
                    block_expert_ptr, num_rows, num_experts, n_chunks, n_blocks, ROWS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCKS: tl.constexpr, BLOCK_E: tl.constexpr):
    """Semantics:
        sorted[start[e] + chunk_base[c, e] + rank[r]] = r         for each row r (chunk c, expert e = ids[r])
        block_expert[b] = the e with start[e] <= b*BLOCK_M < start[e] + padded[e]     for b*BLOCK_M < total
        sorted[p] = num_rows for the pad slots p in [start[e] + count[e], start[e] + padded[e])
    """
    pid = tl.program_id(0)
    if pid < n_chunks:
        rows = pid * ROWS + tl.arange(0, ROWS)
        valid = rows < num_rows
        e = tl.load(ids_ptr + rows, mask=valid, other=0)
        pos = (tl.load(start_ptr + e, mask=valid, other=0) + tl.load(rank_ptr + rows, mask=valid, other=0)
               + tl.load(chunk_base_ptr + pid * num_experts + e, mask=valid, other=0))
        tl.store(sorted_ptr + pos, rows, mask=valid)
    total = tl.load(total_ptr)
    blocks = pid * BLOCKS + tl.arange(0, BLOCKS)                             # [BLOCKS]
    b_valid = (blocks < n_blocks) & (blocks * BLOCK_M < total)
    experts = tl.arange(0, BLOCK_E)
    e_mask = experts < num_experts
    starts = tl.load(start_ptr + experts, mask=e_mask, other=0)
    count = tl.load(count_ptr + experts, mask=e_mask, other=0)
    # a tile's expert: the last expert with rows starting at or before the tile (empty experts pad nothing)
    owns = (starts[None, :] <= blocks[:, None] * BLOCK_M) & (count[None, :] > 0) & e_mask[None, :]
    block_e = tl.max(tl.where(owns, experts[None, :], -1), axis=1)           # [BLOCKS]
    tl.store(block_expert_ptr + blocks, block_e, mask=b_valid)
    e_start = tl.load(start_ptr + block_e, mask=b_valid, other=0)
    e_count = tl.load(count_ptr + block_e, mask=b_valid, other=0)
    slots = blocks[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]       # [BLOCKS, BLOCK_M]
    is_pad = (slots - e_start[:, None] >= e_count[:, None]) & b_valid[:, None]
    tl.store(sorted_ptr + slots, tl.zeros_like(slots) + num_rows, mask=is_pad)


def align_by_expert(flat_ids, num_rows: int, num_experts: int, block_m: int, ws) -> int:
    """Fill ws.sorted_rows, ws.block_expert and ws.total_padded (device) for the first num_rows flat ids
    (int32). Returns the host bound on the number of BLOCK_M tiles (the GEMM grid)."""
    n_chunks = num_chunks(num_rows)
    n_blocks = triton.cdiv(max_padded_rows(num_rows, num_experts, block_m), block_m)
    block_e = max(16, triton.next_power_of_2(num_experts))
    _chunk_rank_kernel[(n_chunks,)](flat_ids, ws.row_rank, ws.chunk_hist, num_rows, num_experts, ROWS=ROW_CHUNK,
                                    BLOCK_E=block_e, num_warps=4)
    _expert_offsets_kernel[(1,)](ws.chunk_hist, ws.chunk_base, ws.expert_start, ws.expert_count, ws.total_padded,
                                 n_chunks, num_experts, BLOCK_M=block_m,
                                 BLOCK_C=max(16, triton.next_power_of_2(n_chunks)), BLOCK_E=block_e, num_warps=4)
    grid = max(n_chunks, triton.cdiv(n_blocks, BLOCKS_PER_PROG))
    _scatter_kernel[(grid,)](flat_ids, ws.row_rank, ws.chunk_base, ws.expert_start, ws.expert_count,
                             ws.total_padded, ws.sorted_rows, ws.block_expert, num_rows, num_experts, n_chunks,
                             n_blocks, ROWS=ROW_CHUNK, BLOCK_M=block_m, BLOCKS=BLOCKS_PER_PROG, BLOCK_E=block_e,
                             num_warps=4)
    return n_blocks
