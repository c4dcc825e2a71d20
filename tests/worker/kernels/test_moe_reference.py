"""The MoE references (kernels/reference.py) against Hugging Face's own router and expert modules."""
from __future__ import annotations

import pytest
import torch

from worker.kernels.reference import moe_experts, moe_route


def _hf_router(family: str, num_experts: int, top_k: int, hidden: int, norm_topk_prob: bool):
    """(HF's router module, whether our reference should renormalise) with a random weight [E, H]."""
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
        cfg = MixtralConfig(hidden_size=hidden, num_local_experts=num_experts, num_experts_per_tok=top_k)
        router, renormalize = MixtralTopKRouter(cfg), True
    elif family == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter
        cfg = Qwen3MoeConfig(hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=top_k,
                             norm_topk_prob=norm_topk_prob)
        router, renormalize = Qwen3MoeTopKRouter(cfg), norm_topk_prob
    else:
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter
        cfg = Qwen2MoeConfig(hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=top_k,
                             norm_topk_prob=norm_topk_prob)
        router, renormalize = Qwen2MoeTopKRouter(cfg), norm_topk_prob
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, hidden, generator=torch.Generator().manual_seed(3)))
    return router, renormalize


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe"])
@pytest.mark.parametrize("num_experts, top_k", [(4, 2), (8, 2), (128, 8)])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_route_equals_hf_router(family, num_experts, top_k, norm_topk_prob, dtype):
    router, renormalize = _hf_router(family, num_experts, top_k, 64, norm_topk_prob)
    router = router.to(dtype)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(5)).to(dtype)    # [num_tokens, hidden]
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(x)                  # [T, E], [T, k], [T, k]
    weights, ids = moe_route(logits, top_k, renormalize)
    assert weights.dtype == torch.float32
    assert torch.equal(ids, hf_ids)
    # Qwen casts the weights to the logits' dtype, Mixtral keeps float32: compare in HF's dtype
    assert torch.equal(weights.to(hf_weights.dtype), hf_weights)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_moe_experts_equals_hf_experts(family, num_tokens):
    """The weighted expert sum for HF's own routing, against HF's experts module with the same weights."""
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as Experts
        cfg = MixtralConfig(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as Experts
        cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    gen = torch.Generator().manual_seed(11)
    experts = Experts(cfg)
    with torch.no_grad():
        experts.gate_up_proj.copy_(0.1 * torch.randn(experts.gate_up_proj.shape, generator=gen))   # [E, 2I, H]
        experts.down_proj.copy_(0.1 * torch.randn(experts.down_proj.shape, generator=gen))         # [E, H, I]
    x = torch.randn(num_tokens, 64, generator=gen)                                                 # [T, H]
    weights, ids = moe_route(torch.randn(num_tokens, 8, generator=gen), 2, True)
    with torch.no_grad():
        expected = experts(x, ids, weights)
        ours = moe_experts(x, experts.gate_up_proj, experts.down_proj, weights, ids)
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
