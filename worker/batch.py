"""Where the scheduler and the model runner meet.

ScheduledBatch (pure Python) is what the scheduler decided for one step. ForwardBatch and
LoRABatchInfo (tensors) are what the input builder made of it for the model; they live in
persistent buffers owned by the runner, so the same storage is refilled every step (CUDA-graph safe).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from worker.request import AdapterRef, Request

if TYPE_CHECKING:
    import torch


@dataclass
class ScheduledSeq:
    request: Request
    start: int            # first position computed this step (= request.num_computed_tokens)
    num_new_tokens: int   # tokens computed this step: positions [start, start + num_new_tokens)
    lora_slot: int        # GPU slot of the request's adapter; -1 for the base model
    samples: bool = field(init=False)   # this step reaches the last known token: a new token is sampled

    def __post_init__(self) -> None:
        # fixed at scheduling time: update() appends the sampled token, which moves request.num_tokens
        self.samples = self.start + self.num_new_tokens == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids_slice(self.start, self.start + self.num_new_tokens)


@dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    adapter_loads: list[tuple[AdapterRef, int]] = field(default_factory=list)  # (adapter, slot) to fill first
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def lora_slots(self) -> set[int]:
        """The GPU slots whose adapters this batch reads."""
        return {s.lora_slot for s in self.seqs if s.lora_slot >= 0}


@dataclass
class LoRABatchInfo:
    """LoRA metadata of one step. Tokens are grouped into segments of one adapter each.

    Running example: sequences with slots [a, a, -1, b] and new-token counts [3, 1, 2, 2] give
    segments [a, -1, b]: seg_indptr = [0, 4, 6, 8], seg_lora_slots = [a, -1, b].
    """
    num_segments: int
    seg_indptr: "torch.Tensor"      # [max_segments + 1] int32; token offsets of segments
    seg_lora_slots: "torch.Tensor"  # [max_segments] int32; slot of each segment, -1 = base only
    ranks: "torch.Tensor"           # [max_loras] int32; rank of the adapter in each slot (0 = empty)
    max_rank: int                   # max over slots used this step (host-side; 0 skips LoRA entirely)
    max_seg_len: int = 0            # longest segment (host-side; sizes the kernels' grids)
    # [num_tokens] int32 on the device: the slot of each token row (-1: base only, padding rows included);
    # what the MoE-LoRA kernels read (kernels/moe_lora.py), as experts regroup tokens across segments
    token_lora_slots: "torch.Tensor | None" = None
    # LoRA kernels may run on the side stream beside the base GEMMs (layers/linear.py): CUDA-graph batches
    # only, whose host cost is paid once at capture. Eager steps are bound by the host's launches, and the
    # fork and join would add to them while saving device time nobody waits for.
    overlap: bool = False
    # [2 * tiles] int32 on the device, set for a decode graph whose rows are grouped by adapter (the input
    # builder's grouped mode): (segment, first row) of each TILE_ROWS-row tile, (-1, 0) past the last
    # (kernels/row_tiles_host.py); the LoRA kernels then read it instead of searching seg_indptr, and split K
    tile_map: "torch.Tensor | None" = None
    # host copies for the reference path, which loops over segments on the CPU
    seg_indptr_host: list[int] = field(default_factory=list)
    seg_lora_slots_host: list[int] = field(default_factory=list)
    ranks_host: list[int] = field(default_factory=list)
    token_lora_slots_host: list[int] = field(default_factory=list)


@dataclass
class ForwardBatch:
    """Tensors the model reads in one step; tokens of all sequences are flattened in batch order."""
    num_tokens: int
    num_seqs: int
    max_query_len: int              # most new tokens of one sequence (host-side; sizes attention's grid)
    input_ids: "torch.Tensor"       # [num_tokens] int64
    positions: "torch.Tensor"       # [num_tokens] int64
    kv_slot_mapping: "torch.Tensor"    # [num_tokens] int64; KV-pool slot (block * block_size + offset) per token
    query_start_loc: "torch.Tensor"  # [num_seqs + 1] int32; token offsets of sequences
    seq_lens: "torch.Tensor"        # [num_seqs] int32; context length after this step
    block_tables: "torch.Tensor"    # [num_seqs, max_blocks_per_seq] int32; -1 padded
    logits_indices: "torch.Tensor"  # [num_logits] int64; token rows whose logits are computed
    sample_rows: list[int] = field(default_factory=list)  # rows of the logits that are sampled, batch order
    prompt_rows: list[tuple[int, range]] = field(default_factory=list)  # (seq index, prompt positions) per
    # sequence scoring prompt tokens; their logits rows follow one another, before the sample rows
    lora: LoRABatchInfo | None = None
    # host copies for reference paths that loop on the CPU (never read on the GPU fast path)
    query_start_loc_host: list[int] = field(default_factory=list)
    seq_lens_host: list[int] = field(default_factory=list)
