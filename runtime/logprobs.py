"""The target's log-probabilities of the tokens a request emits (and of its prompt): pure NumPy.

Each emitted token, drafted and accepted or drawn by the target, is scored by the target's own
logits at its position, in the raw distribution (vLLM's default ``raw_logprobs``: before
temperature, top-k and top-p). So speculation cannot change them: an accepted draft token's
logprob is the target's, never the draft's.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np

from specdec.runtime.sampling import log_softmax

LOGPROBS_MODES = ("raw", "processed")  # vLLM's raw_logprobs / processed_logprobs
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs bound; vLLM's default max_logprobs)


class TokenLogprob(NamedTuple):
    """One position: the token there, its log-probability, and the ``k`` most likely tokens
    with theirs, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def score(logits: np.ndarray, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """Row i of ``logits`` [n, V] scores ``tokens[i]``, with its top ``k`` alternatives."""
    return _pick(log_softmax(logits), tokens, k)  # [n, V]


def score_probs(probs: np.ndarray, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    """``score`` of the distributions sampled from, probs [n, V] (``logprobs_mode="processed"``):
    a token the settings exclude has log-probability -inf."""
    with np.errstate(divide="ignore"):
        return _pick(np.log(probs), tokens, k)


def _pick(lp: np.ndarray, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
    out = []
    for row, token in zip(lp, tokens):
        top = ()
        if k:
            idx = np.argpartition(-row, k - 1)[:k] if k < row.shape[0] else np.arange(row.shape[0])
            idx = idx[np.lexsort((idx, -row[idx]))]  # most likely first; ties by token id
            top = tuple((int(i), float(row[i])) for i in idx)
        out.append(TokenLogprob(int(token), float(row[token]), top))
    return out
