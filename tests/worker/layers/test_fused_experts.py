"""FusedExperts at its interface (`FusedExperts(E, H, I, dtype, tp)`, `.load_shard`, `.load_expert`): every rank
holds every expert, gate rows [start, start + length) and up rows [I + start, I + start + length) of the checkpoint's
gate_up_proj [E, 2I, H] and columns [start, start + length) of down_proj [E, H, I], whether the checkpoint holds them
fused or one matrix per expert."""
from __future__ import annotations

import pytest
import torch

from worker.distributed.tensor_parallel import TensorParallel
from worker.layers.sparse_moe import FusedExperts

E, H, I = 4, 16, 8


def checkpoint() -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""
    gen = torch.Generator().manual_seed(0)
    return torch.randn(E, 2 * I, H, generator=gen), torch.randn(E, H, I, generator=gen)


@pytest.mark.parametrize("rank, world_size", [(0, 1), (1, 2), (3, 4)])
def test_a_rank_loads_its_share_of_every_expert_fused_or_per_expert(rank, world_size):
    gate_up, down = checkpoint()
    tp = TensorParallel(rank=rank, world_size=world_size)
    share = I // world_size
    cols = slice(rank * share, (rank + 1) * share)
    fused = FusedExperts(E, H, I, torch.float32, tp)
    fused.load_shard("gate_up_proj", None, gate_up)
    fused.load_shard("down_proj", None, down)
    per_expert = FusedExperts(E, H, I, torch.float32, tp)
    for e in range(E):
        per_expert.load_expert("gate_up_proj", e, "gate", gate_up[e, :I])
        per_expert.load_expert("gate_up_proj", e, "up", gate_up[e, I:])
        per_expert.load_expert("down_proj", e, "down", down[e])
    for experts in (fused, per_expert):
        assert experts.gate_up_proj.shape == (E, 2 * share, H) and experts.down_proj.shape == (E, H, share)
        assert torch.equal(experts.gate_up_proj[:, :share], gate_up[:, :I][:, cols])
        assert torch.equal(experts.gate_up_proj[:, share:], gate_up[:, I:][:, cols])
        assert torch.equal(experts.down_proj, down[:, :, cols])
        assert experts.full_shape("gate_up_proj") == (E, 2 * I, H) and experts.full_shape("down_proj") == (E, H, I)


def test_checkpoint_tensors_of_the_wrong_shape_are_refused():
    experts = FusedExperts(E, H, I, torch.float32, TensorParallel(rank=1, world_size=2))
    with pytest.raises(ValueError, match=r"experts down_proj: checkpoint shape \(4, 16, 4\) != model shape "
                                         r"\(4, 16, 8\)"):
        experts.load_shard("down_proj", None, torch.randn(E, H, I // 2))
    with pytest.raises(ValueError, match=r"gate_up_proj expert 2 up: checkpoint shape \(16, 16\) != model shape "
                                         r"\(8, 16\)"):
        experts.load_expert("gate_up_proj", 2, "up", torch.randn(2 * I, H))


def test_an_intermediate_size_the_ranks_do_not_divide_is_refused():
    with pytest.raises(ValueError, match=r"MoE intermediate size \(8\) must be divisible by tensor parallel size "
                                         r"\(3\)"):
        FusedExperts(E, H, I, torch.float32, TensorParallel(rank=0, world_size=3))
