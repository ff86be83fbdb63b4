"""Pearson's chi-square test of counts against a law, and its power: pure Python and NumPy.

``specdec check`` runs with the runtime's dependencies alone (no SciPy), so the chi-square tail
is computed here: the regularized upper incomplete gamma function Q(df/2, x/2) (series below
a + 1, Lentz's continued fraction above, as in Numerical Recipes §6.2), its inverse by bisection,
and the noncentral tail by Patnaik's approximation (a scaled central chi-square with matched
mean and variance). tests/check/test_law.py compares all three with SciPy.
"""

from __future__ import annotations

import math

import numpy as np

_EPS = 1e-15
_ITER = 10_000


def _q_gamma(a: float, x: float) -> float:
    """Q(a, x) = Γ(a, x) / Γ(a), the regularized upper incomplete gamma function."""
    if x <= 0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:  # the series of P(a, x)
        term = total = 1.0 / a
        n = a
        for _ in range(_ITER):
            n += 1
            term *= x / n
            total += term
            if abs(term) < abs(total) * _EPS:
                break
        return max(0.0, 1.0 - total * math.exp(log_front))
    b = x + 1 - a  # the continued fraction of Q(a, x), modified Lentz
    c, d = 1.0 / 1e-300, 1.0 / b
    h = d
    for i in range(1, _ITER):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1.0 / (d if abs(d) > 1e-300 else 1e-300)
        c = b + an / c
        c = c if abs(c) > 1e-300 else 1e-300
        h *= d * c
        if abs(d * c - 1) < _EPS:
            break
    return min(1.0, math.exp(log_front) * h)


def chi2_sf(x: float, df: float) -> float:
    """P(X > x) for X ~ chi-square(df)."""
    return _q_gamma(df / 2, x / 2)


def chi2_isf(level: float, df: float) -> float:
    """The x with chi2_sf(x, df) = level (bisection; level in (0, 1))."""
    lo, hi = 0.0, max(1.0, df)
    while chi2_sf(hi, df) > level:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if chi2_sf(mid, df) > level else (lo, mid)
    return (lo + hi) / 2


def ncx2_sf(x: float, df: float, lam: float) -> float:
    """P(X > x) for X ~ noncentral chi-square(df, λ), by Patnaik's approximation."""
    scale = (df + 2 * lam) / (df + lam)
    return chi2_sf(x / scale, (df + lam) ** 2 / (df + 2 * lam))


def bins(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[np.ndarray, np.ndarray]:
    """Observed and expected counts over the bins Pearson's test keeps: those with expected count
    >= ``min_expected`` (the usual validity rule), the rest pooled into one bin (folded into the
    largest when the pool itself is too small)."""
    n = float(counts.sum())
    expected = probs * n
    big = expected >= min_expected
    obs, exp = counts[big].astype(np.float64), expected[big]
    rest_obs, rest_exp = float(counts[~big].sum()), float(expected[~big].sum())
    if rest_exp >= min_expected:
        return np.append(obs, rest_obs), np.append(exp, rest_exp)
    if len(exp):
        obs, exp = obs.copy(), exp.copy()
        obs[exp.argmax()] += rest_obs
        exp[exp.argmax()] += rest_exp
    return obs, exp


def pearson(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of ``counts`` [V] drawn from ``probs`` [V].
    One bin (a law with a single likely token) has nothing to test: p-value 1, df 0."""
    obs, exp = bins(counts, probs)
    df = len(obs) - 1
    if df < 1:
        return 0.0, 0, 1.0
    exp = exp * (obs.sum() / exp.sum())
    stat = float(((obs - exp) ** 2 / exp).sum())
    return stat, df, chi2_sf(stat, df)


def detectable_effect(runs: int, df: int, level: float, power: float = 0.8) -> float:
    """The smallest Cohen's w = sqrt(Σ (m - p)² / p) that a test at ``level`` with ``runs``
    samples and ``df`` degrees of freedom rejects with probability ``power`` (λ = runs · w²)."""
    if df < 1 or runs < 1:
        return math.inf
    critical = chi2_isf(level, df)
    lo, hi = 0.0, 1.0
    while ncx2_sf(critical, df, runs * hi * hi) < power:
        hi *= 2
        if hi > 1e3:
            return math.inf
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ncx2_sf(critical, df, runs * mid * mid) < power else (lo, mid)
    return hi
