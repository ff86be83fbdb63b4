"""One request in flight: the per-row state the engine core keeps for it (its tokens, the q rows
of its drafts, its generator and its grammar matcher), and the request's transforms of the
target's and the drafters' logits applied from the row's own prefix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from specdec.runtime.penalties import penalize_chain, penalize_tree
from specdec.runtime.request import Request
from specdec.runtime.stats import Stats

if TYPE_CHECKING:
    from specdec.runtime.adaptive import Acceptance
    from specdec.runtime.constraints import GrammarState
    from specdec.runtime.handles import Handle


@dataclass
class Row:
    """One request in flight, in cache slot ``slot`` of every model."""

    req: Request
    sink: Handle  # where emitted tokens go
    slot: int
    seq: np.ndarray  # [MAX] committed + proposed tokens (a row of the engine's token buffer)
    q: np.ndarray  # [γ, V] the distributions the proposals were drawn from
    rng: np.random.Generator
    length: int  # L: committed tokens
    left: int  # tokens still to emit
    ready: bool = False  # prompt fed: the row decodes
    scored: list | None = None  # with logprobs asked: the last iteration's TokenLogprob per kept token
    grammar: GrammarState | None = None  # structured outputs: this row's matcher (``Request.new_grammar``)
    acceptance: Acceptance | None = None  # adaptive γ in a batch: this row's own α (the engine's ``_width``)

    @property
    def stats(self) -> Stats:
        return self.sink.stats

    def transform(self, logits: np.ndarray, start: int) -> np.ndarray:
        """Raw logits [n, V] whose row i predicts seq[start + i], with the request's penalties
        and then the row's grammar mask applied from that row's prefix (a float64 copy), or
        ``logits`` itself when there are neither."""
        req = self.req
        if req.penalties is None and self.grammar is None:
            return logits
        if req.penalties is None:
            out = np.array(logits, dtype=np.float64)  # [n, V]
        else:
            out = penalize_chain(logits, req.penalties, req.prompt_seen, self.seq, len(req.prompt), start)
        return out if self.grammar is None else self.grammar.mask_chain(out, self.seq, start)

    def transform_tree(self, logits: np.ndarray, tokens: Sequence[int], parents: Sequence[int]) -> np.ndarray:
        """``transform`` for a tree call's logits [n + 1, V] (row 0 the root, predicting
        seq[length]; row i + 1 the children of node i)."""
        req = self.req
        if req.penalties is None and self.grammar is None:
            return logits
        if req.penalties is None:
            out = np.array(logits, dtype=np.float64)  # [n + 1, V]
        else:
            out = penalize_tree(logits, req.penalties, req.prompt_seen, self.seq, len(req.prompt), self.length, tokens, parents)
        return out if self.grammar is None else self.grammar.mask_tree(out, self.seq, self.length, tokens, parents)
