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
    """Indices of the k largest, descending; ties: lower index first."""
    return np.argsort(-scores, kind="stable")[:k]


def search(prompt: Sequence[int], score: Callable[[list[list[int]]], np.ndarray], cfg: BeamConfig) -> list[Beam]:
    """The ``num_return_sequences`` best finished beams of ``prompt``, best first.
    ``score(sequences)``: for each running sequence (prompt + generated), the log-softmax of
    the next token [len, V]."""
    w, eos = cfg.num_beams, set(cfg.eos_token_ids)
    k = max(2, 1 + len(eos)) * w
    prompt = list(prompt)
    running: list[list[int]] = [[] for _ in range(w)]
    run_scores = np.full(w, NEG, dtype=np.float32)
    run_scores[0] = 0.0
    done: list[list[int]] = [[] for _ in range(w)]
    done_scores = np.full(w, NEG, dtype=np.float32)
    finished = np.zeros(w, dtype=bool)
    improvable = True
    length = 0  # tokens generated so far
    while True:
        lp = np.asarray(score([prompt + r for r in running]), dtype=np.float32)  # [w, V]
        vocab = lp.shape[-1]
        acc = (lp + run_scores[:, None]).reshape(-1)  # [w * V]
        top = _best(acc, k)
        top_scores = acc[top]
        cands = [running[i // vocab] + [int(i % vocab)] for i in top]
        hits = np.array([c[-1] in eos or length + 1 >= cfg.max_new_tokens for c in cands])  # EOS or max length
        nxt = _best(top_scores + hits * NEG, w)
        running, run_scores = [cands[i] for i in nxt], (top_scores + hits * NEG)[nxt]
        new = top_scores / np.float32((length + 1) ** cfg.length_penalty)
        just = hits & (np.arange(k) < w)
        new = new + np.where(just, np.float32(0), NEG)  # (HF also closes the set once the search may stop: one prompt stops then)
        merged_scores = np.concatenate([done_scores, new.astype(np.float32)])
        keep = _best(merged_scores, w)
        merged = done + cands
        merged_finished = np.concatenate([finished, just])
        done, done_scores, finished = [merged[i] for i in keep], merged_scores[keep], merged_finished[keep]
        length += 1
        if improvable:
            horizon = cfg.max_new_tokens if cfg.early_stopping == "never" and cfg.length_penalty > 0 else length
            best_running = run_scores[0] / np.float32(horizon**cfg.length_penalty)
            worst_done = done_scores.min() if finished.all() else NEG
            improvable = bool(best_running > worst_done)
        if not improvable or (finished.all() and cfg.early_stopping is True) or hits.all():
            break
    return [Beam(done[i], float(done_scores[i])) for i in range(cfg.num_return_sequences)]
