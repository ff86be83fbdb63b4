"""Speculative sampling (paper §2.3, Algorithm 1) as pure NumPy functions.

One verification step: the draft proposed γ tokens x_1..x_γ, each drawn from its standardized
q_i; the target scored all γ+1 positions in one call, giving p_1..p_{γ+1}.

    accept x_i while r_i <= p_i(x_i) / q_i(x_i)          r_i ~ U(0, 1)
    first rejection at i:  t ~ norm(max(0, p_i - q_i))    (the residual)
    all γ accepted:        t ~ p_{γ+1}                    (the bonus token)

The emitted tokens x_1..x_n, t are distributed exactly as the target's own samples
(Appendix A.1). Every function takes optional leading batch axes; the single-sequence forms
return plain ints.

Lenience l in (0, 1] (Appendix A.5, off at l = 1) multiplies q by l before the comparison,
accepting when r <= p(x) / (l q(x)). No token is then emitted with probability above p(x)/l.
The residual stays norm(max(0, p - q)), which keeps that bound (see ``tests/runtime``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from specdec.errors import ConfigError
from specdec.runtime.sampling import SamplingConfig, sample, standardize


class Verdict(NamedTuple):
    """Outcome of one verification: ints for one sequence, arrays [B] for a batch."""

    accepted: int | np.ndarray  # draft tokens kept, 0..γ
    token: int | np.ndarray  # the correction (at the first rejection) or the bonus token


def check_lenience(lenience: float) -> float:
    if not (isinstance(lenience, (int, float)) and 0.0 < lenience <= 1.0):
        raise ConfigError(f"lenience={lenience!r}: expected a number in (0, 1] (1 = exact)")
    return float(lenience)


def _residual(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """max(0, p - q) per row; ``sample`` normalizes it."""
    return np.maximum(p - q, 0.0)


def verify_batch(
    draft: np.ndarray, q: np.ndarray, p: np.ndarray, rng: np.random.Generator, lenience: float = 1.0
) -> Verdict:
    """Algorithm 1 over a batch.

    Args:
        draft: [B, γ] int draft tokens.
        q: [B, γ, V] standardized draft rows each token was drawn from.
        p: [B, γ+1, V] standardized target rows.
        rng: source of the uniforms r_i and of the final token.
        lenience: l in (0, 1]; 1 is exact.

    Returns:
        Verdict of int64 arrays [B].
    """
    lenience = check_lenience(lenience)
    batch, gamma = draft.shape
    assert q.shape[:2] == (batch, gamma) and p.shape[:2] == (batch, gamma + 1), (draft.shape, q.shape, p.shape)
    rows = np.arange(batch)
    idx = draft[..., None]
    px = np.take_along_axis(p[:, :gamma], idx, axis=-1)[..., 0]  # [B, γ]
    qx = np.take_along_axis(q, idx, axis=-1)[..., 0]  # [B, γ]
    r = rng.random((batch, gamma))  # [B, γ]
    reject = r * (lenience * qx) > px  # r > p/(l q), without dividing by a zero q
    n = np.concatenate([reject, np.ones((batch, 1), dtype=bool)], axis=-1).argmax(axis=-1)  # [B]: first rejection, or γ

    final = p[rows, n]  # [B, V]: p_{n+1}
    rejected = n < gamma
    if rejected.any():
        res = _residual(p[rows[rejected], n[rejected]], q[rows[rejected], n[rejected]])
        # A residual with no mass means p == q up to rounding, where rejection is
        # impossible in exact arithmetic; p itself is then the right distribution.
        empty = res.sum(axis=-1) <= 0
        res[empty] = final[rejected][empty]
        final = final.copy()
        final[rejected] = res
    return Verdict(n.astype(np.int64), sample(final, rng))


def verify(draft: np.ndarray, q: np.ndarray, p: np.ndarray, rng: np.random.Generator, lenience: float = 1.0) -> Verdict:
    """Algorithm 1 for one sequence: draft [γ], q [γ, V], p [γ+1, V] -> Verdict of ints."""
    if len(draft) == 0:  # γ = 0, a plain step: the bonus token alone (the same single uniform as below)
        return Verdict(0, int(sample(np.asarray(p)[0], rng)))
    v = verify_batch(np.asarray(draft)[None], np.asarray(q)[None], np.asarray(p)[None], rng, lenience)
    return Verdict(int(v.accepted[0]), int(v.token[0]))


def verify_greedy_batch(draft: np.ndarray, logits: np.ndarray, lenience: float = 1.0) -> Verdict:
    """Argmax verification: keep draft tokens while they equal the target's argmax.

    Args:
        draft: [B, γ] draft tokens (the draft's own argmax picks).
        logits: [B, γ+1, V] raw target logits.
        lenience: l in (0, 1]. Below 1, also accept x when p(x) >= l * max p, p = softmax(logits)
            (Appendix A.5, applied before standardizing); the correction is still the argmax.

    Returns:
        Verdict of int64 arrays [B]; the token is the target argmax after the accepted run.
    """
    lenience = check_lenience(lenience)
    batch, gamma = draft.shape
    top = logits.argmax(axis=-1)  # [B, γ+1]
    ok = draft == top[:, :gamma]  # [B, γ]
    if lenience < 1.0:
        # p(x) / max p = exp(logit_x - max logit): no softmax needed.
        lx = np.take_along_axis(logits[:, :gamma], draft[..., None], axis=-1)[..., 0]
        ok |= lx - logits[:, :gamma].max(axis=-1) >= math.log(lenience)
    stop = np.concatenate([~ok, np.ones((batch, 1), dtype=bool)], axis=-1)  # [B, γ+1]: γ = 0 works too
    n = stop.argmax(axis=-1)  # [B]: the first mismatch, or γ
    return Verdict(n.astype(np.int64), top[np.arange(batch), n].astype(np.int64))


def verify_greedy(draft: np.ndarray, logits: np.ndarray, lenience: float = 1.0) -> Verdict:
    """Argmax verification for one sequence: draft [γ], logits [γ+1, V] -> Verdict of ints."""
    if check_lenience(lenience) == 1.0:  # the decoding loop's common case, without batch arrays
        top = np.asarray(logits).argmax(axis=-1)  # [γ+1]
        n = 0
        while n < len(draft) and draft[n] == top[n]:
            n += 1
        return Verdict(n, int(top[n]))
    v = verify_greedy_batch(np.asarray(draft)[None], np.asarray(logits)[None], lenience)
    return Verdict(int(v.accepted[0]), int(v.token[0]))


def accept(draft: np.ndarray, q: np.ndarray, logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator, lenience: float = 1.0) -> Verdict:
    """Algorithm 1 on a target call's raw logits [k+1, V] for k drafts (k = 0: the target's own
    next token): argmax verification when ``cfg`` is greedy, else speculative sampling of the
    standardized rows."""
    if cfg.greedy:
        return verify_greedy(draft, logits, lenience)
    return verify(draft, q, standardize(logits, cfg), rng, lenience)


def synthetic_accept(draft: np.ndarray, q: np.ndarray, logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator,
                     rate: float) -> Verdict:  # fmt: skip
    """BENCHMARK ONLY (``specdec bench --synthetic-acceptance``): the real verification runs
    (its NumPy cost is part of what is measured), then each draft token is kept with probability
    ``rate``, independently, up to the first failure, as the paper's i.i.d. model of α; the token
    after them is the target's own at that position. The output is NOT the target's: this
    measures cost on models whose acceptance means nothing (random weights at deployment size)."""
    real = accept(draft, q, logits, cfg, rng)
    n = 0
    while n < len(draft) and rng.random() < rate:
        n += 1
    if n == real.accepted:
        return real
    row = logits[n : n + 1]
    return Verdict(n, int(row.argmax()) if cfg.greedy else int(sample(standardize(row, cfg)[0], rng)))
