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


def batch_speedup(alphas, gamma: int, cost: float, verify_cost: float = 1.0) -> float:
    """A batched call's tokens per second over plain decoding of the same rows: every row is
    padded to the call's γ, so the call costs γc + v (in plain steps of the batch) and yields
    Σ_r E[tokens](α_r, γ); plain yields one token per row per step (γ = 0: 1). The sum over rows
    of Theorem 3.8, which ``runtime/adaptive.py`` maximizes each iteration from measured costs."""
    alphas = [_check_alpha(a, open_interval=True) for a in alphas]
    if not gamma:
        return 1.0
    return sum(expected_tokens(a, gamma) for a in alphas) / (len(alphas) * (gamma * _check_cost("cost", cost) + _check_cost("verify_cost", verify_cost)))


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


# Trees (issue 28). A tree drafter offers, at each drafted position, up to ``width`` candidates
# ranked by the drafter (rank 0 its most likely). ``rank_acceptance[k]`` is the measured share
# of reached positions where the target kept the rank-k candidate (runtime/stats.py); they sum to
# at most 1. Modelled as independent across positions (the paper's α assumption, per rank).


def _check_ranks(rank_acceptance) -> tuple[float, ...]:
    r = tuple(float(x) for x in rank_acceptance)
    if not r or any(not (np.isfinite(x) and 0 <= x < 1) for x in r) or sum(r) > 1 + 1e-9:
        raise ConfigError(f"rank_acceptance={list(rank_acceptance)!r}: expected shares in [0, 1) per sibling rank, "
                          "summing to at most 1 (measure them with `specdec bench --drafters feature-tree`)")
    return r


def chain_tree_tokens(rank_acceptance, depth: int, width: int) -> float:
    """Expected tokens per call of the feature-tree shape: a chain of ``depth`` rank-0 nodes, each
    level also offering ranks 1..width-1 as leaves. Position d is reached when ranks 0 were kept
    at 1..d-1, and kept with the summed share of the offered ranks:
    1 + Σ_{d=1..depth} r0^(d-1) · Σ_{k<width} r_k (1 for the target's own token)."""
    r = _check_ranks(rank_acceptance)
    depth, width = _check_gamma(depth), _check_gamma(width, 1)
    offered = sum(r[:width])
    return 1.0 + sum(r[0] ** (d - 1) * offered for d in range(1, depth + 1))


def best_tree_tokens(rank_acceptance, nodes: int) -> float:
    """Expected tokens per call of the best static tree of ``nodes`` nodes under the rank model
    (Sequoia's objective): a node's value is the product of its path's rank shares, which never
    grows down a path, so the best tree is the ``nodes`` most valuable nodes of the infinite
    tree, taken greedily from a heap. What a dynamic (EAGLE-2) tree could reach at that size."""
    import heapq

    r, nodes = _check_ranks(rank_acceptance), _check_gamma(nodes)
    heap, total = [-x for x in r if x > 0], 1.0  # negated values of the frontier: the root's children
    heapq.heapify(heap)
    for _ in range(min(nodes, 4096)):
        if not heap:
            break
        value = -heapq.heappop(heap)
        total += value
        for x in r:
            if x > 0:
                heapq.heappush(heap, -value * x)
    return total


def verify_cost_at(curve: dict[int, float], nodes: int) -> float:
    """v(N): a tree call of ``nodes`` nodes against a 1-token call, linear between the measured
    node counts of ``curve`` (tools/bench_tree_cost.py); beyond its largest point, refused."""
    points = sorted((int(n), float(v)) for n, v in curve.items())
    if not points or nodes > points[-1][0]:
        raise ConfigError(f"nodes={nodes}: the tree cost curve measures up to {points[-1][0] if points else 0} nodes; "
                          "measure larger trees with tools/bench_tree_cost.py")
    lo = (0, 1.0)  # a 0-node tree is the plain 1-token call
    for n, v in points:
        if nodes <= n:
            return lo[1] + (v - lo[1]) * (nodes - lo[0]) / (n - lo[0]) if n > lo[0] else v
        lo = (n, v)
    return points[-1][1]


class TreePlan(NamedTuple):
    depth: int  # γ: drafted positions, one head call each
    width: int  # candidates per position; nodes = depth * width
    nodes: int
    expected_tokens: float
    verify_cost: float  # v(nodes)
    speedup: float  # expected_tokens / (depth c + v)


def plan_trees(rank_acceptance, cost: float, curve: dict[int, float], max_depth: int = 8) -> list[TreePlan]:
    """Every feature-tree shape (depth, width) the cost curve covers, best speedup first
    (Theorem 3.8 with E[tokens] from ``chain_tree_tokens`` and v from the measured curve)."""
    r, cost, max_depth = _check_ranks(rank_acceptance), _check_cost("cost", cost), _check_gamma(max_depth, 1)
    largest = max(int(n) for n in curve) if curve else 0
    rows = []
    for depth in range(1, max_depth + 1):
        for width in range(1, len(r) + 1):
            if depth * width > largest:
                break
            e, v = chain_tree_tokens(r, depth, width), verify_cost_at(curve, depth * width)
            rows.append(TreePlan(depth, width, depth * width, e, v, e / (depth * cost + v)))
    return sorted(rows, key=lambda p: (-p.speedup, p.nodes))
