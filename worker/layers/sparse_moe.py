"""The sparse mixture-of-experts block: a router, fused experts, and Qwen2-MoE's optional shared expert.

Experts are stored as transformers 5 holds them in memory: `gate_up_proj [E, 2I, H]` (gate rows first) and
`down_proj [E, H, I]`. Routing and the expert sum run through kernels/reference.py on the CPU, and on CUDA
until the model runner attaches the Triton path's workspaces (`attach_workspaces`); from then on CUDA steps run
kernels/fused_moe.py's fused_moe.

Tensor parallelism (Megatron/vLLM style): every rank holds every expert, sharded along the expert intermediate
dimension I (`FusedExperts.intermediate_shard`): gate_up_proj holds this rank's gate rows and up rows ([E, 2I/tp, H]),
down_proj its columns ([E, H, I/tp]), so the routed sum is a partial sum. Qwen2-MoE's shared expert is a LlamaMLP
whose row-parallel down_proj leaves its partial sum unreduced; the router and shared_expert_gate stay whole, so
sigmoid(gate(x)) * shared partial is a partial sum too, added to the routed one before the block's single
all-reduce. Expert LoRA follows the projections: gate_up's B and down's A hold this rank's share of I
(lora/shards.py), down's delta adds into the partial sum.

Expert LoRA: `SparseMoE.lora` (MoELoRAWeights, views of every adapter slot, attached by lora/gpu_pool.py) with
the step's `LoRABatchInfo.token_lora_slots` (device) / `token_lora_slots_host` (the reference's): reference.moe_lora_experts,
or fused_moe with a kernels/moe_lora.MoELoRAStep. Rows without an adapter compute exactly what moe_experts computes.
"""
from __future__ import annotations

import torch
from torch import nn

from worker.batch import ForwardBatch, LoRABatchInfo
from worker.lora.weights import MoELoRAWeights
from worker.distributed.tensor_parallel import SINGLE, TensorParallel
from worker.kernels.reference import MoELoRASlots, moe_experts, moe_lora_experts, moe_route
from worker.layers.kernel_choices import KernelChoices
from worker.layers.linear import Linear


class FusedExperts(nn.Module):
    """Every expert's gate/up and down weights in two parameters: whole, or this rank's share of the intermediate
    dimension I (`intermediate_shard`: (start, length)), gate rows [start, start + length) and up rows
    [I + start, I + start + length) of the checkpoint's gate_up_proj, columns [start, start + length) of down_proj."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE):
        super().__init__()
        self.intermediate_shard = tp.split(intermediate_size, "MoE intermediate size")
        self.full_intermediate_size = intermediate_size
        e, h, i = num_experts, hidden_size, self.intermediate_shard[1]
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)  # [E, 2I, H]
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)         # [E, H, I]

    def full_shape(self, param: str) -> tuple[int, ...]:
        """The shape of the whole checkpoint tensor `param` (gate_up_proj or down_proj) this module holds a share of."""
        e, _, h = self.gate_up_proj.shape
        i = self.full_intermediate_size
        return (e, 2 * i, h) if param == "gate_up_proj" else (e, h, i)

    def load_shard(self, param: str, shard: int | None, tensor: torch.Tensor) -> None:
        """Copy this rank's share of a whole fused checkpoint tensor (gate_up_proj [E, 2I, H] or down_proj
        [E, H, I]); `shard` is None (no checkpoint name is fused into these; as Linear.load_shard is called)."""
        target = getattr(self, param)
        if tuple(tensor.shape) != self.full_shape(param):
            raise ValueError(f"experts {param}: checkpoint shape {tuple(tensor.shape)} != model shape "
                             f"{self.full_shape(param)}")
        if param == "gate_up_proj":
            gate, up = tensor.chunk(2, dim=1)                                 # [E, I, H] each
            i = target.shape[1] // 2
            target[:, :i].copy_(gate.narrow(1, *self.intermediate_shard))
            target[:, i:].copy_(up.narrow(1, *self.intermediate_shard))
        else:
            target.copy_(tensor.narrow(2, *self.intermediate_shard))

    def load_expert(self, param: str, expert: int, part: str, tensor: torch.Tensor) -> None:
        """One expert's checkpoint matrix, this rank's share of it, into place; part: "gate" [I, H], "up" [I, H]
        or "down" [H, I]."""
        i, h = self.down_proj.shape[2], self.gate_up_proj.shape[2]
        full = (h, self.full_intermediate_size) if part == "down" else (self.full_intermediate_size, h)
        if tuple(tensor.shape) != full:
            raise ValueError(f"{param} expert {expert} {part}: checkpoint shape {tuple(tensor.shape)} != "
                             f"model shape {full}")
        target = {"gate": self.gate_up_proj[expert, :i], "up": self.gate_up_proj[expert, i:],
                  "down": self.down_proj[expert]}[part]
        target.copy_(tensor.narrow(1 if part == "down" else 0, *self.intermediate_shard))


class SparseMoE(nn.Module):
    """y = sum over the top-k experts of weight * expert(x), plus sigmoid(shared_expert_gate(x)) *
    shared_expert(x) when there is a shared expert.

    `renormalize`: divide the top-k weights by their sum (Mixtral always; Qwen when norm_topk_prob).
    `float32_weights`: multiply by the float32 routing weights (Mixtral) instead of casting them to the
    hidden dtype first (Qwen), as Hugging Face does for each family. `shared_expert`: a module called as
    `shared_expert(x, batch) -> (y, deferred LoRA delta or None)`; at world size > 1, y is this rank's partial sum
    (its row-parallel down_proj built not to reduce it). `tp`: the experts hold this rank's share of I, and the
    block's output is all-reduced once (nothing at world size 1).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 float32_weights: bool, dtype: torch.dtype, kernels: KernelChoices,
                 shared_expert: nn.Module | None = None, tp: TensorParallel = SINGLE):
        super().__init__()
        self.top_k, self.renormalize, self.float32_weights = top_k, renormalize, float32_weights
        self.tp, self.kernels = tp, kernels
        self.gate = Linear(hidden_size, [num_experts], False, dtype, kernels)      # the router; whole; never LoRA
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, dtype, tp)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (Linear(hidden_size, [1], False, dtype, kernels)
                                   if shared_expert is not None else None)
        self.lora: MoELoRAWeights | None = None   # attached by the LoRA pool when adapters are enabled
        # the Triton path's workspaces (kernels/fused_moe.py MoEWorkspace, kernels/moe_lora.py MoELoRAWorkspace), set
        # by the model runner (attach_workspaces) on CUDA; while None, CUDA runs the reference as the CPU does
        self.workspace = None
        self.lora_workspace = None

    def attach_workspaces(self, workspace, lora_workspace) -> None:
        """Hand the layer the buffers of the Triton path (shared by every MoE layer): CUDA steps take it from now on."""
        self.workspace, self.lora_workspace = workspace, lora_workspace

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, None]:
        """x: [num_tokens, hidden] -> (the block's output [num_tokens, hidden], None: no deferred delta).
        At world size > 1 the routed experts' sum and the gated shared expert are partial sums over this rank's
        share of I, added together and then all-reduced once."""
        logits = self.gate(x)                                                   # [num_tokens, num_experts]
        lora = batch.lora if self.lora is not None and batch.lora is not None and batch.lora.max_rank > 0 else None
        if x.is_cuda and self.workspace is not None:
            out = self._fused(x, logits, lora)
        else:
            out = self._reference(x, logits, lora)
        if self.shared_expert is not None:
            shared, delta = self.shared_expert(x, batch)                        # [num_tokens, hidden]
            if delta is not None:
                shared = (shared.float() + delta).to(shared.dtype)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return self.tp.all_reduce(out), None

    def _reference(self, x: torch.Tensor, logits: torch.Tensor, lora: LoRABatchInfo | None) -> torch.Tensor:
        """Routing and experts by kernels/reference.py (host loops, eager only). x: [T, H] -> [T, H]"""
        weights, ids = moe_route(logits, self.top_k, self.renormalize)          # [num_tokens, top_k] each
        if not self.float32_weights:
            weights = weights.to(x.dtype)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        if lora is None:
            return moe_experts(x, gate_up, down, weights, ids)
        return moe_lora_experts(x, gate_up, down, weights, ids, lora.token_lora_slots_host, self._slots(lora))

    def _slots(self, lora: LoRABatchInfo) -> MoELoRASlots:
        """The reference's view of self.lora: each projection at its slot's rank (its largest over the adapter's
        modules; zero padding past a projection's own rank adds nothing), 0 where the scaling is 0."""
        w, max_rank = self.lora, self.lora.down_a.shape[2]
        scalings = w.scalings.tolist()                                          # [S][3]
        ranks = [[min(rank, max_rank) if scale else 0 for scale in scalings[s]]
                 for s, rank in enumerate(lora.ranks_host)]
        return MoELoRASlots(w.gate_up_a, w.gate_up_b, w.down_a, w.down_b, ranks, w.scalings,
                            [bool(flag) for flag in w.shared_outer.tolist()])

    def _fused(self, x: torch.Tensor, logits: torch.Tensor, lora: LoRABatchInfo | None) -> torch.Tensor:
        """The Triton path (kernels/fused_moe.py, kernels/moe_lora.py), taken once the runner sets self.workspace."""
        from worker.kernels.fused_moe import fused_moe            # Triton; imported here so CPU installs need none
        from worker.kernels.moe_lora import MoELoRAStep
        step = None
        if lora is not None:
            # the kernels' grids follow max_rank; a CUDA graph replays them for any adapter mix, so it is captured
            # at the slots' R (a capture step's own ranks are those of whatever the slots held then)
            max_rank = self.lora.down_a.shape[2] if torch.cuda.is_current_stream_capturing() else lora.max_rank
            step = MoELoRAStep(self.lora, lora.token_lora_slots, lora.ranks, max_rank, self.lora_workspace)
        return fused_moe(x, logits, self.experts.gate_up_proj, self.experts.down_proj, self.top_k, self.renormalize,
                         self.float32_weights, self.workspace, lora=step,
                         programmatic_launch=self.kernels.programmatic_launch)
