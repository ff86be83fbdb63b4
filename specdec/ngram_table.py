"""The n-gram drafter's table: a bundle file format (``ngram.npz``), written by export, read by the runtime.

Per token its most frequent successor (-1: none seen) and the most frequent token overall,
counted from a corpus (``specdec-export --ngram-corpus``). NumPy only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specdec.errors import BundleError

FILE = "ngram.npz"


class NgramTable:
    """Most frequent successor per token (-1: none seen), and the most frequent token."""

    def __init__(self, successor: np.ndarray, top: int):
        self.successor = successor  # [V] int64
        self.top = int(top)

    @classmethod
    def count(cls, ids: np.ndarray, vocab: int) -> NgramTable:
        """Bigram and unigram counts of a token stream; ties go to the lower token id."""
        ids = np.asarray(ids, dtype=np.int64)
        successor = np.full((vocab,), -1, dtype=np.int64)  # [V]
        top = int(np.bincount(ids, minlength=vocab).argmax()) if ids.size else 0
        if ids.size > 1:
            pairs, counts = np.unique(ids[:-1] * vocab + ids[1:], return_counts=True)  # sorted by (prev, next)
            prev, nxt = pairs // vocab, pairs % vocab
            order = np.lexsort((nxt, -counts, prev))  # per prev: highest count, then lowest next
            first = np.unique(prev[order], return_index=True)[1]
            successor[prev[order][first]] = nxt[order][first]
        return cls(successor, top)

    def save(self, path: Path) -> None:
        np.savez(path, successor=self.successor, top=np.int64(self.top))

    @classmethod
    def load(cls, path: Path, vocab: int) -> NgramTable:
        try:
            with np.load(path) as z:
                successor, top = z["successor"], int(z["top"])
        except (OSError, KeyError, ValueError) as e:
            raise BundleError(f"n-gram table {path} is unreadable ({e}); re-export with --ngram-corpus") from None
        if successor.shape != (vocab,) or not -1 <= successor.min() <= successor.max() < vocab:
            raise BundleError(f"n-gram table {path} has shape {successor.shape}, expected ({vocab},) token ids; re-export it")
        return cls(successor.astype(np.int64), top)
