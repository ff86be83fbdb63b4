"""Prompt lookup's two pure pieces, shared by the lookup drafters (runtime/drafters.py) and the
feature head's lookup-first proposer (runtime/proposers.py)."""

from __future__ import annotations

import numpy as np


def one_hot(q: np.ndarray, tokens: np.ndarray) -> None:
    """q[i] = e_{tokens[i]}: the distribution of a deterministic proposal."""
    k = len(tokens)
    q[:k] = 0.0
    q[np.arange(k), tokens] = 1.0


def latest_match(hay: np.ndarray, tail: np.ndarray, max_ngram: int) -> tuple[int, int]:
    """(end, n): the latest occurrence in ``hay`` of the longest suffix of ``tail`` (n tokens,
    up to ``max_ngram``), as the index just past it, or (-1, 0)."""
    ends = np.flatnonzero(hay == tail[-1])  # candidates matching 1 token
    n = 1
    while n < min(max_ngram, len(tail)) and ends.size:
        longer = ends[ends >= n]
        longer = longer[hay[longer - n] == tail[-1 - n]]
        if not longer.size:
            break
        ends, n = longer, n + 1
    return (int(ends[-1]) + 1, n) if ends.size else (-1, 0)
