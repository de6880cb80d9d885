"""Issue 14: the Learn-then-Test guarantee, on synthetic scores whose true disagreement rate is known.

Scores s ~ U(0, 1); a position's exit token agrees with the final one with probability s. Exiting when s >= t, the
per-token disagreement rate is the integral of (1 - s) over [t, 1]: (1 - t)^2 / 2. So for epsilon the shallowest safe
threshold is t* = 1 - sqrt(2 epsilon)."""

import math

import pytest
import torch

from ee_transformers.training.guarantee import binomial_tail, fixed_sequence_test, learn_then_test

EPSILON, DELTA = 0.05, 0.1
T_STAR = 1 - math.sqrt(2 * EPSILON)  # 0.684
GRID = [1 - i / 100 for i in range(0, 101)]  # 1.00, 0.99, ..., 0.00: most conservative first


def true_rate(t):
    return (1 - t) ** 2 / 2


def sample_errors(n, generator):
    s = torch.rand(n, generator=generator)
    agree = torch.rand(n, generator=generator) < s
    return [(t, int(((s >= t) & ~agree).sum())) for t in GRID]


def chosen_threshold(n, seed):
    certified = fixed_sequence_test(sample_errors(n, torch.Generator().manual_seed(seed)), n, EPSILON, DELTA)
    return certified[-1].threshold if certified else None


def test_binomial_tail_matches_a_direct_sum():
    n, eps = 30, 0.2
    direct = sum(math.comb(n, k) * eps**k * (1 - eps) ** (n - k) for k in range(4))
    assert binomial_tail(3, n, eps) == pytest.approx(direct, rel=1e-12)
    assert binomial_tail(n, n, eps) == pytest.approx(1.0)


def test_the_promise_holds_with_probability_one_minus_delta():
    """Over many calibration samples, the chosen threshold's true rate exceeds epsilon in at most ~delta of them."""
    trials, n = 300, 2000
    violations = sum(
        true_rate(t) > EPSILON for t in (chosen_threshold(n, seed) for seed in range(trials)) if t is not None
    )
    # binomial(300, 0.1) has sd ~5.2: allow delta plus three sd; in practice the test is conservative
    assert violations / trials <= DELTA + 3 * math.sqrt(DELTA * (1 - DELTA) / trials)


def test_with_much_data_the_threshold_approaches_the_true_boundary():
    t = chosen_threshold(200_000, seed=0)
    assert T_STAR - 0.005 <= t <= T_STAR + 0.04  # safe, and not needlessly conservative


def test_too_little_data_certifies_nothing():
    assert chosen_threshold(20, seed=0) is None  # 20 positions cannot show a rate below 5% at 90% confidence


def test_sets_share_delta():
    errors = {("a",): [(0.9, 50)], ("b",): [(0.9, 50)]}  # 50 of 2000: 2.5%; p-value depends on the level
    n = 2000
    p = binomial_tail(50, n, 0.03)
    one = learn_then_test({("a",): errors[("a",)]}, n, 0.03, 2 * p * 0.99)
    two = learn_then_test(errors, n, 0.03, 2 * p * 0.99)  # each set tested at delta / 2 < p: not certified
    assert one[("a",)] and not two[("a",)] and not two[("b",)]


@pytest.mark.parametrize("bad", [dict(epsilon=0.0), dict(epsilon=1.0), dict(delta=0.0), dict(delta=1.5)])
def test_bad_levels_raise(bad):
    args = {"epsilon": 0.1, "delta": 0.1, **bad}
    with pytest.raises(ValueError, match="`epsilon`|`delta`"):
        fixed_sequence_test([(0.9, 1)], 100, args["epsilon"], args["delta"])
