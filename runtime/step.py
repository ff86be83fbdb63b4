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

from specdec.runtime.logprobs import score, score_probs
from specdec.runtime.lookup import one_hot
from specdec.runtime.request import Request
from specdec.runtime.sampling import standardize
from specdec.runtime.speculative import accept, synthetic_accept
from specdec.runtime.tree import EMPTY_TREE, depths, sibling_ranks, verify_tree, verify_tree_greedy
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
    scored: list | None = None  # with logprobs asked: the last iteration's TokenLogprob per kept token

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


def speculative_step(rows: Sequence[Row], gammas: Sequence[int], proposer: Proposer, target: Executor,
                     synthetic: float | None = None) -> list[Iteration]:  # fmt: skip
    """Propose, verify in one target call, accept and commit, for every row; returns what each
    row's iteration did. ``row.length`` is left to the caller (it emits what was kept).
    ``synthetic``: benchmarks only, keep each draft token with that probability instead
    (``speculative.synthetic_accept``; the output is then not the target's)."""
    t0, calls = clock(), proposer.calls
    spans = [forced_span(r, g, len(r.q)) for r, g in zip(rows, gammas)]  # q: [the bundle's γ, V]
    ks = proposer.propose(rows, [0 if f else g for f, g in zip(spans, gammas)])  # x_1..x_k at seq[L:L+k]
    for i, (r, f) in enumerate(zip(rows, spans)):
        if f:  # the grammar's forced tokens are this row's draft, at no draft cost
            ks[i] = len(f)
            r.seq[r.length : r.length + len(f)] = f
            if not r.req.sampling.greedy:
                one_hot(r.q, r.seq[r.length : r.length + len(f)])
    t1 = clock()
    logits = target.forward([r.slot for r in rows], [r.seq[r.length - 1 : r.length + k] for r, k in zip(rows, ks)])  # [n, S, V]
    t2 = clock()
    kept = []
    for i, (r, k) in enumerate(zip(rows, ks)):
        rows_p = r.req.transform(logits[i, : k + 1], r.seq, r.length)  # [k + 1, V]: row j predicts seq[L + j]
        if synthetic is None:
            n, token = accept(r.seq[r.length : r.length + k], r.q[:k], rows_p, r.req.sampling, r.rng, r.req.lenience)
        else:
            n, token = synthetic_accept(r.seq[r.length : r.length + k], r.q[:k], rows_p, r.req.sampling, r.rng, synthetic)
        target.commit(r.slot, n + 1)  # rows for seq[L-1] and x_1..x_n
        r.seq[r.length + n] = token
        if r.req.params.logprobs is not None:
            r.scored = scored(r, logits[i, : n + 1], rows_p[: n + 1], r.seq[r.length : r.length + n + 1])
        kept.append(n)
    proposer.commit(rows, kept, logits)
    t3 = clock()
    draft_calls = proposer.calls - calls
    return [Iteration(k, n, draft_calls, t1 - t0, t2 - t1, t3 - t2) for k, n in zip(ks, kept)]


def forced_span(r: Row, gamma: int, room: int) -> list[int]:
    """The tokens a constrained row's grammar forces next, when they make a better draft than
    the drafter's: two or more, or any for a row drafting nothing (γ = 0); at most ``room``
    (the verify call's drafts) and the row's budget less its bonus token."""
    if r.req.grammar is None:
        return []
    f = r.req.grammar.forced(r.seq, r.length, min(room, r.left - 1))
    return f if len(f) >= 2 or (f and gamma == 0) else []


def scored(r: Row, raw: np.ndarray, transformed: np.ndarray, tokens: np.ndarray) -> list:
    """The logprobs of ``tokens``, row i of raw [n, V] / transformed [n, V] (the same logits with
    the request's penalties) predicting tokens[i], in the request's ``logprobs_mode``."""
    k = r.req.params.logprobs
    if r.req.params.logprobs_mode == "processed":
        return score_probs(standardize(transformed, r.req.sampling), tokens, k)
    return score(raw, tokens, k)


def tree_step(rows: Sequence[Row], gammas: Sequence[int], proposer, target: Executor) -> list[Iteration]:
    """``speculative_step`` for a drafter that proposes trees (``proposer.propose_trees``): per
    row ONE target call over [seq[L-1], the tree's nodes] (the tree graph; the last committed
    token is the root), verification by recursive rejection over siblings (runtime/tree.py; each
    node a fixed candidate), and the accepted path's KV rows kept in place (``Executor.keep``).
    A row with an empty tree takes a plain target step. Rows run one call each: there is no
    batched tree graph yet. An iteration's ``drafted`` is the tree's depth (the positions it
    drafted, as a chain's γ), so per-position acceptance means per depth."""
    t0, calls = clock(), proposer.calls
    room = target.cache.max_seq - target.tree_runner.capacity + 1  # a tree call writes `capacity` rows from L - 1
    trees = [t if r.length <= room else EMPTY_TREE for r, t in zip(rows, proposer.propose_trees(rows, gammas))]
    t1 = clock()
    target_s = accept_s = 0.0
    kept, sizes, ranks, tested = [], [], [], []
    for r, (tokens, parents, q) in zip(rows, trees):
        L, cfg = r.length, r.req.sampling
        ta = clock()
        if tokens:
            logits = target.tree(r.slot, [int(r.seq[L - 1]), *tokens], [-1, *(p + 1 for p in parents)])  # [n + 1, V]: row 0 the root
        else:
            logits = target.forward([r.slot], [r.seq[L - 1 : L]])[0]  # [1, V]
        tb = clock()
        nodes, tree_parents = np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64)
        raw = logits
        logits = r.req.transform_tree(raw, r.seq, L, tokens, parents)  # penalties and grammar, each row with its own node's prefix
        if cfg.greedy:
            v = verify_tree_greedy(nodes, tree_parents, logits)
        else:
            v = verify_tree(nodes, tree_parents, q, standardize(logits, cfg), r.rng)
        if tokens:
            target.keep(r.slot, [L - 1, *(L + i for i in v.path)])  # the root's row and the path's
        else:
            target.commit(r.slot, 1)
        r.seq[L : L + len(v.path)] = [tokens[i] for i in v.path]
        r.seq[L + len(v.path)] = v.token
        if r.req.params.logprobs is not None:  # each kept token was predicted by its parent's row (the root's: 0)
            at = [0, *(i + 1 for i in v.path)]
            r.scored = scored(r, raw[at], logits[at], r.seq[L : L + len(v.path) + 1])
        kept.append(len(v.path))
        sizes.append(max(depths(parents), default=0))  # the positions it drafted
        rank = sibling_ranks(parents)
        ranks.append(tuple(rank[i] for i in v.path))
        last = v.path[-1] if v.path else -1  # the path's end (-1: the root); its children, if any, were tested too
        tested.append(len(v.path) + (last in parents) if tokens else 0)
        target_s += tb - ta
        accept_s += clock() - tb
    proposer.commit(rows, kept, None)
    draft_calls = proposer.calls - calls
    return [Iteration(k, n, draft_calls, t1 - t0, target_s, accept_s, rk, t) for k, n, rk, t in zip(sizes, kept, ranks, tested)]
