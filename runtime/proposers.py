"""Proposers: what drafts for every row of a step, batched.

    start(row)                       a row is fed and about to decode (seq[:L] is its prompt)
    propose(rows, gammas) -> drafts  per row a chain: k_r <= γ_r tokens written at seq[L:L+k_r]
                                     (unless sampling is greedy, the q rows they were drawn from
                                     at q[:k_r]), or a tree of at most γ_r levels
                                     (``tree.DraftTree``; such a proposer has ``tree = True``)
    commit(rows, accepted)           the target kept n_r of row r's drafted positions (its token
                                     at seq[L+n_r])

Two kinds:
- ``DraftModel``: the bundle's draft model over its own ``Executor``, all rows in one call per
  draft step, or, where the bundle has fused draft graphs and a row drafts their γ, one call
  for all γ steps (export/fused.py). "model" uses the fused graphs, "model-steps" never does.
- ``PerRow``: today's per-sequence drafters (``drafters.Drafter``: prompt lookup, n-gram
  tables, the hierarchical drafter, a user's own object), one per slot.

Draft-cache invariant (``DraftModel``): the slot holds rows for seq[:length(slot)];
seq[length:L] (1 token, or 2 after a fully accepted call, or more after plain steps) is fed
by the next draft call. A backlog longer than a batched call takes is caught up alone first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol, Sequence

import numpy as np

from specdec.runtime.lookup import lookup_chain, lookup_tree
from specdec.runtime.sampling import draw, draw_within, sample, standardize, support_of
from specdec.runtime.speculative import verify, verify_greedy
from specdec.runtime.tree import EMPTY_TREE, DraftTree

if TYPE_CHECKING:
    from specdec.engines.executor import Executor
    from specdec.runtime.row import Row


class Proposer(Protocol):
    name: str
    calls: int  # draft steps so far (a fused call counts its γ), for the stats and adaptive γ

    def start(self, row: Row) -> None: ...

    def propose(self, rows: Sequence[Row], gammas: Sequence[int]) -> list[int | DraftTree]: ...

    def commit(self, rows: Sequence[Row], accepted: Sequence[int]) -> None: ...


class DraftModel:
    """The bundle's draft model for all rows (see the module docstring)."""

    def __init__(self, draft: Executor, fused: bool = True):
        self.draft, self.use_fused = draft, fused
        runners = list(draft.fused_runners.values()) if fused else []
        self.fused_steps = runners[0].gamma if runners else 0  # the draft steps a fused graph runs (0: none)
        self.name = "model" if fused else "model-steps"

    @property
    def calls(self) -> int:
        return self.draft.calls

    def start(self, row: Row) -> None:
        pass  # the engine fed the prompt to the draft's slot with the target's

    def propose(self, rows: Sequence[Row], gammas: Sequence[int]) -> list[int]:
        max_seq = self.draft.cache.max_seq
        fused = [r for r, g in zip(rows, gammas) if g == self.fused_steps and r.length + g <= max_seq and r.req.fusable] if self.fused_steps else []
        runner = self.draft.fused(len(fused), all(r.req.sampling.greedy for r in fused)) if fused else None
        if runner is None:
            fused = []
        else:
            self._propose_fused(fused, runner)
        done = {id(r) for r in fused}
        stepping = [(r, g) for r, g in zip(rows, gammas) if g and id(r) not in done]
        for j in range(max((g for _, g in stepping), default=0)):
            step = [r for r, g in stepping if g > j]
            feeds = [self._feed(r, r.length + j, len(step)) for r in step]
            logits = self.draft.forward([r.slot for r in step], feeds)  # [n, S, V]
            for i, (r, feed) in enumerate(zip(step, feeds)):
                self.draft.commit(r.slot, len(feed))
                row = r.transform(logits[i, len(feed) - 1 : len(feed)], r.length + j)[0]  # [V]: predicts seq[L + j]
                r.seq[r.length + j] = draw(row, r.req.sampling, r.rng, r.q[j])
        return list(gammas)

    def _propose_fused(self, rows: list[Row], runner) -> None:
        """γ proposals for every row in one fused call, after one call feeding the rows whose slot
        is more than one token behind (those whose last call accepted all)."""
        behind = [(r, f) for r in rows if len(f := self._feed(r, r.length, len(rows))[:-1])]  # all but the last token
        if behind:
            self.draft.forward([r.slot for r, _ in behind], [f for _, f in behind])
            for r, f in behind:
                self.draft.commit(r.slot, len(f))
        tokens = runner.run([r.slot for r in rows], [r.seq[r.length - 1] for r in rows], [r.req.sampling for r in rows], [r.rng for r in rows])
        g = runner.gamma
        self.draft.calls += g  # steps, as the stepped path counts them
        for i, r in enumerate(rows):
            r.seq[r.length : r.length + g] = tokens[i]
            self.draft.commit(r.slot, g)  # rows for seq[L-1] and the first γ - 1 proposals
            if runner.sampling and not r.req.sampling.greedy:
                r.q[:g] = runner.probs[i]

    def _feed(self, r: Row, end: int, rows: int) -> np.ndarray:
        """What the draft is fed up to position ``end`` in a call of ``rows`` rows: the tokens its
        slot has not seen. A backlog longer than the call takes (after plain steps, or spans a
        grammar forced) is caught up alone first, in pieces a lone row's call takes."""
        done, limit = self.draft.length(r.slot), self.draft.feed_limit(rows)
        if limit is not None and end - done > limit:
            piece = self.draft.feed_limit(1) or end
            while done < end - 1:
                stop = min(end - 1, done + piece)
                self.draft.forward([r.slot], [r.seq[done:stop]])
                self.draft.commit(r.slot, stop - done)
                done = stop
        return r.seq[done:end]

    def commit(self, rows: Sequence[Row], accepted: Sequence[int]) -> None:
        for r, n in zip(rows, accepted):
            self.draft.rewind_to(r.slot, min(self.draft.length(r.slot), r.length + n))


class Hierarchical(DraftModel):
    """The draft model checking prompt lookup's guesses (paper §3.6's hierarchy): per row, lookup
    guesses the draft's next tokens; the draft model checks them in one call with speculative
    sampling against its own q (Algorithm 1 one level down) and adds its own next token. What
    it emits is distributed exactly as the draft model's own samples, so the q rows handed to
    the target are the draft's and the target level stays exact. Rows are drafted one at a time.

    The draft model's feeding, rewinds and the request's penalties and grammar are
    ``DraftModel``'s; the draft-cache invariant is the same."""

    def __init__(self, draft: Executor, gamma: int, vocab: int, max_ngram: int = 3, min_ngram: int = 1):
        super().__init__(draft, fused=False)
        self.name = "hierarchical(lookup)"
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.guesses = np.zeros((gamma, vocab), dtype=np.float64)  # [γ, V]: lookup's one-hot rows

    def propose(self, rows: Sequence[Row], gammas: Sequence[int]) -> list[int]:
        for r, g in zip(rows, gammas):
            cur = r.length  # the next position to fill
            while cur < r.length + g:
                cur += self._check(r, cur, r.length + g - cur)
        return list(gammas)

    def _check(self, r: Row, cur: int, room: int) -> int:
        """One draft-model call at position ``cur``: lookup guesses up to room - 1 tokens there,
        the draft keeps m of them and draws its own next token; returns m + 1 (all within ``room``)."""
        cfg, slot, L = r.req.sampling, r.slot, r.length
        guesses = None if cfg.greedy else self.guesses
        h = lookup_chain(r.seq, cur, room - 1, guesses, self.max_ngram, self.min_ngram, r.req.source) if room > 1 else 0
        feed = r.seq[self.draft.length(slot) : cur + h]  # a lone row's call: the dynamic graph takes any length
        logits = self.draft.forward([slot], [feed])[0, len(feed) - h - 1 : len(feed)]  # [h + 1, V]: the draft's rows at cur..cur+h
        self.draft.commit(slot, len(feed))
        rows = r.transform(logits, cur)
        if cfg.greedy:
            m, token = verify_greedy(r.seq[cur : cur + h], rows)
        else:
            p = standardize(rows, cfg)  # [h + 1, V]
            m, token = verify(r.seq[cur : cur + h], self.guesses[:h], p, r.rng)
            r.q[cur - L : cur - L + m + 1] = p[: m + 1]  # m <= h <= room - 1: all fit
        r.seq[cur + m] = token
        self.draft.rewind_to(slot, cur + m)  # rows for the guesses kept; the draft's own token is not fed yet
        return m + 1


class PerRow:
    """Per-sequence drafters (the ``Drafter`` interface), one per slot, behind the batched interface."""

    def __init__(self, drafters: Sequence):  # drafters.Drafter objects
        self.drafters = list(drafters)
        self.name = self.drafters[0].name

    @property
    def calls(self) -> int:
        return sum(d.calls for d in self.drafters)

    def start(self, row: Row) -> None:
        d = self.drafters[row.slot]
        if row.req.source is not None and hasattr(d, "use_source"):
            d.use_source(row.req.source)
        d.start(row.seq, row.length)

    def propose(self, rows: Sequence[Row], gammas: Sequence[int]) -> list[int]:
        return [self.drafters[r.slot].propose(r.seq, r.length, g, r.req.sampling, r.rng, r.q) if g else 0 for r, g in zip(rows, gammas)]

    def commit(self, rows: Sequence[Row], accepted: Sequence[int]) -> None:
        for r, n in zip(rows, accepted):
            self.drafters[r.slot].commit(r.seq, r.length, n)


class LookupTree:
    """Prompt lookup as a tree for every row (``runtime.lookup.lookup_tree``): the continuations of
    every earlier occurrence of the context's last tokens, as a trie of up to ``nodes`` nodes
    and γ levels. Every node is a fixed candidate, so verification keeps the target's law."""

    name = "lookup-tree"
    tree = True

    def __init__(self, nodes: int):
        self.nodes, self.calls = nodes, 0

    def start(self, row: Row) -> None:
        pass

    def propose(self, rows: Sequence[Row], gammas: Sequence[int]) -> list[DraftTree]:
        self.calls += 1
        return [lookup_tree(r.seq, r.length, self.nodes, g) if g else EMPTY_TREE for r, g in zip(rows, gammas)]

    def commit(self, rows: Sequence[Row], accepted: Sequence[int]) -> None:
        pass


class FeatureHead:
    """The feature drafter (EAGLE-style, export/head.py): a one-layer head over the target's own
    features drafts γ tokens per row, one head call per token.

    Head-cache invariant, for a row with L committed tokens: the head's slot holds rows for
    positions [0, length) fed with the target's true features (position j reads the target's
    feature of j - 1, ``target.store[slot, j]``); seq[length:L] is fed by the next call, whose
    last row gives the head's feature h and the distribution of token L. Each further draft
    feeds the drafted token with the head's own h as context. After verification the rows fed
    with predicted features (positions >= L) are dropped: a rewind, O(1).

    Rows are drafted one at a time (no batched head graph yet); every token is drawn from the
    head's distribution with the row's sampling settings, so acceptance is Algorithm 1's.

    ``stop_below`` (the manifest drafter's "stop_below", 0: off) ends a row's chain early: after
    a draft whose probability under the head (q of the token drawn; greedy, the top token's
    softmax) is below it, the row drafts no further this call, so γ is the most a call drafts.
    Where the head is unsure its later drafts rarely hold, and each costs a head call and a
    verify row. Whether to stop depends on the head's own draws alone, so every draft is still
    kept with probability min(1, p/q) and the output keeps the target's law.
    """

    name = "feature"

    def __init__(self, head: Executor, target: Executor, stop_below: float = 0.0, first: int = 0):
        if target.store is None:
            raise ValueError("the feature drafter needs a target whose graphs return features (specdec train-drafter adds them)")
        self.head, self.target, self.stop_below = head, target, stop_below
        self.first = first  # the first position the head reads (its cache row 0): 1 for EAGLE-3 heads (export/eagle3.py)
        self.support: np.ndarray | None = None  # [V'] the head's draft vocabulary, read off its first logits row
        self.learned = False

    @property
    def calls(self) -> int:
        return self.head.calls

    def start(self, row: Row) -> None:
        self.head.reset(row.slot)

    def propose(self, rows: Sequence[Row], gammas: Sequence[int]) -> list[int]:
        return [self.chain(r, g, lambda j, logits, r=r: self.draw(logits, r, r.q[j]), self.stop_below) if g else 0
                for r, g in zip(rows, gammas)]  # fmt: skip

    def draw(self, logits: np.ndarray, r: Row, q: np.ndarray) -> int:
        """Row ``r``'s token from the head's logits [V], q [V] what it was drawn from; over the
        head's draft vocabulary alone when it has one (the other tokens are NEVER)."""
        if self.support is None:
            return draw(logits, r.req.sampling, r.rng, q)
        return draw_within(logits, self.support, r.req.sampling, r.rng, q)

    def chain(self, r: Row, depth: int, choose, stop_below: float = 0.0) -> int:
        """Draft up to ``depth`` tokens at seq[L:L+depth] of row ``r``: ``choose(j, logits [V])``
        picks token L + j from the head's logits, and the head is fed it for the next; a draft
        whose ``confidence`` is below ``stop_below`` is the last. Returns how many it drafted."""
        head, store = self.head, self.target.store
        s, L, done = r.slot, r.length, head.length(r.slot) + self.first
        if done >= L:  # nothing the head may read yet (an EAGLE-3 head after a one-token prompt)
            return 0
        logits = head.forward([s], [r.seq[done:L]], store[s, done:L])[0, L - done - 1]  # [V]: token L
        head.commit(s, L - done)
        if not self.learned:  # the draft vocabulary is the graph's: the same in every row it returns
            self.support, self.learned = support_of(logits), True
        for j in range(depth):
            row = r.transform(logits[None], L + j)[0]  # [V]: with the penalties of seq[:L + j]
            r.seq[L + j] = choose(j, row)
            if j + 1 == depth or stop_below and self.confidence(row, r, j) < stop_below:
                return j + 1
            logits = head.forward([s], [r.seq[L + j : L + j + 1]], head.features[-1:])[0, 0]  # context: the head's last h
            head.commit(s, 1)
        return depth

    def confidence(self, logits: np.ndarray, r: Row, j: int) -> float:
        """The head's probability of row ``r``'s draft j, drawn from ``logits`` [V]: q of it when
        sampled (``draw`` wrote q), the top token's softmax when greedy (over the draft vocabulary)."""
        if not r.req.sampling.greedy:
            return float(r.q[j, r.seq[r.length + j]])
        x = logits if self.support is None else logits[self.support]  # [V']
        top = x.max()
        return 1.0 / float(np.exp(x - top).sum()) if np.isfinite(top) else 1.0

    def commit(self, rows: Sequence[Row], accepted: Sequence[int]) -> None:
        for r in rows:
            self.head.rewind_to(r.slot, max(0, min(self.head.length(r.slot), r.length - self.first)))


class FeatureTree(FeatureHead):
    """The feature head as a tree drafter: along the head's chain (γ levels), each level also
    offers further tokens of the head's distribution as siblings, ``width`` per level with
    width = nodes // γ (a chain when that is 1), the tree within the target's tree graph. The
    head costs what the chain costs: the siblings come from distributions it computed anyway.

    Greedy rows take the head's top-``width`` tokens, fixed candidates. Sampled rows draw the
    level's tokens from the head's distribution q (standardized with the row's settings)
    *without replacement*: sibling i is drawn from q with siblings 0..i-1 removed (q_i), and
    q_i is what verification tests it against (``runtime/tree.py``: each proposal depends on
    the draft alone, so recursive rejection keeps the target's law). Fixed top-k candidates
    would be kept only with probability p(x) at T > 0; drawn ones keep Algorithm 1's
    acceptance. The chain goes on from sibling 0, a plain draw from q."""

    name = "feature-tree"
    tree = True

    def __init__(self, head: Executor, target: Executor, nodes: int, vocab: int, first: int = 0):
        super().__init__(head, target, first=first)
        self.nodes = nodes
        self.q = np.zeros((target.slots, nodes, vocab), dtype=np.float64)  # [slots, N, V]: each node's proposal

    def propose(self, rows: Sequence[Row], gammas: Sequence[int]) -> list[DraftTree]:
        return [self.tree_for(r, min(g, self.nodes)) if g else EMPTY_TREE for r, g in zip(rows, gammas)]

    def tree_for(self, r: Row, depth: int) -> DraftTree:
        width = max(1, self.nodes // depth)
        cfg, q = r.req.sampling, self.q[r.slot]
        tokens: list[int] = []
        parents: list[int] = []
        level = [0]  # the index of the current level's first node

        def choose(j: int, logits: np.ndarray) -> int:
            parent, level[0] = (level[0] if j else -1), len(tokens)
            if cfg.greedy:
                top = np.argpartition(-logits, width - 1)[:width] if width > 1 else np.array([int(logits.argmax())])
                picks = top[np.argsort(-logits[top], kind="stable")].tolist()  # the chain's token first
            else:
                picks = []
                for i in range(width):  # without replacement: q_i = q minus the earlier picks, renormalized
                    n = len(tokens) + i
                    if i == 0:
                        picks.append(self.draw(logits, r, q[n]))
                        continue
                    np.copyto(q[n], q[n - 1])
                    q[n, picks[-1]] = 0.0
                    total = q[n].sum()
                    if total <= 0:  # fewer tokens with mass than width
                        break
                    q[n] /= total
                    picks.append(int(sample(q[n], r.rng)))
            tokens.extend(picks)
            parents.extend([parent] * len(picks))
            return picks[0]

        self.chain(r, depth, choose)
        return DraftTree(tokens, parents, None if cfg.greedy else q[: len(tokens)])


class FeatureLookup(FeatureHead):
    """Prompt lookup first, the feature head elsewhere: where the context's last ``min_ngram``
    or more tokens occurred before in the row (up to ``max_ngram`` matched), the γ tokens that
    followed the latest occurrence are proposed (a deterministic proposal: q one-hot);
    elsewhere the head drafts γ tokens. Which of the two drafts depends on the context alone,
    so each proposal's q is its true law and verification keeps the target's. A step drafted
    by lookup skips the head: its next call feeds every position it has not seen, with the
    target's features (``FeatureHead.chain``)."""

    name = "feature-lookup"

    def __init__(self, head: Executor, target: Executor, min_ngram: int = 2, max_ngram: int = 3, stop_below: float = 0.0, first: int = 0):
        super().__init__(head, target, stop_below, first)
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    def propose(self, rows: Sequence[Row], gammas: Sequence[int]) -> list[int]:
        ks = []
        for r, g in zip(rows, gammas):
            k = lookup_chain(r.seq, r.length, g, None if r.req.sampling.greedy else r.q, self.max_ngram, self.min_ngram)
            if g and not k:
                k = self.chain(r, g, lambda j, logits, r=r: self.draw(logits, r, r.q[j]), self.stop_below)
            ks.append(k)
        return ks


class SlotModel(NamedTuple):
    """One slot of a model's executor, as a per-sequence drafter sees it (the hierarchical
    drafter's draft model): its cache, and ``run(feed)`` -> logits [len(feed), V] (a view)."""

    executor: Executor
    slot: int

    @property
    def cache(self):
        return self.executor.slot(self.slot)

    def run(self, feed: np.ndarray) -> np.ndarray:
        return self.executor.forward([self.slot], [feed])[0, : len(feed)]
