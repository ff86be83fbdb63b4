"""One speculative step over the rows in flight, and the plain-data plan that says what each row does.

    schedule(rows) -> Plan          which rows feed a prompt chunk, which decode and with what γ
    speculative_step(rows, γs, proposer, target):
        propose:  the proposer writes x_1..x_k at seq[L:L+k] of every row (and its q rows)
        verify:   ONE target call: row r feeds [last_r, x_1..x_k_r] -> p_1..p_{k_r+1}
        accept:   Algorithm 1 per row, with its own sampling settings and generator
        commit:   the target keeps n_r + 1 rows per slot; the proposer sees what was kept

Invariant between steps, for a row with L committed tokens seq[:L]: the target's slot holds
rows for seq[:L-1] (seq[L-1] is fed by the next call). Rows written past a slot's length
(rejected drafts, padding) are never read: every call overwrites from the committed length.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import numpy as np

from specdec.runtime.request import Request
from specdec.runtime.speculative import accept
from specdec.runtime.stats import Iteration, Stats

if TYPE_CHECKING:
    from specdec.engines.executor import Executor
    from specdec.runtime.handles import Handle
    from specdec.runtime.proposers import Proposer

clock = time.perf_counter


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

    @property
    def stats(self) -> Stats:
        return self.sink.stats


class Plan(NamedTuple):
    """What one step does: prompt chunks to feed, then rows to decode with their γ."""

    prefill: list[tuple[int, int, int]]  # (slot, start, stop): feed seq[start:stop] of that slot
    decode: list[tuple[int, int]]  # (slot, γ): 0 is a plain target step


def schedule(rows: Sequence[Row], fed: Callable[[int], int], chunk: int | None, width: Callable[[list[Row]], int]) -> Plan:
    """The step plan for ``rows``. A joining row feeds prompt[:-1] (``fed(slot)`` tokens are in
    already) ``chunk`` tokens per step (None: all at once), and decodes in the step that feeds
    its last chunk. γ: the request's, or for adaptive rows ``width(the decoding rows)``, never past
    the row's budget (the bonus token is always emitted)."""
    prefill, decoding = [], []
    for r in rows:
        if not r.ready:
            done, end = fed(r.slot), r.length - 1
            stop = end if chunk is None else min(end, done + chunk)
            if done < stop:
                prefill.append((r.slot, done, stop))
            if stop < end:
                continue
        decoding.append(r)
    w = width(decoding) if any(r.req.adaptive for r in decoding) else 0
    return Plan(prefill, [(r.slot, min(w if r.req.adaptive else r.req.gamma, r.left - 1)) for r in decoding])


def speculative_step(rows: Sequence[Row], gammas: Sequence[int], proposer: Proposer, target: Executor) -> list[Iteration]:
    """Propose, verify in one target call, accept and commit, for every row; returns what each
    row's iteration did. ``row.length`` is left to the caller (it emits what was kept)."""
    t0, calls = clock(), proposer.calls
    ks = proposer.propose(rows, gammas)  # x_1..x_k at seq[L:L+k]
    t1 = clock()
    logits = target.forward([r.slot for r in rows], [r.seq[r.length - 1 : r.length + k] for r, k in zip(rows, ks)])  # [n, S, V]
    t2 = clock()
    kept = []
    for i, (r, k) in enumerate(zip(rows, ks)):
        n, token = accept(r.seq[r.length : r.length + k], r.q[:k], logits[i, : k + 1], r.req.sampling, r.rng, r.req.lenience)
        target.commit(r.slot, n + 1)  # rows for seq[L-1] and x_1..x_n
        r.seq[r.length + n] = token
        kept.append(n)
    proposer.commit(rows, kept, logits)
    t3 = clock()
    draft_calls = proposer.calls - calls
    return [Iteration(k, n, draft_calls, t1 - t0, t2 - t1, t3 - t2) for k, n in zip(ks, kept)]
