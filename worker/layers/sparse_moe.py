"""The sparse mixture-of-experts block: a router, fused experts, and Qwen2-MoE's optional shared expert.

Experts are held by a weight scheme (layers/weights/scheme.py: ExpertsScheme); unquantized, as transformers 5
holds them in memory: `gate_up_proj [E, 2I, H]` (gate rows first) and `down_proj [E, H, I]`. Routing and the
expert sum run through kernels/ops.sparse_experts: the references on the CPU, and on CUDA until the model runner
attaches the Triton path's workspaces (`attach_workspaces`); from then on CUDA steps run kernels/fused_moe.py.

Tensor parallelism (Megatron/vLLM style): every rank holds every expert, sharded along the expert intermediate
dimension I (`FusedExperts.intermediate_shard`): gate_up_proj holds this rank's gate rows and up rows ([E, 2I/tp, H]),
down_proj its columns ([E, H, I/tp]), so the routed sum is a partial sum. Qwen2-MoE's shared expert is a LlamaMLP
whose row-parallel down_proj leaves its partial sum unreduced; the router and shared_expert_gate stay whole, so
sigmoid(gate(x)) * shared partial is a partial sum too, added to the routed one before the block's single
all-reduce. Expert LoRA follows the projections: gate_up's B and down's A hold this rank's share of I
(lora/shards.py), down's delta adds into the partial sum.

Expert LoRA: `SparseMoE.lora` (MoELoRAWeights, views of every adapter slot, attached by lora/gpu_pool.py) with
the step's `LoRABatchInfo.token_lora_slots`, run by the model's LoRA backend (layers/lora/backend.py: `experts`).
Rows without an adapter compute exactly what the block computes without LoRA (kernels/ops.sparse_experts).
"""
from __future__ import annotations

import torch
from torch import nn

from worker.batch import ForwardBatch
from worker.distributed.tensor_parallel import SINGLE, TensorParallel
from worker.kernels import ops
from worker.kernels.choices import KernelChoices
from worker.layers.linear import Linear
from worker.layers.lora.deferred import resolved
from worker.layers.weights.scheme import ExpertMatrices, ExpertsScheme
from worker.layers.weights.unquantized import UnquantizedExperts
from worker.lora.weights import MoELoRAWeights


class FusedExperts(nn.Module):
    """Every expert's gate/up and down weights, held by `scheme`: whole, or this rank's share of the intermediate
    dimension I (`intermediate_shard`: (start, length)), gate rows [start, start + length) and up rows
    [I + start, I + start + length) of the checkpoint's gate_up_proj, columns [start, start + length) of down_proj."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 tp: TensorParallel = SINGLE, scheme: ExpertsScheme | None = None):
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_shard = tp.split(intermediate_size, "MoE intermediate size")
        self.full_intermediate_size = intermediate_size
        self.scheme = scheme if scheme is not None else UnquantizedExperts()
        self.scheme.create_weights(self, dtype)

    def checkpoint_tensors(self) -> tuple[str, ...]:
        return self.scheme.checkpoint_tensors()

    def full_shape(self, param: str) -> tuple[int, ...]:
        """The shape of the whole checkpoint tensor `param` (gate_up_proj or down_proj) this module holds a share of."""
        return self.scheme.full_shape(self, param)

    def load_shard(self, param: str, shard: int | None, tensor: torch.Tensor) -> None:
        """Copy this rank's share of a whole fused checkpoint tensor (gate_up_proj [E, 2I, H] or down_proj
        [E, H, I]); `shard` is None (no checkpoint name is fused into these; as Linear.load_shard is called)."""
        if tuple(tensor.shape) != self.full_shape(param):
            raise ValueError(f"experts {param}: checkpoint shape {tuple(tensor.shape)} != model shape "
                             f"{self.full_shape(param)}")
        self.scheme.load(self, param, tensor)

    def load_expert(self, param: str, expert: int, part: str, tensor: torch.Tensor,
                    tensor_name: str = "weight") -> None:
        """One expert's checkpoint matrix (tensor_name "weight"; or a tensor beside it the scheme takes, such as
        its FP8 scale), this rank's share of it, into place; part: "gate" [I, H], "up" [I, H] or "down" [H, I]."""
        h, i = self.hidden_size, self.full_intermediate_size
        full = (h, i) if part == "down" else (i, h)
        if tensor_name == "weight" and tuple(tensor.shape) != full:
            raise ValueError(f"{param} expert {expert} {part}: checkpoint shape {tuple(tensor.shape)} != "
                             f"model shape {full}")
        self.scheme.load_expert(self, expert, part, tensor, tensor_name)

    def finish_loading(self) -> None:
        """Every checkpoint tensor is in: the scheme settles its weights (layers/weights/scheme.py `finish`)."""
        self.scheme.finish(self)

    def matrices(self) -> ExpertMatrices:
        """The experts' weights as the expert kernels read them (layers/weights/scheme.py)."""
        return self.scheme.matrices(self)


class SparseMoE(nn.Module):
    """y = sum over the top-k experts of weight * expert(x), plus sigmoid(shared_expert_gate(x)) *
    shared_expert(x) when there is a shared expert.

    `renormalize`: divide the top-k weights by their sum (Mixtral always; Qwen when norm_topk_prob).
    `float32_weights`: multiply by the float32 routing weights (Mixtral) instead of casting them to the
    hidden dtype first (Qwen), as Hugging Face does for each family. `shared_expert`: a module called as
    `shared_expert(x, batch) -> y` (its LoRA delta still to add, or not: layers/lora/deferred.py); at world size
    > 1, y is this rank's partial sum (its row-parallel down_proj built not to reduce it). `tp`: the experts hold this rank's share of I, and the
    block's output is all-reduced once (nothing at world size 1).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 float32_weights: bool, dtype: torch.dtype, kernels: KernelChoices,
                 shared_expert: nn.Module | None = None, tp: TensorParallel = SINGLE,
                 prefix: str = "model.layers.0.mlp", expert_modules: tuple[str, ...] = ("gate_proj", "up_proj",
                                                                                          "down_proj")):
        super().__init__()
        self.top_k, self.renormalize, self.float32_weights = top_k, renormalize, float32_weights
        self.tp, self.kernels = tp, kernels
        # the router; whole; never LoRA
        self.gate = Linear(hidden_size, [num_experts], False, dtype, kernels,
                           kernels.linear_scheme([f"{prefix}.gate"], router=True))
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, dtype, tp,
                                    kernels.experts_scheme(f"{prefix}.experts", expert_modules))
        self.shared_expert = shared_expert
        self.shared_expert_gate = (Linear(hidden_size, [1], False, dtype, kernels,
                                          kernels.linear_scheme([f"{prefix}.shared_expert_gate"], router=True))
                                   if shared_expert is not None else None)
        self.lora: MoELoRAWeights | None = None   # attached by the LoRA pool when adapters are enabled
        # the Triton path's workspaces (kernels/fused_moe.py MoEWorkspace, kernels/moe_lora.py MoELoRAWorkspace), set
        # by the model runner (attach_workspaces) on CUDA; while None, CUDA runs the reference as the CPU does
        self.workspace = None
        self.lora_workspace = None

    def attach_workspaces(self, workspace, lora_workspace) -> None:
        """Hand the layer the buffers of the Triton path (shared by every MoE layer): CUDA steps take it from now on."""
        self.workspace, self.lora_workspace = workspace, lora_workspace

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: [num_tokens, hidden] -> the block's output [num_tokens, hidden]. At world size > 1 the routed experts'
        sum and the gated shared expert are partial sums over this rank's share of I, added together and then
        all-reduced once."""
        logits = self.gate(x)                                                   # [num_tokens, num_experts]
        lora = batch.lora
        if self.lora is not None and lora is not None and lora.max_rank > 0:
            out = self.kernels.lora.experts(self, x, logits, lora)
        else:
            out = ops.sparse_experts(x, logits, self.experts.matrices(), self.top_k, self.renormalize, self.float32_weights,
                                     self.workspace, self.kernels)
        if self.shared_expert is not None:
            shared = resolved(self.shared_expert(x, batch))                     # [num_tokens, hidden]
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return self.tp.all_reduce(out)
