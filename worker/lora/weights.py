"""The LoRA slot pool as the layers read it: strided views of every GPU slot's region of one projection
(LoRAWeights) or of one sparse MoE layer's experts (MoELoRAWeights), made by lora/gpu_pool.py from the slot
layout (lora/slot_layout.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class LoRAWeights:
    """One projection's slice of the LoRA slot pool (views owned by lora/gpu_pool.py).

    Slice s of adapter slot w uses rows [s*R, s*R + rank) of a[w] and rows
    [slice_offsets[s], slice_offsets[s+1]) of b[w]; slots are zero-padded to R = max_lora_rank.
    """
    a: "torch.Tensor"           # [num_slots, num_slices * R, in_features]
    b: "torch.Tensor"           # [num_slots, out_features, R]
    scalings: "torch.Tensor"    # [num_slots, num_slices] float32
    slice_offsets: tuple[int, ...]   # [num_slices + 1]; host ints the kernels compile in
    lora_stream: "torch.cuda.Stream | None" = None   # LoRA work beside the base GEMM runs here

    @property
    def num_slices(self) -> int:
        return len(self.slice_offsets) - 1


@dataclass
class MoELoRAWeights:
    """One MoE layer's expert LoRA over every slot (strided views of the slot pool, lora/gpu_pool.py).

    R = max_lora_rank, E experts, H hidden, I the expert intermediate size, S slots. Ranks below R are
    zero-padded (A rows and B columns past the rank are zero), so a kernel may run every slot at R or at
    the slot's own rank (LoRABatchInfo.ranks) with the same result. Slice order: gate 0, up 1, down 2.
    """
    gate_up_a: "torch.Tensor"     # [S, E, 2 * R, H]: gate rows [0, R), up rows [R, 2R)
    gate_up_b: "torch.Tensor"     # [S, E, 2 * I, R]: gate rows [0, I) (read with xa[:, :R]), up rows [I, 2I)
    down_a: "torch.Tensor"        # [S, E, R, I]
    down_b: "torch.Tensor"        # [S, E, H, R]
    scalings: "torch.Tensor"      # [S, 3] float32: gate, up, down; 0 where the projection is not adapted
    shared_outer: "torch.Tensor"  # [S] int32: 1 where gate_up_a[w, 0] and down_b[w, 0] serve every expert
                                  # (x @ A once per token, not once per (token, expert))
