"""Standardized sampling (paper §2.2): logits -> the distribution actually sampled from.

Argmax, temperature, top-k, top-p and min-p all become plain sampling from an adjusted distribution.
The same function standardizes the target's p and the draft's q, so a draft token's q is
exactly the distribution it was drawn from. Semantics and order follow Hugging Face
``generate``: temperature -> top-k -> top-p -> min-p; temperature 0 means argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.errors import SamplingError


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are drawn. ``temperature=0`` is argmax; ``top_k``/``top_p`` of None and
    ``min_p`` of 0 are off. ``min_p`` keeps the tokens at least that fraction as likely as the
    most likely one (HF's ``MinPLogitsWarper``, vLLM's ``min_p``)."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float = 0.0

    def __post_init__(self) -> None:
        t, k, p = self.temperature, self.top_k, self.top_p
        m = self.min_p
        if not (isinstance(m, (int, float)) and not isinstance(m, bool) and 0.0 <= m <= 1.0):
            raise SamplingError(f"min_p={m!r}: expected a number in [0, 1] (0 = off)")
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


def log_softmax(logits: np.ndarray, dtype=np.float64) -> np.ndarray:
    """Row-wise log-softmax over the last axis, computed in ``dtype`` (float32 reproduces
    ``torch.log_softmax(logits.float())``, Hugging Face's beam scores)."""
    x = np.array(logits, dtype=dtype)  # a copy: [..., V]
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _top_k_mask(scores: np.ndarray, k: int) -> np.ndarray:
    """True where a score is below the k-th largest (HF: ties with the k-th are kept)."""
    if k >= scores.shape[-1]:
        return np.zeros(scores.shape, dtype=bool)
    kth = np.partition(scores, -k, axis=-1)[..., -k, None]
    return scores < kth


# Where a row's nucleus search starts, as fractions of its largest probability: the tokens above
# the first cut, then the second, ..., then every token
NUCLEUS_CUTS = (2.0**-8, 2.0**-12, 2.0**-16, 2.0**-24, 2.0**-40, 0.0)


def _top_p_mask(scores: np.ndarray, top_p: float, probs: np.ndarray) -> np.ndarray:
    """True for tokens outside the nucleus [..., V] (``probs``: softmax of ``scores``). HF sorts
    ascending and drops a token while the cumulative mass up to and including it is <= 1 - top_p;
    equivalently, in descending order a token stays while the mass of the tokens ranked above it
    is < top_p (so the most likely token always stays). Among equal scores the lower index ranks
    higher, as argmax.

    Only the nucleus needs an order: each row sorts the candidates whose probability is at least
    a cut (``NUCLEUS_CUTS`` x its largest), lowering the cut until a candidate is dropped. Every
    other token is then strictly less likely than every candidate, so it ranks after all of them
    and is dropped too. A peaked row sorts a handful of tokens instead of the whole vocabulary (at
    262,144 tokens a full sort costs ~20 ms a row; docs/families.md). Where the mass above a token
    equals top_p exactly (equal probabilities), float rounding decides, as in any implementation:
    against a full ascending sort the two differ only there (|mass - top_p| <= 2.2e-16)."""
    drop = np.ones(scores.shape, dtype=bool)
    for row in np.ndindex(scores.shape[:-1]):
        s, p = scores[row], probs[row]
        top = p.max()
        for cut in NUCLEUS_CUTS:
            cand = np.flatnonzero(p >= cut * top) if cut > 0 else np.arange(p.shape[-1])
            order = cand[np.argsort(-s[cand], kind="stable")]  # descending score; ties: ascending index (cand is sorted)
            above = np.cumsum(p[order]) - p[order]  # mass ranked above each candidate
            kept = int((above < top_p).sum())
            if kept < len(order):  # the nucleus closed inside the candidates
                break
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
        # softmax's own steps, its exponentials kept: zeroing the dropped ones and normalizing
        # again gives softmax of the masked scores bit for bit, without a second exp
        e = scores - scores.max(axis=-1, keepdims=True)  # [..., V], a new array
        np.exp(e, out=e)
        drop = _top_p_mask(scores, cfg.top_p, e / e.sum(axis=-1, keepdims=True))
        e[drop] = 0.0
        e /= e.sum(axis=-1, keepdims=True)
        return _min_p(e, cfg.min_p)
    return _min_p(softmax(scores), cfg.min_p)


def _min_p(probs: np.ndarray, min_p: float) -> np.ndarray:
    """Drop the tokens less likely than ``min_p`` x the row's largest, and normalize (in place)."""
    if min_p > 0:
        probs[probs < min_p * probs.max(axis=-1, keepdims=True)] = 0.0
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


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


NEVER = -1e30  # a drafter's logit for a token outside its draft vocabulary (export/head.py): probability 0 at any temperature


def support_of(logits: np.ndarray) -> np.ndarray | None:
    """The ids [V'] (ascending) of a drafter's logits row [V] that are not NEVER, or None when
    every token has a logit of its own."""
    ids = np.flatnonzero(logits > NEVER / 2)
    return ids if len(ids) < len(logits) else None


def draw_within(logits: np.ndarray, support: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator, q: np.ndarray) -> int:
    """``draw`` for a logits row [V] that is NEVER outside ``support`` [V'] (ascending ids), in
    the same law: those tokens have probability 0 under every setting, so temperature, top-k,
    top-p and min-p over the support alone keep the same tokens with the same mass. q [V] is
    written whole (0 outside the support). At V = 262k, V' = 8192 the draw takes 0.14 ms here,
    the full row's 3.6 ms. A row whose support a constraint masked entirely is drawn whole."""
    if cfg.greedy:
        return int(logits.argmax())
    sub = logits[support]  # [V']
    if not np.isfinite(sub.max()):  # every supported token masked: only the full row knows what is left
        return draw(logits, cfg, rng, q)
    p = standardize(sub, cfg)  # [V'] float64
    q.fill(0.0)
    q[support] = p
    return int(support[sample(p, rng)])


def draw(logits: np.ndarray, cfg: SamplingConfig, rng: np.random.Generator, q: np.ndarray) -> int:
    """One token from a logits row [V] under ``cfg``; unless greedy, ``q`` [V] receives the
    standardized row it was drawn from (what Algorithm 1 needs of a draft token)."""
    if cfg.greedy:
        return int(logits.argmax())
    if cfg.top_k or cfg.top_p is not None and cfg.top_p < 1.0 or cfg.min_p:
        q[:] = standardize(logits, cfg)
    else:  # temperature alone: standardize's operations, in place in q (no temporaries)
        np.copyto(q, logits)
        q /= cfg.temperature
        q -= q.max()
        np.exp(q, out=q)
        q /= q.sum()
    return int(sample(q, rng))
