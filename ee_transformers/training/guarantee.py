"""Thresholds with a statistical guarantee: Learn then Test (Angelopoulos et al.), as CALM uses it for early exit.

The promise: with probability at least 1 - `delta` over the draw of the calibration sample, the chosen setting's
per-token disagreement rate with the full model (the share of positions whose early-exit token differs from the final
layer's, teacher-forced) is at most `epsilon`.

How: every candidate setting is a null hypothesis "its disagreement rate exceeds epsilon". Its p-value is the exact
binomial tail P(Binomial(n, epsilon) <= observed errors). Within one set of checked exits, thresholds are tested in a
fixed sequence from the most conservative (highest) down, stopping at the first that is not rejected at level
delta / (number of exit sets) (a Bonferroni split over the sets); every rejected setting is certified, and the fastest
certified setting is chosen. None certified: full depth, which trivially keeps the promise.

Assumption: the calibration positions are exchangeable with the text the model will decode (i.i.d. tokens of the same
kind of text). Tokens of one document are correlated, so draw calibration text from many documents; text of another
domain is not covered by the promise. The rate is teacher-forced (each position sees the reference prefix), which is
what calibration measures; free-running output can diverge further once an early token differs.
"""

import math
from dataclasses import dataclass


def binomial_tail(errors: int, n: int, epsilon: float) -> float:
    """P(Binomial(n, epsilon) <= errors), exactly (log-space sum): the p-value of "rate > epsilon" given `errors`."""
    if not 0 < epsilon < 1:
        raise ValueError(f"`epsilon` must be in (0, 1), got {epsilon!r}.")
    if n <= 0 or not 0 <= errors <= n:
        raise ValueError(f"need 0 <= errors <= n and n > 0, got errors={errors}, n={n}.")
    log_eps, log_rest = math.log(epsilon), math.log1p(-epsilon)
    terms = [
        math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1) + k * log_eps + (n - k) * log_rest
        for k in range(errors + 1)
    ]
    top = max(terms)
    return min(1.0, math.exp(top) * sum(math.exp(t - top) for t in terms))


@dataclass
class Certified:
    """A setting that passed the test: its threshold, observed errors out of `n`, and its p-value."""

    threshold: float
    errors: int
    n: int
    p_value: float

    @property
    def rate(self) -> float:
        return self.errors / self.n


def fixed_sequence_test(candidates, n: int, epsilon: float, delta: float) -> list[Certified]:
    """Tests `candidates` — (threshold, errors) pairs ordered from the most conservative to the least — in sequence,
    stopping at the first p-value above `delta`. Returns the certified prefix (possibly empty)."""
    if not 0 < delta < 1:
        raise ValueError(f"`delta` must be in (0, 1), got {delta!r}.")
    certified = []
    for threshold, errors in candidates:
        p = binomial_tail(int(errors), n, epsilon)
        if p > delta:
            break
        certified.append(Certified(float(threshold), int(errors), n, p))
    return certified


def learn_then_test(error_counts: dict, n: int, epsilon: float, delta: float) -> dict:
    """`error_counts`: {exit set (tuple): [(threshold, errors), ...] ordered from the highest threshold down}, all
    measured on the same `n` positions. Returns {exit set: certified list}, testing each set at delta / len(sets)."""
    if not error_counts:
        return {}
    level = delta / len(error_counts)
    return {key: fixed_sequence_test(pairs, n, epsilon, level) for key, pairs in error_counts.items()}


__all__ = ["Certified", "binomial_tail", "fixed_sequence_test", "learn_then_test"]
