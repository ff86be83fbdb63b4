"""Prompt lookup ("copying from the prompt", paper §3.6), written once: where the context's last
n tokens occurred before, what followed is a guess at what comes next. Its two forms:

    lookup_chain(...) -> k      the continuation of the latest occurrence of the longest suffix,
                                copied at seq[L:L+k] (drafters ``lookup`` and ``feature-lookup``,
                                and the hierarchical drafter's guesses)
    lookup_tree(...)            the continuations of every earlier occurrence, longest match
                                first and then the most recent, merged into a trie
                                (``lookup-tree``); its first branch is the chain

Both are deterministic given the context: q is one-hot (a chain) or every node a fixed
candidate (a tree), which speculative sampling handles exactly.
"""

from __future__ import annotations

import numpy as np

from specdec.runtime.tree import DraftTree


def one_hot(q: np.ndarray, tokens: np.ndarray) -> None:
    """q[i] = e_{tokens[i]}: the distribution of a deterministic proposal."""
    k = len(tokens)
    q[:k] = 0.0
    q[np.arange(k), tokens] = 1.0


def ends(hay: np.ndarray, tail: np.ndarray, n: int) -> np.ndarray:
    """The index just past every occurrence in ``hay`` of ``tail``'s last n tokens, ascending."""
    if n > len(tail) or n > len(hay):
        return np.empty(0, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(hay, n)  # [len(hay) - n + 1, n]: every n-gram
    return np.flatnonzero((windows == tail[len(tail) - n :]).all(axis=1)) + n


def latest_match(hay: np.ndarray, tail: np.ndarray, max_ngram: int) -> tuple[int, int]:
    """(end, n): the latest occurrence in ``hay`` of the longest suffix of ``tail`` (n tokens,
    up to ``max_ngram``), as the index just past it, or (-1, 0)."""
    for n in range(min(max_ngram, len(tail)), 0, -1):
        found = ends(hay, tail, n)
        if found.size:
            return int(found[-1]), n
    return -1, 0


def lookup_chain(seq: np.ndarray, length: int, gamma: int, q: np.ndarray | None, max_ngram: int = 3, min_ngram: int = 1,
                 source: np.ndarray | None = None) -> int:  # fmt: skip
    """Copy at seq[length:length+k] the k <= ``gamma`` tokens that followed the latest earlier
    occurrence in seq[:length - 1] of the longest suffix of seq[:length] (``max_ngram`` down to
    ``min_ngram`` tokens); 0 without one. With a ``source`` [N] (an encoder-decoder request's
    ids) the source is searched too and the longer match wins (the decoder's own on a tie).
    ``q`` [γ, V], unless None (greedy): one-hot rows of the copied tokens."""
    end, n = latest_match(seq[: length - 1], seq[:length], max_ngram)
    hay, stop = seq, length
    if source is not None:
        src_end, src_n = latest_match(source[:-1], seq[:length], max_ngram)  # a match needs a token after it
        if src_n > n:
            end, n, hay, stop = src_end, src_n, source, len(source)
    if n < min_ngram or gamma <= 0:
        return 0
    k = min(gamma, stop - end)
    seq[length : length + k] = hay[end : end + k]
    if q is not None:
        one_hot(q, seq[length : length + k])
    return k


def lookup_tree(seq: np.ndarray, length: int, nodes: int, depth: int, max_ngram: int = 3, min_ngram: int = 1) -> DraftTree:
    """A prompt-lookup draft tree: the continuations of earlier occurrences of the context's
    last tokens, longest match first and then the most recent, merged into a trie of at most
    ``nodes`` nodes and ``depth`` levels. Returns (tokens, parents) in topological order; every
    node is a fixed candidate (``verify_tree`` with q = None keeps the target's law)."""
    tokens: list[int] = []
    parents: list[int] = []
    child: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    seen: set[int] = set()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        for end in ends(seq[: length - 1], seq[:length], n)[::-1].tolist():  # continuation starts, most recent first
            if len(tokens) >= nodes:
                return DraftTree(tokens, parents)
            if end in seen:
                continue
            seen.add(end)
            parent = -1
            for tok in seq[end : min(end + depth, length)].tolist():
                node = child.get((parent, tok))
                if node is None:
                    if len(tokens) >= nodes:
                        break
                    node = child[(parent, tok)] = len(tokens)
                    tokens.append(tok)
                    parents.append(parent)
                parent = node
    return DraftTree(tokens, parents)
