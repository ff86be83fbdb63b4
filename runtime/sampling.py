"""Standardized sampling (paper §2.2): logits -> the distribution actually sampled from.

Argmax, temperature, top-k and top-p all become plain sampling from an adjusted distribution.
The same function standardizes the target's p and the draft's q, so a draft token's q is
exactly the distribution it was drawn from. Semantics and order follow Hugging Face
``generate``: temperature -> top-k -> top-p; temperature 0 means argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.errors import SamplingError


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn. ``temperature=0`` is argmax; ``top_k``/``top_p`` of None are off."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        if not (isinstance(t, (int, float)) and np.isfinite(t) and t >= 0):
            raise SamplingError(f"temperature={t!r}: expected a finite number >= 0 (0 = greedy)")
        if k is not None and (isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0):
            raise SamplingError(f"top_k={k!r}: expected an integer >= 0 (0 or None = off)")
        if p is not None and not (isinstance(p, (int, float)) and 0.0 < p <= 1.0):
            raise SamplingError(f"top_p={p!r}: expected a number in (0, 1] (1 or None = off)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingConfig(temperature=0.0)


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax over the last axis, in float64; -inf logits get probability 0.
    One new array, computed in place (the same operations, so the same values, as
    ``exp(x - max) / sum``)."""
    z = np.array(logits, dtype=np.float64)  # a copy: [..., V]
    np.subtract(z, z.max(axis=-1, keepdims=True), out=z)
    np.exp(z, out=z)
    z /= z.sum(axis=-1, keepdims=True)
    return z


def _top_k_mask(scores: np.ndarray, k: int) -> np.ndarray:
    """True where a score is below the k-th largest (HF: ties with the k-th are kept)."""
    if k >= scores.shape[-1]:
        return np.zeros(scores.shape, dtype=bool)
    kth = np.partition(scores, -k, axis=-1)[..., -k, None]
    return scores < kth


def _top_p_mask(scores: np.ndarray, top_p: float) -> np.ndarray:
    """True for tokens outside the nucleus [..., V]. HF sorts ascending and drops a token while
    the cumulative mass up to and including it is <= 1 - top_p; equivalently, in descending
    order a token stays while the mass of the tokens ranked above it is < top_p (so the most
    likely token always stays). Among equal scores the lower index ranks higher, as argmax.

    Only the nucleus needs an order: each row sorts its top candidates (argpartition), 64 at
    first and 8x more while the nucleus does not close strictly inside them, instead of the whole
    vocabulary (at 262,144 tokens a full sort costs ~25 ms a row; docs/families.md)."""
    probs = softmax(scores)  # [..., V]
    drop = np.ones(scores.shape, dtype=bool)
    v = scores.shape[-1]
    for row in np.ndindex(scores.shape[:-1]):
        s, p = scores[row], probs[row]
        m = min(v, 64)
        while True:
            cand = np.argpartition(s, v - m)[v - m :] if m < v else np.arange(v)  # the m largest, unordered
            order = cand[np.lexsort((cand, -s[cand]))]  # descending score, then ascending index
            above = np.cumsum(p[order]) - p[order]  # [m]: mass ranked above each candidate
            kept = int((above < top_p).sum())
            # closed inside: a token outside the candidates scores <= the last candidate, below
            # the last kept one, so it ranks after every kept token and cannot change `above`
            if m == v or (kept < m and s[order[kept - 1]] > s[order[-1]]):
                break
            m = min(v, 8 * m)
        drop[row][order[:kept]] = False
    return drop


def standardize(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """Turn logits [..., V] into the probabilities [..., V] (float64) that ``cfg`` samples from.

    Greedy gives a one-hot row at the first argmax (as ``torch.argmax`` does).
    """
    scores = np.asarray(logits, dtype=np.float64)
    if cfg.greedy:
        out = np.zeros(scores.shape, dtype=np.float64)
        np.put_along_axis(out, scores.argmax(axis=-1)[..., None], 1.0, axis=-1)
        return out
    scores = scores / cfg.temperature
    if cfg.top_k:
        scores = np.where(_top_k_mask(scores, int(cfg.top_k)), -np.inf, scores)
    if cfg.top_p is not None and cfg.top_p < 1.0:
        scores = np.where(_top_p_mask(scores, cfg.top_p), -np.inf, scores)
    return softmax(scores)


def sample(probs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Draw one index per row of probs [..., V] by inverse CDF; rows need not be normalized.

    Returns an int64 array of shape probs.shape[:-1]. A zero-mass token is never drawn.
    """
    probs = np.asarray(probs, dtype=np.float64)
    cdf = np.cumsum(probs, axis=-1)  # [..., V]
    u = rng.random(probs.shape[:-1]) * cdf[..., -1]  # [...]
    if probs.ndim == 1:  # one row: a binary search counts the same entries (cdf never decreases)
        idx = int(np.searchsorted(cdf, u, side="right"))
        if idx < probs.shape[-1]:  # cdf[idx] > u >= cdf[idx - 1]: token idx has mass
            return np.int64(idx)
        return np.int64(probs.shape[-1] - 1 - np.argmax(probs[::-1] > 0))
    idx = (cdf <= u[..., None]).sum(axis=-1)
    # u can round up to the total; never step past the last token with mass.
    last = probs.shape[-1] - 1 - np.argmax(probs[..., ::-1] > 0, axis=-1)
    return np.minimum(idx, last).astype(np.int64)


def draw(logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator, q: np.ndarray) -> int:
    """One token from a logits row [V] under ``cfg``; unless greedy, ``q`` [V] receives the
    standardized row it was drawn from (what Algorithm 1 needs of a draft token)."""
    if cfg.greedy:
        return int(logits.argmax())
    if cfg.top_k or cfg.top_p is not None and cfg.top_p < 1.0:
        q[:] = standardize(logits, cfg)
    else:  # temperature alone: standardize's operations, in place in q (no temporaries)
        np.copyto(q, logits)
        q /= cfg.temperature
        q -= q.max()
        np.exp(q, out=q)
        q /= q.sum()
    return int(sample(q, rng))
