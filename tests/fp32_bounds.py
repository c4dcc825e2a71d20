"""How far two float32 runs of one model may part when only the order of their sums differs: a sum split across
tensor-parallel ranks, another thread count, another GEMM shape (rows reordered or padded, a prompt cut into chunks,
cached K/V read back). The tests comparing such runs take their tolerances from here, never from what one machine
produced.

One sum. n float32 terms summed in any order land within (n - 1)·u·Σ|terms| of the exact sum (u = 2^-24, the unit
roundoff; Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., §4.2), so two orders differ by at most

    |Δ| ≤ n · eps · Σ|terms|,        eps = 2u = 2^-23 = torch.finfo(torch.float32).eps.

A forward pass. A decoder layer is a chain of at most SUMS_PER_LAYER = 10 sums: input norm, qkv, q·k, p·v, o,
post-attention norm, router, top-k combine, gate_up, down (a LoRA shrink and expand, or a shared expert, run beside one
of these, not after it); the model adds the final norm and the LM head. Every projection reads an RMS-normalised
input and softmax weights sum to 1, so each sum's Σ|terms| is taken at the scale of the logits, and its error is taken
to reach the logits unamplified. With D sums of at most n terms each:

    |Δlogits| ≤ D · n · eps · max|logits|        (forward_rtol)

An MoE router's top-k choice is a step, not a sum: a token whose k-th and (k+1)-th expert scores lie within the bound
of each other could switch experts, which the bound does not cover; it assumes no such token.

For the tiny test models (2 layers, longest sum 112) that is 2.9e-4 of the largest logit; two shardings of one model
part by about 1e-5 of it, and a sharding bug (a wrong shard, a bias added twice, a LoRA share dropped) by 1e-1 and
more.

Greedy tokens. Each of two logits moves by at most the bound δ, so the argmax can change only where the reference's
best token leads the other run's choice by at most 2δ: a near-tie. After it the two sequences hold different tokens
and nothing more is comparable (`assert_same_until_a_tie`). A log-probability z_i - logsumexp(z) moves by at most 2δ.
"""
from __future__ import annotations

import torch

EPS = torch.finfo(torch.float32).eps
SUMS_PER_LAYER = 10


def forward_rtol(cfg, longest_seq: int) -> float:
    """The bound above relative to max|logits|, for a model of `cfg` (an ArchConfig: its layers, hidden, head and
    intermediate sizes) over sequences of at most `longest_seq` tokens (the p·v sum)."""
    longest_sum = max(cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size, longest_seq,
                      getattr(cfg, "moe_intermediate_size", 0), getattr(cfg, "shared_expert_intermediate_size", 0))
    return (SUMS_PER_LAYER * cfg.num_layers + 2) * longest_sum * EPS


def logits_bound(reference: torch.Tensor, rtol: float) -> float:
    """δ: the absolute bound on |Δlogits| for logits at the scale of `reference`."""
    return rtol * reference.abs().max().item()


def assert_logits_close(got: torch.Tensor, expected: torch.Tensor, rtol: float, what: str = "logits") -> None:
    assert got.shape == expected.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    err, bound = (got - expected).abs().max().item(), logits_bound(expected, rtol)
    assert err <= bound, f"{what} differ by {err:.2e}, over the summation-order bound {bound:.2e}"


def assert_same_until_a_tie(got_tokens: list[int], expected_tokens: list[int], expected_logits: torch.Tensor,
                            got_logits: torch.Tensor | None, rtol: float, what: str) -> int:
    """Greedy tokens equal and (when given) logits [steps, vocab] within the bound, step by step, up to the first
    step where the tokens part; there the reference's token must lead the other's by at most 2δ. Returns the number
    of steps compared (the parting step included)."""
    assert len(got_tokens) == len(expected_tokens), f"{what}: {len(got_tokens)} tokens, expected {len(expected_tokens)}"
    delta = logits_bound(expected_logits, rtol)
    for step, (a, b) in enumerate(zip(got_tokens, expected_tokens)):
        if got_logits is not None:
            assert_logits_close(got_logits[step], expected_logits[step], rtol, f"{what}, step {step}: logits")
        if a != b:
            lead = (expected_logits[step, b] - expected_logits[step, a]).item()
            assert lead <= 2 * delta, (f"{what} parts at step {step} ({a} instead of {b}) where the reference's "
                                       f"token leads by {lead:.2e}, over twice the bound {delta:.2e}: not a tie")
            return step + 1
    return len(expected_tokens)
