"""The paper's analysis (§3, Appendix A.5) as pure functions.

alpha  = E[sum_x min(p, q)], the acceptance rate           (Corollary 3.6)
E[tok] = (1 - alpha^(γ+1)) / (1 - alpha) per target call   (Eq. 1)
speed  = E[tok] / (γc + v)                                 (Theorem 3.8, with v = 1)
ops    = (1 - alpha)(γĉ + γ + 1) / (1 - alpha^(γ+1))       (Theorem 3.11)

v, the cost of one (γ+1)-token verify call relative to one single-token target call, is 1 in
the paper's model of plentiful parallel compute; on a CPU it is above 1, so it is a parameter.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from specdec.errors import ConfigError

DEFAULT_MAX_GAMMA = 32


def _check_alpha(alpha: float, *, open_interval: bool = False) -> float:
    lo_ok = alpha > 0 if open_interval else alpha >= 0
    hi_ok = alpha < 1 if open_interval else alpha <= 1
    if not (isinstance(alpha, (int, float)) and np.isfinite(alpha) and lo_ok and hi_ok):
        span = "(0, 1)" if open_interval else "[0, 1]"
        raise ConfigError(f"alpha={alpha!r}: expected the acceptance rate in {span}")
    return float(alpha)


def _check_cost(name: str, c: float) -> float:
    if not (isinstance(c, (int, float)) and np.isfinite(c) and c >= 0):
        raise ConfigError(f"{name}={c!r}: expected a cost ratio >= 0 (draft time / target time)")
    return float(c)


def _check_gamma(gamma: int, minimum: int = 0) -> int:
    if isinstance(gamma, bool) or not isinstance(gamma, (int, np.integer)) or gamma < minimum:
        raise ConfigError(f"gamma={gamma!r}: expected an integer >= {minimum} (draft tokens per target call)")
    return int(gamma)


def expected_tokens(alpha: float, gamma: int) -> float:
    """Eq. 1: expected tokens per iteration, (1 - alpha^(γ+1)) / (1 - alpha); γ + 1 at alpha = 1."""
    alpha, gamma = _check_alpha(alpha), _check_gamma(gamma)
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def walltime_improvement(alpha: float, gamma: int, cost: float, verify_cost: float = 1.0) -> float:
    """Theorem 3.8: E[tokens] / (γc + v); the paper's form has v = 1."""
    cost, verify_cost = _check_cost("cost", cost), _check_cost("verify_cost", verify_cost)
    return expected_tokens(alpha, gamma) / (gamma * cost + verify_cost)


def operations_factor(alpha: float, gamma: int, cost_ops: float) -> float:
    """Theorem 3.11: growth of total arithmetic operations, (1 - alpha)(γĉ + γ + 1) / (1 - alpha^(γ+1))."""
    cost_ops = _check_cost("cost_ops", cost_ops)
    return (gamma * cost_ops + gamma + 1) / expected_tokens(alpha, gamma)


def optimal_gamma(alpha: float, cost: float, max_gamma: int = DEFAULT_MAX_GAMMA, verify_cost: float = 1.0) -> int:
    """§3.5: the integer γ in 1..max_gamma maximizing Theorem 3.8, or 0 when no γ beats plain decoding.

    Ties go to the smaller γ (fewer wasted operations). With c = 0 the improvement grows
    without bound in γ, so the answer is then max_gamma.
    """
    max_gamma = _check_gamma(max_gamma, 1)
    gains = [walltime_improvement(alpha, g, cost, verify_cost) for g in range(1, max_gamma + 1)]
    best = int(np.argmax(gains))
    return best + 1 if gains[best] > 1.0 else 0


def acceptance(p: np.ndarray, q: np.ndarray, lenience: float = 1.0) -> np.ndarray:
    """β per row (Theorem 3.5): sum_x min(p, q); with lenience l, sum_x min(p / l, q) (A.5)."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    return np.minimum(p / lenience, q).sum(axis=-1)


def dlk(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Definition 3.2: D_LK(p, q) = sum_x |p - M|, M = (p + q) / 2; equals 1 - sum_x min(p, q) (Lemma 3.3)."""
    p, q = np.asarray(p, dtype=np.float64), np.asarray(q, dtype=np.float64)
    return np.abs(p - (p + q) / 2.0).sum(axis=-1)


def alpha(p: np.ndarray, q: np.ndarray, lenience: float = 1.0) -> float:
    """Corollary 3.6: alpha = E[β] = 1 - E[D_LK] over rows of p, q [..., V]."""
    return float(np.mean(acceptance(p, q, lenience)))


class Plan(NamedTuple):
    gamma: int
    expected_tokens: float
    speedup: float
    operations: float


def plan(
    alpha: float,
    cost: float,
    cost_ops: float | None = None,
    gamma: int | None = None,
    max_gamma: int = DEFAULT_MAX_GAMMA,
    verify_cost: float = 1.0,
) -> Plan:
    """Figures for one γ (the optimal one when ``gamma`` is None); γ = 0 means plain decoding.

    Args:
        alpha: acceptance rate in (0, 1).
        cost: c, draft time / target time.
        cost_ops: ĉ, draft operations / target operations per token; defaults to ``cost``.
        gamma: draft tokens per target call (>= 1), or None to pick the best in 1..max_gamma.
        max_gamma: the largest γ considered.
        verify_cost: v, a verify call's time / a single-token target call's time.
    """
    alpha = _check_alpha(alpha, open_interval=True)
    cost = _check_cost("cost", cost)
    cost_ops = cost if cost_ops is None else _check_cost("cost_ops", cost_ops)
    g = optimal_gamma(alpha, cost, max_gamma, verify_cost) if gamma is None else _check_gamma(gamma, 1)
    return Plan(
        gamma=g,
        expected_tokens=expected_tokens(alpha, g),
        speedup=walltime_improvement(alpha, g, cost, verify_cost if g else 1.0),
        operations=operations_factor(alpha, g, cost_ops),
    )
