"""Beam search with Hugging Face ``generate(num_beams=w, do_sample=False)`` semantics, as pure NumPy.

One prompt's search state and its step, independent of how the model is run: ``search`` takes a
``score(sequences) -> log-probs [w, V]`` callback (the next-token log-softmax of each running
beam). This is the reference that speculative beam search (the paper's Appendix A.4) must
equal; running beams as rows of the batched engine comes on top of it.

Per step, as ``transformers`` 4.57 (``GenerationMixin._beam_search``) does it:

    accumulated = running score + log p(token | beam)          over w x V candidates
    K = max(2, 1 + #EOS) * w best candidates (descending; ties: lower index first)
    a candidate ending in EOS or reaching max length is finished:
        it joins the finished set (the best w kept) if it is among the first w of the K,
        with score accumulated / (generated length) ** length_penalty
    the w best unfinished candidates run on
    stop: no running beam can beat the worst finished one (the early-stop heuristic), or all w
          finished with early_stopping True, or every candidate finished

Scores are float32, as in ``transformers``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from specdec.errors import InputError

NEG = np.float32(-1.0e9)


@dataclass(frozen=True)
class BeamConfig:
    num_beams: int
    max_new_tokens: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as Hugging Face
    num_return_sequences: int = 1
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.num_beams, int) or self.num_beams < 1:
            raise InputError(f"num_beams={self.num_beams!r}: expected an integer >= 1")
        if not isinstance(self.num_return_sequences, int) or not 1 <= self.num_return_sequences <= self.num_beams:
            raise InputError(f"num_return_sequences={self.num_return_sequences!r}: expected 1..num_beams ({self.num_beams})")
        if self.early_stopping not in (True, False, "never"):
            raise InputError(f"early_stopping={self.early_stopping!r}: expected True, False or 'never'")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens={self.max_new_tokens!r}: expected an integer >= 1")


@dataclass
class Beam:
    tokens: list[int]  # generated tokens (the prompt excluded)
    score: float  # length-penalized sum of log-probabilities


def _best(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest of ``scores`` [n], descending; ties: lower index first (what a
    stable sort of all n gives, in O(n) plus a sort of k: n is beams x vocabulary)."""
    if k >= scores.size:
        return np.argsort(-scores, kind="stable")[:k]
    kth = scores[np.argpartition(-scores, k - 1)[:k]].min()
    above = np.flatnonzero(scores > kth)
    idx = np.concatenate([above, np.flatnonzero(scores == kth)[: k - above.size]])
    return idx[np.lexsort((idx, -scores[idx]))]


class BeamState:
    """One prompt's search: ``running`` beams (generated tokens, as tuples) and their scores, the
    finished set, and ``over``. ``step(lp)`` advances it by one token from the next-token
    log-softmax of each running beam [w, V]. It never sees a model: the plain search feeds it the
    target's rows, the speculative one (runtime/beam_search.py) rows the target verified."""

    def __init__(self, cfg: BeamConfig):
        w = cfg.num_beams
        self.cfg, self.eos, self.k = cfg, frozenset(cfg.eos_token_ids), max(2, 1 + len(cfg.eos_token_ids)) * w
        self.running: list[tuple[int, ...]] = [() for _ in range(w)]
        self.run_scores = np.full(w, NEG, dtype=np.float32)  # [w]
        self.run_scores[0] = 0.0
        self.done: list[tuple[int, ...]] = [() for _ in range(w)]
        self.done_scores = np.full(w, NEG, dtype=np.float32)  # [w]
        self.finished = np.zeros(w, dtype=bool)  # [w]
        self.improvable = True
        self.length = 0  # tokens generated so far
        self.over = False

    def step(self, lp: np.ndarray) -> None:
        cfg, w = self.cfg, self.cfg.num_beams
        lp = np.asarray(lp, dtype=np.float32)  # [w, V]
        vocab = lp.shape[-1]
        acc = (lp + self.run_scores[:, None]).reshape(-1)  # [w * V]
        top = _best(acc, self.k)
        top_scores = acc[top]
        cands = [self.running[i // vocab] + (int(i % vocab),) for i in top]
        hits = np.array([c[-1] in self.eos or self.length + 1 >= cfg.max_new_tokens for c in cands])  # EOS or max length
        blocked = top_scores + hits * NEG
        nxt = _best(blocked, w)
        self.running, self.run_scores = [cands[i] for i in nxt], blocked[nxt]
        new = top_scores / np.float32((self.length + 1) ** cfg.length_penalty)
        just = hits & (np.arange(self.k) < w)
        new = new + np.where(just, np.float32(0), NEG)  # (HF also closes the set once the search may stop: one prompt stops then)
        merged_scores = np.concatenate([self.done_scores, new.astype(np.float32)])
        keep = _best(merged_scores, w)
        merged, merged_finished = self.done + cands, np.concatenate([self.finished, just])
        self.done, self.done_scores, self.finished = [merged[i] for i in keep], merged_scores[keep], merged_finished[keep]
        self.length += 1
        if self.improvable:
            horizon = cfg.max_new_tokens if cfg.early_stopping == "never" and cfg.length_penalty > 0 else self.length
            best_running = self.run_scores[0] / np.float32(horizon**cfg.length_penalty)
            worst_done = self.done_scores.min() if self.finished.all() else NEG
            self.improvable = bool(best_running > worst_done)
        self.over = not self.improvable or (self.finished.all() and cfg.early_stopping is True) or bool(hits.all())

    def result(self) -> list[Beam]:
        """The ``num_return_sequences`` best finished beams, best first."""
        return [Beam(list(self.done[i]), float(self.done_scores[i])) for i in range(self.cfg.num_return_sequences)]


def search(prompt: Sequence[int], score: Callable[[list[list[int]]], np.ndarray], cfg: BeamConfig) -> list[Beam]:
    """The ``num_return_sequences`` best finished beams of ``prompt``, best first.
    ``score(sequences)``: for each running sequence (prompt + generated), the log-softmax of
    the next token [len, V]."""
    state, prompt = BeamState(cfg), list(prompt)
    while not state.over:
        state.step(score([prompt + list(r) for r in state.running]))
    return state.result()
