"""Penalties and bias on raw logits, per position, so speculation stays exact: pure NumPy.

A row of logits predicting position t is transformed with the counts of its own prefix seq[:t]:
the prompt (repetition penalty) and the tokens generated before t (frequency and presence),
including draft tokens earlier in the same speculation window. The verify call's row j
(predicting seq[L + j]) and the draft's row that proposed seq[L + j] see the same prefix, so
p and q are transformed identically; standardizing (temperature, top-k, top-p, min-p) follows.
Verification then tests each draft token against the target's transformed distribution, so
the output law is the target's under these settings (Algorithm 1 holds for any p and q).

Order and semantics follow vLLM's sampler (``vllm/model_executor/layers/utils.py``):

    min_tokens       the stop tokens' logits = -inf while fewer tokens were generated   (vLLM)
    logit_bias       logits[id] += bias                                  (OpenAI)
    repetition       a token in the prompt or the output: l / r if l > 0 else l * r   (CTRL, HF)
    frequency        logits -= frequency * count in the output
    presence         logits -= presence * [count in the output > 0]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specdec.runtime.tree import path_to


@dataclass(frozen=True)
class Penalties:
    """One request's penalties; ``bias`` as (token ids [m], biases [m]) arrays."""

    presence: float = 0.0
    frequency: float = 0.0
    repetition: float = 1.0
    bias_ids: tuple[int, ...] = ()
    bias: tuple[float, ...] = ()
    min_tokens: int = 0  # the stop tokens are excluded until this many tokens were generated
    stop_ids: tuple[int, ...] = ()  # what min_tokens excludes: EOS (unless ignored) and stop_token_ids

    @property
    def active(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0 or self.bias_ids or (self.min_tokens and self.stop_ids))


def penalize(row: np.ndarray, pen: Penalties, prompt_seen: np.ndarray, output: np.ndarray) -> None:
    """Transform one logits row [V] (float64) in place. ``prompt_seen``: the prompt's distinct
    ids (sorted); ``output``: the tokens generated before this row's position."""
    if len(output) < pen.min_tokens and pen.stop_ids:
        row[list(pen.stop_ids)] = -np.inf
    if pen.bias_ids:
        row[list(pen.bias_ids)] += pen.bias
    ids, counts = np.unique(output, return_counts=True)  # [u], [u]
    if pen.repetition != 1.0:
        seen = np.union1d(prompt_seen, ids)
        x = row[seen]
        row[seen] = np.where(x > 0, x / pen.repetition, x * pen.repetition)
    if pen.frequency or pen.presence:
        row[ids] -= pen.frequency * counts + pen.presence


def penalize_chain(logits: np.ndarray, pen: Penalties, prompt_seen: np.ndarray, seq: np.ndarray, prompt_len: int, start: int) -> np.ndarray:
    """A float64 copy of ``logits`` [n, V] whose row i predicts seq[start + i], transformed with
    the prefix seq[:start + i] (the output: seq[prompt_len:start + i])."""
    out = np.array(logits, dtype=np.float64)  # [n, V]
    for i in range(out.shape[0]):
        penalize(out[i], pen, prompt_seen, seq[prompt_len : start + i])
    return out


def penalize_tree(logits: np.ndarray, pen: Penalties, prompt_seen: np.ndarray, seq: np.ndarray, prompt_len: int, length: int,
                  tokens, parents) -> np.ndarray:  # fmt: skip
    """A float64 copy of a tree call's ``logits`` [n + 1, V]: row 0 (the root, seq[length - 1])
    predicts seq[length] from seq[:length]; row i + 1 predicts the children of node i, whose
    prefix is seq[:length] and the path from the root to node i."""
    out = np.array(logits, dtype=np.float64)  # [n + 1, V]
    before = seq[prompt_len:length]
    penalize(out[0], pen, prompt_seen, before)
    for i in range(len(tokens)):
        penalize(out[i + 1], pen, prompt_seen, np.concatenate([before, np.asarray(path_to(tokens, parents, i), dtype=seq.dtype)]))
    return out
