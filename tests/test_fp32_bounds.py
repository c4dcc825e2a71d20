"""The tolerances of tests/fp32_bounds.py: the one-sum bound holds for sums in other orders, and a greedy parting is
excused at a near-tie only."""
from __future__ import annotations

import pytest
import torch

from tests.fp32_bounds import EPS, assert_same_until_a_tie


@pytest.mark.parametrize("n", [16, 112, 4096])
def test_a_sum_in_another_order_stays_within_n_eps_of_its_absolute_sum(n):
    terms = torch.randn(64, n, generator=torch.Generator().manual_seed(n))       # 64 sums of n terms
    in_order = terms.sum(dim=1)
    reversed_pairs = terms.flip(1).view(64, -1, 2).sum(dim=2).sum(dim=1)
    one_by_one = torch.zeros(64)
    for column in terms.unbind(1):
        one_by_one += column
    bound = n * EPS * terms.abs().sum(dim=1)
    assert ((reversed_pairs - in_order).abs() <= bound).all()
    assert ((one_by_one - in_order).abs() <= bound).all()


def logits_with(lead: float) -> torch.Tensor:
    """Two steps over a vocabulary of 4, largest |logit| 4.0: token 2 then token 0 leads token 1 by `lead`."""
    return torch.tensor([[0.0, 1.0, 3.0, -4.0], [2.0 + lead, 2.0, 0.0, 0.0]])


def test_a_greedy_parting_is_excused_at_a_near_tie_and_stops_the_comparison():
    rtol = 1e-4                                                                  # δ = 4e-4
    assert assert_same_until_a_tie([2, 1], [2, 0], logits_with(7e-4), None, rtol, "r") == 2
    assert assert_same_until_a_tie([2, 0], [2, 0], logits_with(1.0), None, rtol, "r") == 2


def test_a_greedy_parting_away_from_a_tie_fails():
    with pytest.raises(AssertionError, match="not a tie"):
        assert_same_until_a_tie([2, 1], [2, 0], logits_with(1e-2), None, 1e-4, "r")


def test_logits_over_the_bound_fail_before_the_parting():
    expected = logits_with(7e-4)
    with pytest.raises(AssertionError, match="step 0: logits differ"):
        assert_same_until_a_tie([2, 1], [2, 0], expected, expected + 1e-2, 1e-4, "r")
