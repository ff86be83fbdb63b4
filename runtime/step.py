"""One speculative step over the rows in flight, and the plain-data plan that says what each row does.

    schedule(rows) -> Plan          which rows feed a prompt chunk, which decode and with what γ
    speculative_step(rows, γs, proposer, target):
        propose:  per row a draft: a chain of k tokens at seq[L:L+k] (its q rows at q[:k]), or a
                  tree (``tree.DraftTree``); a grammar's forced tokens are a chain, whatever the drafter
        verify:   the chains in ONE target call (row r feeds [last_r, x_1..x_k_r] -> p_1..p_{k_r+1});
                  a tree in one tree call of its own ([last_r, its nodes], each seeing its ancestors)
        accept:   Algorithm 1 along a chain, recursive rejection over a tree's siblings, each row with
                  its own sampling settings, lenience and generator
        commit:   the target keeps the rows of what was kept; the proposer sees what was kept

A chain is the tree of width 1 whose nodes lie where they will be committed: the shape is data
the step reads, so forced spans, penalties, constraints, lenience, logprobs and the stats hold for
every drafter. Chains are kept apart only because they share one batched call.

Invariant between steps, for a row with L committed tokens seq[:L]: the target's slot holds
rows for seq[:L-1] (seq[L-1] is fed by the next call). Rows written past a slot's length
(rejected drafts, padding) are never read: every call overwrites from the committed length.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, NamedTuple, Sequence

import numpy as np

from specdec.runtime.logprobs import score, score_probs
from specdec.runtime.lookup import one_hot
from specdec.runtime.row import Row
from specdec.runtime.sampling import standardize
from specdec.runtime.speculative import accept, synthetic_accept
from specdec.runtime.tree import DraftTree, depths, sibling_ranks, verify_tree, verify_tree_greedy
from specdec.runtime.stats import Iteration

if TYPE_CHECKING:
    from specdec.engines.executor import Executor
    from specdec.runtime.proposers import Proposer

clock = time.perf_counter

Draft = int | DraftTree  # a chain of k tokens at seq[L:L+k] (q rows at q[:k]), or a tree


class Plan(NamedTuple):
    """What one step does: prompt chunks to feed, then rows to decode with their γ."""

    prefill: list[tuple[int, int, int]]  # (slot, start, stop): feed seq[start:stop] of that slot
    decode: list[tuple[int, int]]  # (slot, γ): 0 is a plain target step


class Kept(NamedTuple):
    """What verification kept of one row's draft."""

    drafted: int  # positions drafted: a chain's k, a tree's depth
    accepted: int  # draft tokens kept (the target's own token follows them)
    ranks: tuple[int, ...] | None = None  # a tree's kept nodes' sibling ranks (None: a chain)
    tested: int | None = None  # a tree's positions where candidates were tested


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
    """Propose, verify, accept and commit, for every row (the module docstring); returns what each
    row's iteration did. ``row.length`` is left to the caller (it emits what was kept).
    ``synthetic``: benchmarks only, keep each chain token with that probability instead
    (``speculative.synthetic_accept``; the output is then not the target's)."""
    t0, calls = clock(), proposer.calls
    drafts = propose(rows, gammas, proposer, target)
    t1 = clock()
    kept: list[Kept] = [Kept(0, 0)] * len(rows)
    chains = [i for i, d in enumerate(drafts) if isinstance(d, int)]
    timed = [0.0, 0.0]  # target, acceptance seconds
    if chains:
        logits = target.forward([rows[i].slot for i in chains], [rows[i].seq[rows[i].length - 1 : rows[i].length + drafts[i]] for i in chains])  # [n, S, V]
        tb = clock()
        for j, i in enumerate(chains):
            kept[i] = accept_chain(rows[i], drafts[i], logits[j, : drafts[i] + 1], target, synthetic)
        timed[0], timed[1] = tb - t1, clock() - tb
    for i, d in enumerate(drafts):
        if not isinstance(d, int):
            kept[i] = verify_row_tree(rows[i], d, target, timed)
    proposer.commit(rows, [k.accepted for k in kept])
    draft_calls = proposer.calls - calls
    return [Iteration(k.drafted, k.accepted, draft_calls, t1 - t0, timed[0], timed[1], k.ranks, k.tested) for k in kept]


def propose(rows: Sequence[Row], gammas: Sequence[int], proposer: Proposer, target: Executor) -> list[Draft]:
    """Each row's draft: the grammar's forced tokens where they make a better draft than the
    drafter's (the drafter then drafts nothing for the row, at no draft cost), else the
    proposer's; an empty tree is a chain of 0 (a plain target step). A tree drafter drafts
    nothing for a row whose tree would not fit the tree call's rows past its length."""
    spans = [forced_span(r, g, len(r.q)) for r, g in zip(rows, gammas)]  # q: [the bundle's γ, V]
    room = target.cache.max_seq - target.tree_runner.capacity + 1 if getattr(proposer, "tree", False) else target.cache.max_seq  # a tree call writes `capacity` rows from L - 1
    drafts = proposer.propose(rows, [0 if f or r.length > room else g for r, f, g in zip(rows, spans, gammas)])
    for i, (r, f) in enumerate(zip(rows, spans)):
        if f:
            drafts[i] = len(f)
            r.seq[r.length : r.length + len(f)] = f
            if not r.req.sampling.greedy:
                one_hot(r.q, r.seq[r.length : r.length + len(f)])
        elif not isinstance(drafts[i], int) and not drafts[i].tokens:
            drafts[i] = 0
    return drafts


def forced_span(r: Row, gamma: int, room: int) -> list[int]:
    """The tokens a constrained row's grammar forces next, when they make a better draft than
    the drafter's: two or more, or any for a row drafting nothing (γ = 0); at most ``room``
    (the verify call's drafts) and the row's budget less its bonus token."""
    if r.grammar is None:
        return []
    f = r.grammar.forced(r.seq, r.length, min(room, r.left - 1))
    return f if len(f) >= 2 or (f and gamma == 0) else []


def accept_chain(r: Row, k: int, raw: np.ndarray, target: Executor, synthetic: float | None) -> Kept:
    """Algorithm 1 on row ``r``'s chain of ``k`` drafts against the target's logits ``raw``
    [k + 1, V] (row j predicts seq[L + j]); the target keeps the rows of the kept tokens."""
    L = r.length
    rows_p = r.transform(raw, L)  # [k + 1, V]: with the request's penalties and grammar
    if synthetic is None:
        n, token = accept(r.seq[L : L + k], r.q[:k], rows_p, r.req.sampling, r.rng, r.req.lenience)
    else:
        n, token = synthetic_accept(r.seq[L : L + k], r.q[:k], rows_p, r.req.sampling, r.rng, synthetic)
    target.commit(r.slot, n + 1)  # rows for seq[L-1] and x_1..x_n
    r.seq[L + n] = token
    if r.req.params.logprobs is not None:
        r.scored = scored(r, raw[: n + 1], rows_p[: n + 1], r.seq[L : L + n + 1])
    return Kept(k, n)


def verify_row_tree(r: Row, tree: DraftTree, target: Executor, timed: list[float]) -> Kept:
    """Row ``r``'s tree in one tree call over [seq[L-1], its nodes] (the last committed token is
    the root), verified by recursive rejection over siblings (runtime/tree.py; with the
    request's lenience), the accepted path's KV rows kept in place (``Executor.keep``). Adds
    its target and acceptance seconds to ``timed``. ``drafted`` is the tree's depth (the
    positions it drafted, as a chain's k), so per-position acceptance means per depth."""
    L, cfg, (tokens, parents, q) = r.length, r.req.sampling, tree
    ta = clock()
    raw = target.tree(r.slot, [int(r.seq[L - 1]), *tokens], [-1, *(p + 1 for p in parents)])  # [n + 1, V]: row 0 the root
    tb = clock()
    nodes, links = np.asarray(tokens, dtype=np.int64), np.asarray(parents, dtype=np.int64)
    logits = r.transform_tree(raw, tokens, parents)  # penalties and grammar, each row with its own node's prefix
    if cfg.greedy:
        v = verify_tree_greedy(nodes, links, logits, r.req.lenience)
    else:
        v = verify_tree(nodes, links, q, standardize(logits, cfg), r.rng, r.req.lenience)
    target.keep(r.slot, [L - 1, *(L + i for i in v.path)])  # the root's row and the path's
    r.seq[L : L + len(v.path)] = [tokens[i] for i in v.path]
    r.seq[L + len(v.path)] = v.token
    if r.req.params.logprobs is not None:  # each kept token was predicted by its parent's row (the root's: 0)
        at = [0, *(i + 1 for i in v.path)]
        r.scored = scored(r, raw[at], logits[at], r.seq[L : L + len(v.path) + 1])
    rank = sibling_ranks(parents)
    last = v.path[-1] if v.path else -1  # the path's end (-1: the root); its children, if any, were tested too
    timed[0] += tb - ta
    timed[1] += clock() - tb
    return Kept(max(depths(parents)), len(v.path), tuple(rank[i] for i in v.path), len(v.path) + (last in parents))


def scored(r: Row, raw: np.ndarray, transformed: np.ndarray, tokens: np.ndarray) -> list:
    """The logprobs of ``tokens``, row i of raw [n, V] / transformed [n, V] (the same logits with
    the request's penalties) predicting tokens[i], in the request's ``logprobs_mode``."""
    k = r.req.params.logprobs
    if r.req.params.logprobs_mode == "processed":
        return score_probs(standardize(transformed, r.req.sampling), tokens, k)
    return score(raw, tokens, k)
