"""How far a model's next-token log-probabilities are from a reference's: pure NumPy.

The foundation: export's validation (a float16 or quantized graph against PyTorch) and the
benchmark's quality figures (specdec/commands/bench/quality.py) judge by the same functions.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def nll(logp: np.ndarray, tokens: Sequence[int]) -> np.ndarray:
    """Negative log-likelihood of each next token: logp[i] predicts tokens[i + 1]. [n - 1]"""
    nxt = np.asarray(tokens[1:], dtype=np.int64)
    return -logp[np.arange(len(nxt)), nxt]


def kl(ref_logp: np.ndarray, logp: np.ndarray) -> np.ndarray:
    """KL(ref || other) per position, in nats. [n]"""
    return (np.exp(ref_logp) * (ref_logp - logp)).sum(axis=-1)
