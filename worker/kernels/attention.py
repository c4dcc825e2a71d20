"""Triton paged attention over the KV pool (prefill, extend and decode in one kernel) and the K/V store.

Every metadata tensor is read on the device; the launch grid depends only on host ints (num_seqs,
max_query_len, tensor shapes), so both functions are safe inside a CUDA graph and never sync. Batches
with a prefill (max_query_len > 1) launch one program per query tile of the whole batch (kernels/row_tiles.py),
however the tokens fall into sequences: a graph of a padded token count serves any such batch.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from worker.kernels import pdl
from worker.kernels.fused import as_stored
from worker.kernels.reference import KV_FP8_DTYPE
from worker.kernels.row_tiles import CHUNK, locate_tile
from worker.kernels.row_tiles_host import max_tiles

LOG2_E = 1.4426950408889634
MAX_KV_SPLITS = 16
MASKED: tl.constexpr = tl.constexpr(-1.0e30)  # initial running max: finite, so keyless rows never do inf - inf


@triton.jit
def _attend_key_tile(acc, m_i, l_i, q, q_pos, k_head, v_head, bt_row, start, kv_hi, offs_d, d_ok, scale_log2,
                     stride_c_block, stride_c_slot, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax step over key positions [start, start + BLOCK_N) (those < kv_hi), gathered through the
    block table row bt_row; CAUSAL masks keys past each row's q_pos. Returns the updated (acc, m_i, l_i)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = offs_n < kv_hi
    block = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    slot = block * stride_c_block + (offs_n % BLOCK_SIZE) * stride_c_slot           # slot: [BLOCK_N]
    k = tl.load(k_head + slot[None, :] + offs_d[:, None], mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    k = k.to(q.dtype)                                  # FP8 entries, exactly (a no-op for a cache in q's dtype)
    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2                  # s: [BLOCK_M, BLOCK_N]
    if CAUSAL:
        s = tl.where(n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    v = tl.load(v_head + slot[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
        block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, scale_log2, v_scale,
        stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_c_block, stride_c_slot, stride_c_head, stride_bt_seq, num_heads, num_seqs,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        FLAT: tl.constexpr, CHUNK: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
        PDL: tl.constexpr):
    """Semantics: program (i, g, t * NUM_SPLITS + s) handles query tokens [t*BLOCK_Q, (t+1)*BLOCK_Q) of
    sequence i, all GROUP query heads h of KV head g, and split s of the keys they see (FLAT, one split:
    program (p, g, 0) handles query tile p of all sequences' tiles numbered one sequence after another,
    kernels/row_tiles.py):
        n = query_start_loc[i+1] - query_start_loc[i]; L = seq_lens[i]
        for token j < n at context position p = L - n + j, head h in [g*GROUP, (g+1)*GROUP):
            key position c in [0, p] lives at k_cache[block_tables[i, c // BLOCK_SIZE], c % BLOCK_SIZE, g]
            out[query_start_loc[i] + j, h] = softmax_c(scale * q[., h] . k[c]) @ v[c]      (fp32 online softmax)
    With an FP8 cache (FP8) k[c] and v[c] are the stored values times k_scale and v_scale (reference.paged_attention);
    the host folds k_scale into scale_log2 and v_scale multiplies the accumulator once, after the key loops:
        softmax(scale * q . (k_scale * k8)) = softmax((scale * k_scale) * q . k8);  sum p * (v_scale * v8) = v_scale *
        sum p * v8.
    The tiles are converted to q's dtype, which holds every E4M3 value exactly, so the dots read the stored values
    unrounded and each scale is one float32 multiply per score or output row. Scaling the tiles instead would cost
    a multiply per element and round k8 * k_scale to q's dtype (bf16 keeps 8 bits of its 4 + 24).
    Rows of the M tile are (token, head) pairs: row r = token (r // GROUP), head (r % GROUP), so K/V are
    read once per KV head. With NUM_SPLITS > 1 (decode only: one token per sequence) split s covers
    key positions [s*S, (s+1)*S), S = ceil(L / NUM_SPLITS) rounded up to BLOCK_N, and writes its unnormalised
    accumulator, running max (log2 units) and sum to part_*[i, h, s] for _combine_splits_kernel.
    PDL: kernels/pdl.py.

    One kernel for prefill, extend and decode, so it is long: locating the program's query tile (two ways), the
    key range it sees, the two key loops (unmasked, then causal) and the two epilogues (normalised output, or a
    split's partial sums) share the tile's registers, and a Triton helper cannot return that many values
    without spilling them; the per-key-tile work is split out (_attend_key_tile).
    """
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    kv_head = tl.program_id(1)
    if FLAT:
        seq, row0 = locate_tile(query_start_loc_ptr, num_seqs, tl.program_id(0), BLOCK_Q, CHUNK)
        if seq < 0:
            return
        q_start = tl.load(query_start_loc_ptr + seq)
        q_tile = (row0 - q_start) // BLOCK_Q
        split = 0
    else:
        seq = tl.program_id(0)
        q_tile = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS
        q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len                                  # context positions cached before this step

    offs_m = tl.arange(0, BLOCK_M)
    tok = q_tile * BLOCK_Q + offs_m // GROUP                  # tok: [BLOCK_M] query index within the sequence
    head = kv_head * GROUP + offs_m % GROUP                   # head: [BLOCK_M] query head
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = prefix + tok                                      # q_pos: [BLOCK_M] context position of each row
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64) * stride_q_tok + head * stride_q_head
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    kv_end = prefix + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)   # keys past the tile's last row are unseen
    split_len = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = split * split_len
    kv_hi = tl.minimum(kv_end, kv_lo + split_len)

    m_i = tl.full([BLOCK_M], MASKED, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_head = k_cache_ptr + kv_head * stride_c_head
    v_head = v_cache_ptr + kv_head * stride_c_head
    # key tiles wholly at or before the tile's first row are seen by every row: no causal mask there
    first_pos = prefix + q_tile * BLOCK_Q
    unmasked_hi = kv_lo + tl.maximum(tl.minimum(first_pos + 1, kv_hi) - kv_lo, 0) // BLOCK_N * BLOCK_N
    for start in range(kv_lo, unmasked_hi, BLOCK_N):
        acc, m_i, l_i = _attend_key_tile(acc, m_i, l_i, q, q_pos, k_head, v_head, bt_row, start, kv_hi, offs_d,
                                         d_ok, scale_log2, stride_c_block, stride_c_slot, BLOCK_SIZE, BLOCK_N,
                                         False, DOT_PRECISION)
    for start in range(unmasked_hi, kv_hi, BLOCK_N):
        acc, m_i, l_i = _attend_key_tile(acc, m_i, l_i, q, q_pos, k_head, v_head, bt_row, start, kv_hi, offs_d,
                                         d_ok, scale_log2, stride_c_block, stride_c_slot, BLOCK_SIZE, BLOCK_N,
                                         True, DOT_PRECISION)

    if FP8:
        acc = acc * v_scale
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_rows = (q_start + tok).to(tl.int64) * stride_o_tok + head * stride_o_head
        tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = (seq * num_heads + head) * NUM_SPLITS + split                     # part: [BLOCK_M]
        tl.store(part_max_ptr + part, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _combine_splits_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, query_start_loc_ptr,
                           stride_o_tok, stride_o_head, num_heads, HEAD_DIM: tl.constexpr,
                           HEAD_DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr):
    """Semantics: for decode sequence i (one token t = query_start_loc[i]) and head h, with per-split
    running max m_s, sum l_s and unnormalised accumulator a_s from _paged_attention_kernel:
        w_s = 2^(m_s - max_s m_s);  out[t, h] = sum_s w_s * a_s / sum_s w_s * l_s
    Sequences with no new token are skipped.
    """
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tok = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == tok:
        return
    part = (seq * num_heads + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)   # part: [NUM_SPLITS]
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m = tl.load(part_max_ptr + part)
    w = tl.exp2(m - tl.max(m, 0))
    denom = tl.sum(w * tl.load(part_sum_ptr + part), 0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :])   # acc: [NUM_SPLITS, D_PAD]
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    o_row = tok.to(tl.int64) * stride_o_tok + head * stride_o_head
    tl.store(out_ptr + o_row + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale, v_scale, stride_k_tok,
                     stride_v_tok, stride_c_slot, ROW: tl.constexpr, ROW_PAD: tl.constexpr, FP8: tl.constexpr,
                     PDL: tl.constexpr):
    """Semantics: for token t with slot = kv_slot_mapping[t] >= 0 (negative slots are padding, skipped):
        k_cache.view(-1, ROW)[slot] = stored(k[t].flatten(), k_scale);  the same for v with v_scale
    where ROW = num_kv_heads * head_dim and stored() is reference.store_kv's (FP8 caches quantize).
    """
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    tok = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    offs = tl.arange(0, ROW_PAD)
    ok = offs < ROW
    k = as_stored(tl.load(k_ptr + tok * stride_k_tok + offs, mask=ok), k_scale, FP8)
    v = as_stored(tl.load(v_ptr + tok * stride_v_tok + offs, mask=ok), v_scale, FP8)
    tl.store(k_cache_ptr + slot * stride_c_slot + offs, k, mask=ok)
    tl.store(v_cache_ptr + slot * stride_c_slot + offs, v, mask=ok)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             kv_slot_mapping: torch.Tensor, programmatic_launch: bool = True, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
    """Write the step's K/V into the pool, one launch for both; tokens with kv_slot_mapping < 0 are skipped
    (CUDA-graph padding). Same result as reference.store_kv for non-negative slots (an FP8 cache quantizes with
    the per-tensor k_scale / v_scale; a cache in k's dtype ignores them).

    k, v: [num_tokens, num_kv_heads, head_dim] (heads and dim contiguous); k_cache, v_cache: contiguous
    [num_blocks, block_size, num_kv_heads, head_dim]; kv_slot_mapping: [num_tokens] int32/int64.
    programmatic_launch: kernels/pdl.py, where the device has it.
    """
    row = k.shape[1] * k.shape[2]
    assert k.stride(1) == k.shape[2] and k.stride(2) == 1 and v.stride(1) == v.shape[2] and v.stride(2) == 1
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.dtype == v_cache.dtype
    assert k_cache.dtype in (k.dtype, KV_FP8_DTYPE)
    if k.shape[0] == 0:
        return
    _store_kv_kernel[(k.shape[0],)](k, v, k_cache, v_cache, kv_slot_mapping, float(k_scale), float(v_scale),
                                    k.stride(0), v.stride(0), row, ROW=row, ROW_PAD=triton.next_power_of_2(row),
                                    FP8=k_cache.dtype == KV_FP8_DTYPE,
                                    **pdl.launch_options(k.device, programmatic_launch))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_seqs: int,
                    max_query_len: int, out: torch.Tensor | None = None, num_kv_splits: int | None = None,
                    config: tuple[int, int, int, int] | None = None, programmatic_launch: bool = True,
                    k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context; semantics of
    reference.paged_attention, with the metadata as device tensors. The caches are in q's dtype, or FP8
    (reference.KV_FP8_DTYPE) read as stored value * k_scale / v_scale: per-tensor host floats, fixed for the
    life of a CUDA graph that captures the call (the layer's checkpoint scales), so nothing is read back.

    q: [num_tokens, num_heads, head_dim] (head_dim contiguous); k_cache, v_cache: [num_blocks, block_size,
    num_kv_heads, head_dim]; block_tables: [>= num_seqs, max_blocks] int32; query_start_loc: [>= num_seqs + 1]
    int32; seq_lens: [>= num_seqs] int32; out: like q, written and returned (allocated when None).
    num_kv_splits: key splits per decode sequence (flash-decoding); None picks from the GPU's SM count.
    Only used when max_query_len == 1. num_seqs and max_query_len are host upper bounds (CUDA-graph
    padding): sequences past the real ones have no new tokens, and tokens past the last sequence's are
    left unwritten in out. config: (BLOCK_M, BLOCK_N, num_warps, num_stages), None for default_config();
    BLOCK_M must hold a token's heads. programmatic_launch: kernels/pdl.py, where the device has it.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    assert num_heads % num_kv_heads == 0, f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    assert block_tables.dtype == query_start_loc.dtype == seq_lens.dtype == torch.int32
    assert k_cache.dtype == v_cache.dtype and k_cache.dtype in (q.dtype, KV_FP8_DTYPE), \
        f"the KV cache must be in q's dtype {q.dtype} or {KV_FP8_DTYPE}, not {k_cache.dtype}"
    fp8 = k_cache.dtype == KV_FP8_DTYPE
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    assert out.shape == q.shape and out.stride(2) == 1
    if num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    splits = default_num_kv_splits(num_seqs, num_kv_heads, max_query_len, q.device) if num_kv_splits is None \
        else num_kv_splits
    assert splits == 1 or max_query_len == 1, "KV splits are for decode batches (max_query_len == 1) only"
    assert splits & (splits - 1) == 0, f"num_kv_splits must be a power of two, got {splits}"
    block_m, block_n, num_warps, num_stages = config or default_config(max_query_len, group, q.device)
    assert block_m >= group, f"BLOCK_M {block_m} must hold a token's {group} query heads"
    block_q = block_m // group
    d_pad = triton.next_power_of_2(head_dim)
    part_acc, part_max, part_sum = _split_partials(out, num_seqs, splits, d_pad)
    flat = max_query_len > 1       # prefill / mixed: one program per query tile that exists (kernels/row_tiles.py)
    launch = pdl.launch_options(q.device, programmatic_launch)
    if flat:
        grid = (max_tiles(q.shape[0], num_seqs, block_q), num_kv_heads, 1)
    else:
        grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q) * splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_max, part_sum, block_tables, query_start_loc, seq_lens,
        scale * (k_scale if fp8 else 1.0) * LOG2_E, float(v_scale), q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), num_heads,
        num_seqs,
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_Q=block_q,
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=splits,
        FLAT=flat, CHUNK=CHUNK, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", FP8=fp8,
        num_warps=num_warps, num_stages=num_stages, **launch)
    if splits > 1:
        _combine_splits_kernel[(num_seqs, num_heads)](
            out, part_acc, part_max, part_sum, query_start_loc, out.stride(0), out.stride(1), num_heads,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, NUM_SPLITS=splits, **launch)
    return out


def _split_partials(out: torch.Tensor, num_seqs: int, splits: int, d_pad: int) -> tuple[torch.Tensor, ...]:
    """(part_acc [num_seqs, num_heads, splits, d_pad], part_max and part_sum [num_seqs, num_heads, splits]), all
    float32, for key splits; without splits the kernel writes `out` directly and these are placeholders."""
    if splits == 1:
        return out, out, out
    num_heads = out.shape[1]
    part_acc = torch.empty(num_seqs, num_heads, splits, d_pad, dtype=torch.float32, device=out.device)
    part_max = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32, device=out.device)
    return part_acc, part_max, torch.empty_like(part_max)


def default_config(max_query_len: int, group: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_M rows of (token, head) pairs, BLOCK_N keys, num_warps, num_stages); BLOCK_M holds a token.
    Decode tiles chosen with the kernels_attention bench's --step-sweep (BENCHMARKS.md, Kernels)."""
    if device.type != "cuda":                       # interpreter: small tiles keep numpy work tiny
        return max(16, triton.next_power_of_2(group)), 16, 4, 1
    if max_query_len * group <= 16:     # decode
        return max(16, triton.next_power_of_2(group)), 64, 8, 2
    return max(64, triton.next_power_of_2(group)), 64, 4, 3


def default_num_kv_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, device: torch.device) -> int:
    """Enough key splits that a decode batch gives every SM a program (power of two); batches that fill the
    SMs unsplit get none (splitting them was slower: BENCHMARKS.md, Kernels)."""
    if device.type != "cuda" or max_query_len != 1:
        return 1
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return min(MAX_KV_SPLITS, triton.next_power_of_2(math.ceil(sms / (num_seqs * num_kv_heads))))


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
