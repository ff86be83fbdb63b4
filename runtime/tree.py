"""Verifying a tree of drafted tokens in one target call, exactly (issue 28's core, pure NumPy).

A draft tree holds N nodes in topological order: node i carries ``tokens[i]`` and hangs under
``parents[i]`` (-1: under the root, the last committed token). One target call over the N
nodes, each attending to its ancestors only, gives a distribution per node: row 0 of ``p`` is
the root's next-token distribution, row i + 1 node i's. The walk below keeps a path of drafted
tokens and ends with one token of the target's own, so a call yields 1 + (accepted) tokens, as
Algorithm 1 does on a chain.

**Why the output law is exactly the target's (recursive rejection over siblings).** At a node
whose next-token law is r (the target's p there), try its children in order; child i was drawn
from a proposal q_i that does not depend on the target's coins (an i.i.d. draw from the draft's
q, a draw without replacement — q with the earlier siblings removed — or a fixed candidate, a
point mass). Speculative sampling of x_i ~ q_i against r accepts x_i with min(1, r(x_i)/q_i(x_i)),
so P(accept, x) = min(q_i(x), r(x)) and P(reject) = Σ max(0, r − q_i); on rejection go on with
r' = norm(max(0, r − q_i)). If whatever follows a rejection emits a token of law r', the token
emitted at this node has law min(q_i, r) + P(reject)·r' = min(q_i, r) + max(0, r − q_i) = r.
By induction over the siblings, with a plain draw from the last residual when every child is
rejected (or the node has none), the token chosen at the node has law r, whatever the tree.
Given that token, the walk continues in the accepted child's subtree against the target's law
there, so every position of the output follows the target (Leviathan et al., Theorem 3.5 at each
step; SpecInfer and EAGLE verify trees the same way). A point-mass proposal accepts x_i with
probability r(x_i) and otherwise removes x_i from r; a repeated sibling after a rejection has
r'(x) = 0 and is never accepted. Greedy verification is the argmax limit: take the first child
whose token is the target's argmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from specdec.runtime.sampling import sample
from specdec.runtime.speculative import _residual, check_lenience


class DraftTree(NamedTuple):
    """A drafter's proposal for one row: N nodes in topological order; ``q`` [N, V] the proposal
    each node was drawn from (None: every node a fixed candidate, a point mass)."""

    tokens: list[int]
    parents: list[int]
    q: np.ndarray | None = None


EMPTY_TREE = DraftTree([], [])


@dataclass(frozen=True)
class TreeVerdict:
    path: tuple[int, ...]  # accepted nodes, root to leaf (indices into the tree)
    token: int  # the target's own token after the path (correction or bonus)

    @property
    def tokens_emitted(self) -> int:
        return len(self.path) + 1


def children_of(parents: np.ndarray) -> list[list[int]]:
    """Per node, and for the root at index 0, the children in tree order: [N + 1] lists."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        if not -1 <= parent < i:
            raise ValueError(f"parents[{i}] = {parent}: expected -1 or an earlier node (topological order)")
        out[parent + 1].append(i)
    return out


def path_to(tokens: Sequence[int], parents: Sequence[int], i: int) -> list[int]:
    """The tokens from the root's first child down to node i (node i's prefix past the root)."""
    path = []
    while i >= 0:
        path.append(tokens[i])
        i = parents[i]
    return path[::-1]


def depths(parents: Sequence[int]) -> list[int]:
    """Each node's depth: 1 under the root, 1 + its parent's below (parents in topological order)."""
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


def sibling_ranks(parents: Sequence[int]) -> list[int]:
    """Each node's rank among its siblings, in tree order (0: its parent's first child, which a
    drafter places as its most likely candidate)."""
    seen: dict[int, int] = {}
    out: list[int] = []
    for p in parents:
        out.append(seen.get(p, 0))
        seen[p] = out[-1] + 1
    return out


def verify_tree_greedy(tokens: np.ndarray, parents: np.ndarray, logits: np.ndarray, lenience: float = 1.0) -> TreeVerdict:
    """Argmax verification of a tree: tokens/parents [N], logits [N + 1, V] (row 0: the root).
    ``lenience`` l < 1 (Appendix A.5, as ``speculative.verify_greedy_batch``): where no child is
    the argmax, the first child with p(x) >= l * max p is kept; the token after the path is the argmax."""
    kids = children_of(parents)
    top = logits.argmax(axis=-1)  # [N + 1]
    floor = math.log(check_lenience(lenience))
    path: list[int] = []
    row = 0
    while True:
        nxt = next((c for c in kids[row] if tokens[c] == top[row]), None)
        if nxt is None and floor < 0.0:
            nxt = next((c for c in kids[row] if logits[row, tokens[c]] - logits[row, top[row]] >= floor), None)
        if nxt is None:
            return TreeVerdict(tuple(path), int(top[row]))
        path.append(nxt)
        row = nxt + 1


def verify_tree(tokens: np.ndarray, parents: np.ndarray, q: np.ndarray | None, p: np.ndarray,
                rng: np.random.Generator, lenience: float = 1.0) -> TreeVerdict:  # fmt: skip
    """Recursive rejection over siblings (the module docstring): tokens/parents [N]; ``q`` [N, V]:
    the proposal each node's token was drawn from (None: every node is a fixed candidate, a point
    mass); ``p`` [N + 1, V]: the target's standardized distributions (row 0: the root).
    ``lenience`` l < 1 (Appendix A.5, the chain's rule at each sibling): a child is kept when
    u * l * q(x) <= r(x), the residual unchanged; the output is then NOT the target's."""
    kids = children_of(parents)
    scale = check_lenience(lenience)
    path: list[int] = []
    row = 0
    while True:
        r = p[row]
        accepted = None
        for c in kids[row]:
            x = int(tokens[c])
            qx = 1.0 if q is None else q[c, x]  # a fixed candidate: q = δ_x
            if r[x] > 0 and not rng.random() * scale * qx > r[x]:  # accept with min(1, r(x) / (l q(x))); never a token r cannot emit
                accepted = c
                break
            if q is None:  # max(0, r - δ_x): r without x
                res = r.copy()
                res[x] = 0.0
            else:
                res = _residual(r, q[c])
            total = res.sum()
            # no mass left means r == q up to rounding, where rejection is impossible in exact
            # arithmetic: r itself is then the right law (the chain's rule, runtime/speculative.py)
            r = res / total if total > 0 else r
        if accepted is None:
            return TreeVerdict(tuple(path), int(sample(r, rng)))
        path.append(accepted)
        row = accepted + 1
