"""ScheduledBatch -> ForwardBatch, through persistent buffers refilled every step.

Host-side staging buffers (pinned on CUDA) are filled in Python, then copied to device buffers of
fixed size with non_blocking=True, all fields in one copy (each side's fields are views of one byte
buffer); the ForwardBatch holds views of the device buffers, so their storage never moves (what CUDA
graphs need). A decode batch may be padded to a graph's batch size: padding sequences have one token
that writes no K/V (slot -1), reads block 0, and uses no adapter.

Async scheduling: a decode token sampled by the batch still in flight is not known on the host. Its
input id is taken on the device from that batch's sampler output (`prev_tokens`), by a gather
enqueued after the input copies. The host buffers come in two sets used in turn, so filling one
never races the copies of the previous step, which may not have run yet.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.batch import ForwardBatch, LoRABatchInfo, ScheduledBatch
from worker.kernels.row_tiles_host import TILE_ROWS, host_tile_map, max_tiles


@dataclass(slots=True)
class _HostRows:
    """One step's inputs as host lists, before they are written into the staging buffers."""
    ids: list[int] = field(default_factory=list)          # [num_tokens] input ids (0 for pending tokens)
    pos: list[int] = field(default_factory=list)          # [num_tokens] positions
    slots: list[int] = field(default_factory=list)        # [num_tokens] KV slots; -1 writes no K/V
    qsl: list[int] = field(default_factory=lambda: [0])   # [num_seqs + 1] query start offsets
    lens: list[int] = field(default_factory=list)         # [num_seqs] context lengths after this step
    prompt_idx: list[int] = field(default_factory=list)   # token rows whose logits score prompt tokens
    sample_idx: list[int] = field(default_factory=list)   # token rows whose logits are sampled
    prompt_rows: list[tuple[int, list[int]]] = field(default_factory=list)   # (sequence, prompt positions scored)
    pending_dst: list[int] = field(default_factory=list)  # token rows of pending tokens
    pending_src: list[int] = field(default_factory=list)  # their rows in the previous step's sampler output


def _pad_decode(rows: _HostRows, num_seqs: int, block_tables: np.ndarray) -> None:
    """Pad to `num_seqs` sequences of one token each: token 0 at position 0, no K/V written, block 0."""
    for i in range(len(rows.lens), num_seqs):
        rows.ids.append(0)
        rows.pos.append(0)
        rows.slots.append(-1)
        rows.qsl.append(rows.qsl[-1] + 1)
        rows.lens.append(1)
        block_tables[i, 0] = 0
        rows.sample_idx.append(rows.qsl[-1] - 1)


def _pad_mixed(rows: _HostRows, num_tokens: int, num_seqs: int) -> None:
    """Pad to a mixed-batch graph's fixed shapes: token rows past the real ones belong to no sequence and no
    LoRA segment (id 0, position 0, no K/V written), sequences past the real ones have no new tokens and an
    empty context, and the sampled rows are padded with row 0 to one per sequence. With LoRA segments past
    the real ones empty (InputBuilder._build_lora) and num_seqs, max_query_len and the LoRA grid bounds the
    padded counts, the kernels' grids depend on (tokens, seqs) alone (kernels/row_tiles.py). No prompt logprobs."""
    assert not rows.prompt_idx, "mixed-batch graphs compute no prompt logprobs"
    assert rows.qsl[-1] <= num_tokens and len(rows.lens) <= num_seqs
    pad = num_tokens - len(rows.ids)
    rows.ids += [0] * pad
    rows.pos += [0] * pad
    rows.slots += [-1] * pad
    rows.qsl += [rows.qsl[-1]] * (num_seqs - len(rows.lens))
    rows.lens += [0] * (num_seqs - len(rows.lens))
    rows.sample_idx += [0] * (num_seqs - len(rows.sample_idx))


class InputBuilder:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, lora_ranks_host: list[int], lora_ranks: torch.Tensor):
        self.block_size = block_size
        self.device = device
        pin = device.type == "cuda"
        i32, i64 = torch.int32, torch.int64
        shapes = {"input_ids": ([max_num_tokens], i64), "positions": ([max_num_tokens], i64),
                  "kv_slot_mapping": ([max_num_tokens], i64), "query_start_loc": ([max_num_seqs + 1], i32),
                  "seq_lens": ([max_num_seqs], i32), "block_tables": ([max_num_seqs, max_blocks_per_seq], i32),
                  "logits_indices": ([max_num_tokens], i64), "seg_indptr": ([max_num_tokens + 1], i32),
                  "seg_lora_slots": ([max_num_tokens], i32), "token_lora_slots": ([max_num_tokens], i32),
                  "pending_dst": ([max_num_seqs], i64), "pending_src": ([max_num_seqs], i64),
                  "tile_map": ([2 * max_tiles(max(max_num_tokens, max_num_seqs), max_num_seqs + 1, TILE_ROWS)], i32)}
        # all fields are views of one byte buffer per side, so a step's inputs go over in one copy
        self._host_bufs = [_byte_buffer(shapes, torch.device("cpu"), pin) for _ in range(2)]
        self._host_sets = [_field_views(buf, shapes) for buf in self._host_bufs]
        self._host_np = [{k: v.numpy() for k, v in views.items()} for views in self._host_sets]  # same memory
        self._current = 0                 # which host set the latest build() filled
        self._dev_buf = _byte_buffer(shapes, device, False)
        self.dev = _field_views(self._dev_buf, shapes)
        self.lora_ranks_host, self.lora_ranks = lora_ranks_host, lora_ranks

    def build(self, batch: ScheduledBatch, pad_to: int | None = None, lora: bool | None = None,
              prev_tokens: torch.Tensor | None = None, mixed_pad: tuple[int, int] | None = None,
              grouped: bool = False) -> ForwardBatch:
        """`pad_to`: a decode batch padded to that many sequences, one LoRA segment per sequence (the
        fixed shapes of a decode CUDA graph); with `grouped`, one segment per run of sequences on one slot
        (the scheduler orders rows by slot; _grouped_segments) and, for decode and mixed graphs alike, a map
        of the LoRA kernels' row tiles.
        `mixed_pad`: (tokens, seqs), any batch padded to the fixed shapes of a mixed-batch graph (_pad_mixed).
        `lora`: force LoRA on or off (graph capture); None decides from the batch. `prev_tokens`: the sampled
        token ids [num_rows] of the batch in flight, where the pending tokens of this batch's requests come
        from."""
        self._current = 1 - self._current
        block_tables = self._host_np[self._current]["block_tables"]
        block_tables.fill(-1)
        rows = self._real_rows(batch, block_tables)
        if pad_to is not None:
            _pad_decode(rows, pad_to, block_tables)
        max_query_len = max((b - a for a, b in zip(rows.qsl, rows.qsl[1:])), default=0)
        if mixed_pad is not None:
            _pad_mixed(rows, *mixed_pad)
            max_query_len = mixed_pad[0]
        self._write_host(rows)
        lora_info = self._build_lora(batch, pad_to, lora, mixed_pad, len(rows.ids), grouped)
        self._to_device()
        self._gather_pending(rows, prev_tokens)
        return self._forward_batch(rows, max_query_len, lora_info)

    def _real_rows(self, batch: ScheduledBatch, block_tables: np.ndarray) -> _HostRows:
        """The batch's own sequences as host lists; their block tables go straight into `block_tables`
        (the host staging array [max_num_seqs, max_blocks_per_seq])."""
        rows = _HostRows()
        for i, seq in enumerate(batch.seqs):
            end = seq.start + seq.num_new_tokens
            rows.ids += seq.token_ids
            if len(rows.ids) < rows.qsl[-1] + seq.num_new_tokens:    # the last one is pending
                rows.pending_dst.append(len(rows.ids))
                rows.pending_src.append(seq.request.pending_row)
                rows.ids.append(0)
            rows.pos += range(seq.start, end)
            blocks = seq.request.block_ids
            rows.slots += [blocks[p // self.block_size] * self.block_size + p % self.block_size
                           for p in range(seq.start, end)]
            rows.qsl.append(rows.qsl[-1] + seq.num_new_tokens)
            rows.lens.append(end)
            block_tables[i, :len(blocks)] = blocks
            scored = seq.request.prompt_logprob_positions(seq.start, end)
            if scored:
                rows.prompt_rows.append((i, scored))
                rows.prompt_idx += [rows.qsl[-2] + p - seq.start for p in scored]
            if seq.samples:
                rows.sample_idx.append(rows.qsl[-1] - 1)
        return rows

    def _write_host(self, rows: _HostRows) -> None:
        h = self._host_np[self._current]      # numpy views: list -> buffer writes without torch.tensor()
        for name, values in (("input_ids", rows.ids), ("positions", rows.pos), ("kv_slot_mapping", rows.slots),
                             ("query_start_loc", rows.qsl), ("seq_lens", rows.lens),
                             ("logits_indices", rows.prompt_idx + rows.sample_idx), ("pending_dst", rows.pending_dst),
                             ("pending_src", rows.pending_src)):
            h[name][:len(values)] = values

    def _gather_pending(self, rows: _HostRows, prev_tokens: torch.Tensor | None) -> None:
        """Each pending token's input id, taken on the device from the sampler output of the batch in flight."""
        if not rows.pending_dst:
            return
        assert prev_tokens is not None, "a pending token needs the sampler output of the batch in flight"
        d, n = self.dev, len(rows.pending_dst)
        d["input_ids"].index_copy_(0, d["pending_dst"][:n], prev_tokens[d["pending_src"][:n]])

    def _forward_batch(self, rows: _HostRows, max_query_len: int, lora_info: LoRABatchInfo | None) -> ForwardBatch:
        d, n_tok, n_seq = self.dev, len(rows.ids), len(rows.lens)
        num_logits = len(rows.prompt_idx) + len(rows.sample_idx)
        return ForwardBatch(
            num_tokens=n_tok, num_seqs=n_seq, max_query_len=max_query_len,
            input_ids=d["input_ids"][:n_tok], positions=d["positions"][:n_tok],
            kv_slot_mapping=d["kv_slot_mapping"][:n_tok], query_start_loc=d["query_start_loc"][:n_seq + 1],
            seq_lens=d["seq_lens"][:n_seq], block_tables=d["block_tables"][:n_seq],
            logits_indices=d["logits_indices"][:num_logits], lora=lora_info,
            sample_rows=list(range(len(rows.prompt_idx), num_logits)), prompt_rows=rows.prompt_rows,
            query_start_loc_host=rows.qsl, seq_lens_host=rows.lens)

    @property
    def host(self) -> dict[str, torch.Tensor]:
        """The host staging views the latest build() filled."""
        return self._host_sets[self._current]

    def _build_lora(self, batch: ScheduledBatch, pad_to: int | None, force: bool | None,
                    mixed_pad: tuple[int, int] | None, num_tokens: int, grouped: bool = False) -> LoRABatchInfo | None:
        """Merge consecutive sequences of the same slot into segments (not when padding for a decode graph;
        a mixed graph's padding adds empty segments up to its sequence count), and give each of the
        `num_tokens` token rows its slot (the MoE-LoRA kernels' token_lora_slots; padding rows -1).

        Slots [a, a, -1, b] with new-token counts [3, 1, 2, 2] give seg_indptr [0, 4, 6, 8], weights [a, -1, b],
        token_lora_slots [a, a, a, a, -1, -1, b, b] (and -1 for each padding row after them).
        """
        if grouped and pad_to is not None:
            indptr, weights, max_seg_len = self._grouped_segments(batch, pad_to)
        else:
            indptr, weights = [0], []
            for seq in batch.seqs:
                if weights and weights[-1] == seq.lora_slot and pad_to is None:
                    indptr[-1] += seq.num_new_tokens
                else:
                    weights.append(seq.lora_slot)
                    indptr.append(indptr[-1] + seq.num_new_tokens)
            for _ in range(len(batch.seqs), pad_to or 0):
                weights.append(-1)
                indptr.append(indptr[-1] + 1)
            max_seg_len = max((b - a for a, b in zip(indptr, indptr[1:])), default=0)
        if mixed_pad is not None:
            weights += [-1] * (mixed_pad[1] - len(weights))
            indptr += [indptr[-1]] * (mixed_pad[1] + 1 - len(indptr))
            max_seg_len = mixed_pad[0]
        ranks = self.lora_ranks_host
        max_rank = max((ranks[w] for w in weights if w >= 0), default=0)
        if force is not None:
            max_rank = max(ranks + [1]) if force else 0
        if max_rank == 0:
            return None
        h = self._host_np[self._current]
        h["seg_indptr"][:len(indptr)] = indptr
        h["seg_lora_slots"][:len(weights)] = weights
        token_lora_slots = [w for w, lo, hi in zip(weights, indptr, indptr[1:]) for _ in range(hi - lo)]
        token_lora_slots += [-1] * (num_tokens - len(token_lora_slots))
        h["token_lora_slots"][:num_tokens] = token_lora_slots
        tile_map = None
        if grouped:
            num_tiles = max_tiles(pad_to or mixed_pad[0], len(weights), TILE_ROWS)
            h["tile_map"][:2 * num_tiles] = host_tile_map(indptr, TILE_ROWS, num_tiles)
            tile_map = self.dev["tile_map"][:2 * num_tiles]
        return LoRABatchInfo(num_segments=len(weights), seg_indptr=self.dev["seg_indptr"][:len(indptr)],
                             seg_lora_slots=self.dev["seg_lora_slots"][:len(weights)], ranks=self.lora_ranks,
                             max_rank=max_rank, max_seg_len=max_seg_len,
                             token_lora_slots=self.dev["token_lora_slots"][:num_tokens], overlap=pad_to is not None,
                             tile_map=tile_map,
                             seg_indptr_host=indptr, seg_lora_slots_host=weights, ranks_host=list(ranks),
                             token_lora_slots_host=token_lora_slots)

    def grouped_segments(self, num_seqs: int) -> int:
        """The segment count of a grouped decode graph of `num_seqs` sequences: every slot's run, the base
        rows' and the padding rows' (unused ones empty), capped by the sequences."""
        return min(num_seqs, len(self.lora_ranks_host) + 2)

    def _grouped_segments(self, batch: ScheduledBatch, pad_to: int) -> tuple[list[int], list[int], int]:
        """(seg_indptr, slots, max_seg_len) of a decode graph whose rows are grouped by slot: one segment per
        run of sequences on one slot, the padding rows one base-only segment, then empty segments up to
        grouped_segments(pad_to); max_seg_len is pad_to, so the grid (of row tiles) is the same for any mix.
        Slots [-1, a, a, b] padded to 8 sequences: seg_indptr [0, 1, 3, 4, 8, 8, ...], slots [-1, a, b, -1, -1, ...]."""
        indptr, weights = [0], []
        for seq in batch.seqs:
            if weights and weights[-1] == seq.lora_slot:
                indptr[-1] += 1
            else:
                weights.append(seq.lora_slot)
                indptr.append(indptr[-1] + 1)
        if len(batch.seqs) < pad_to:
            weights.append(-1)
            indptr.append(pad_to)
        num_segments = self.grouped_segments(pad_to)
        assert len(weights) <= num_segments, "rows not grouped by slot: more segments than a grouped graph has"
        weights += [-1] * (num_segments - len(weights))
        indptr += [pad_to] * (num_segments + 1 - len(indptr))
        return indptr, weights, pad_to

    def _to_device(self) -> None:
        self._dev_buf.copy_(self._host_bufs[self._current], non_blocking=True)


_ALIGN = 16


def _num_bytes(shape: list[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _field_bytes(shape: list[int], dtype: torch.dtype) -> int:
    return -(-_num_bytes(shape, dtype) // _ALIGN) * _ALIGN


def _byte_buffer(shapes: dict, device: torch.device, pin: bool) -> torch.Tensor:
    total = sum(_field_bytes(s, d) for s, d in shapes.values())
    return torch.zeros(total, dtype=torch.uint8, device=device, pin_memory=pin)


def _field_views(buf: torch.Tensor, shapes: dict) -> dict[str, torch.Tensor]:
    """Typed views of consecutive, aligned slices of a byte buffer, one per field."""
    views, offset = {}, 0
    for name, (shape, dtype) in shapes.items():
        views[name] = buf[offset:offset + _num_bytes(shape, dtype)].view(dtype).view(shape)
        offset += _field_bytes(shape, dtype)
    return views
