"""Tree verification (runtime/tree.py): the output follows the target's law whatever the tree.

Statistical: thousands of seeded trees over a 6-token vocabulary, two levels (3 children under
the root, 2 under each), siblings drawn i.i.d. from the draft (so they repeat), without
replacement, or fixed (the draft's top candidates); the first two emitted tokens' joint counts
against the target's p(t1) p(t2 | t1) (chi-square), also with top-k/top-p-truncated target rows;
and a power check: the same test rejects a verifier that forgets the residual between siblings.
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from specdec.runtime import tree
from specdec.runtime.sampling import SamplingConfig, sample, standardize
from specdec.runtime.tree import children_of, verify_tree, verify_tree_greedy

V = 6
TRIALS = 12_000


def laws(truncate: bool):
    """Target p1 [V], p2 [V, V] (row t: after t), p3 (deeper), and draft q1, q2, all peaked and
    different from each other; ``truncate``: the target's rows under top-k 4 / top-p 0.8."""
    rng = np.random.default_rng(7)
    logits1, logits2 = rng.normal(scale=1.5, size=V), rng.normal(scale=1.5, size=(V, V))
    cfg = SamplingConfig(1.0, top_k=4, top_p=0.8) if truncate else SamplingConfig(1.0)
    p1, p2 = standardize(logits1, cfg), standardize(logits2, cfg)
    q1 = standardize(logits1 + rng.normal(scale=1.0, size=V), SamplingConfig(1.0))
    q2 = standardize(logits2 + rng.normal(scale=1.0, size=(V, V)), SamplingConfig(1.0))
    return p1, p2, np.full(V, 1.0 / V), q1, q2


def draw_children(q: np.ndarray, k: int, mode: str, rng) -> tuple[list[int], list[np.ndarray] | None]:
    """k sibling tokens from q, and the proposal each was drawn from (None: fixed candidates)."""
    if mode == "fixed":
        return [int(t) for t in np.argsort(-q, kind="stable")[:k]], None
    tokens, rows, left = [], [], q.copy()
    for _ in range(k):
        row = left / left.sum()
        t = int(sample(row, rng))
        tokens.append(t)
        rows.append(row)
        if mode == "without":
            left = left.copy()
            left[t] = 0.0
    return tokens, rows


def build(mode: str, p1, p2, p3, q1, q2, rng):
    """A two-level tree: tokens, parents, the proposals q [N, V] (or None) and the target rows [N + 1, V]."""
    tokens, parents, qrows, prows = [], [], [], [p1]
    first, rows1 = draw_children(q1, 3, mode, rng)
    for j, t in enumerate(first):
        tokens.append(t)
        parents.append(-1)
        qrows.append(None if rows1 is None else rows1[j])
        prows.append(p2[t])
    for parent in range(len(first)):
        second, rows2 = draw_children(q2[tokens[parent]], 2, mode, rng)
        for j, t in enumerate(second):
            tokens.append(t)
            parents.append(parent)
            qrows.append(None if rows2 is None else rows2[j])
            prows.append(p3)
    q = None if mode == "fixed" else np.array(qrows)
    return np.array(tokens), np.array(parents), q, np.array(prows)


def first_two(mode: str, truncate: bool, seed: int = 0):
    """Joint counts [V, V] of the first two tokens over TRIALS trees, the exact law, and how many
    trees had a repeated sibling."""
    p1, p2, p3, q1, q2 = laws(truncate)
    rng = np.random.default_rng(seed)
    counts, repeats, lengths = np.zeros((V, V), dtype=np.int64), 0, []
    for _ in range(TRIALS):
        tokens, parents, q, p = build(mode, p1, p2, p3, q1, q2, rng)
        repeats += len(set(tokens[:3].tolist())) < 3
        verdict = verify_tree(tokens, parents, q, p, rng)
        emitted = [int(tokens[i]) for i in verdict.path] + [verdict.token]
        if len(emitted) == 1:  # the next call's token, as decoding would draw it
            emitted.append(int(sample(p2[emitted[0]], rng)))
        counts[emitted[0], emitted[1]] += 1
        lengths.append(len(verdict.path))
    return counts, p1[:, None] * p2, repeats, np.bincount(lengths, minlength=3)


def chi_square_p(counts: np.ndarray, law: np.ndarray) -> float:
    """Pearson's test over the cells with mass (a token of zero mass must never appear)."""
    assert counts[law == 0].sum() == 0, "emitted a pair the target cannot produce"
    keep = law > 0
    return float(stats.chisquare(counts[keep], law[keep] / law[keep].sum() * counts.sum()).pvalue)


@pytest.mark.parametrize("truncate", [False, True], ids=["plain", "top-k-top-p"])
@pytest.mark.parametrize("mode", ["iid", "without", "fixed"])
def test_first_two_tokens_follow_the_target(mode, truncate):
    counts, law, repeats, depths = first_two(mode, truncate)
    assert chi_square_p(counts, law) > 1e-3, (mode, truncate)
    assert depths[0] > 0 and depths[1] > 0 and depths[2] > 0, depths  # rejections, one and two accepted levels
    if mode == "iid":
        assert repeats > TRIALS / 20, repeats  # siblings that repeat a token are exercised


def test_the_check_can_tell_a_verifier_that_forgets_the_residual(monkeypatch):
    """Power: testing every sibling against the target's own p (no residual after a rejection)
    over-emits the draft's favourite tokens, and the same chi-square rejects it."""
    monkeypatch.setattr(tree, "_residual", lambda r, q: r)
    counts, law, _, _ = first_two("iid", False)
    assert chi_square_p(counts, law) < 1e-6


def test_greedy_takes_the_first_child_that_is_the_argmax():
    #            root
    #      0(a) 1(b) 2(b)     node 1 and 2 repeat token b; 3, 4 under node 1; 5 under node 2
    tokens = np.array([0, 1, 1, 2, 3, 4])
    parents = np.array([-1, -1, -1, 1, 1, 2])
    logits = np.zeros((7, V))
    logits[0, 1] = 5  # root: b -> node 1 (the first b)
    logits[2, 3] = 5  # after node 1: token 3 -> node 4
    logits[5, 5] = 5  # after node 4: 5, which no child drafted -> the target's own token
    v = verify_tree_greedy(tokens, parents, logits)
    assert v.path == (1, 4) and v.token == 5 and v.tokens_emitted == 3
    logits[0] = 0
    logits[0, 4] = 5  # the root's argmax is not drafted at all
    assert verify_tree_greedy(tokens, parents, logits) == tree.TreeVerdict((), 4)


def test_a_tree_is_topologically_ordered():
    assert children_of(np.array([-1, 0, 0, -1])) == [[0, 3], [1, 2], [], [], []]
    with pytest.raises(ValueError, match=r"parents\[1\] = 2"):
        children_of(np.array([-1, 2, 0]))


def test_lookup_tree_merges_earlier_continuations_into_a_trie():
    from specdec.runtime.lookup import lookup_tree

    #          0  1  2  3  4  5  6  7  8  9 10 11 12
    seq = np.array([7, 1, 2, 3, 9, 1, 2, 4, 5, 1, 2, 3, 1, 2])
    tokens, parents, q = lookup_tree(seq, len(seq), nodes=8, depth=3)
    assert q is None  # fixed candidates
    # the context ends "1 2": its 2-gram occurs with continuations [3 1 2] (end 11, latest), [4 5 1] (end 7),
    # [3 9 1] (end 3); "3" is shared, so the trie has 3 -> {1 -> 2, 9 -> 1} and 4 -> 5 -> 1
    assert tokens == [3, 1, 2, 4, 5, 1, 9, 1] and parents == [-1, 0, 1, -1, 3, 4, 0, 6]
    children_of(np.array(parents))  # topological
    assert lookup_tree(seq, len(seq), nodes=2, depth=3)[:2] == ([3, 1], [-1, 0])
    assert lookup_tree(np.array([5, 6]), 2, nodes=8, depth=3)[:2] == ([], [])  # no earlier occurrence


def test_lenience_at_a_node_is_the_chains_rule():
    """A lenient tree (App. A.5) keeps a child drawn from q with probability min(1, p(x) / (l q(x))),
    the chain's rule: over 20,000 draws the kept share is within 5 binomial standard errors of
    the exact sum (l = 1: the exact acceptance). Greedy: with no argmax child, the first child
    within l of the top probability is kept."""
    rng = np.random.default_rng(7)
    p = np.array([0.5, 0.3, 0.15, 0.05])
    q = np.array([0.1, 0.6, 0.2, 0.1])
    parents = np.array([-1])
    for lenience in (1.0, 0.5):
        want = float((q * np.minimum(1.0, p / (lenience * q))).sum())
        runs, kept = 20000, 0
        for _ in range(runs):
            x = int(rng.choice(4, p=q))
            v = verify_tree(np.array([x]), parents, q[None], np.stack([p, np.full(4, 0.25)]), rng, lenience)
            kept += len(v.path)
        assert abs(kept / runs - want) < 5 * np.sqrt(want * (1 - want) / runs), (lenience, kept / runs, want)
    logits = np.log(np.stack([p, np.full(4, 0.25)]))
    kids = np.array([2, 1])  # neither is the argmax (0); token 1 has p = 0.3 >= 0.5 * 0.5
    assert verify_tree_greedy(kids, np.array([-1, -1]), np.vstack([logits, logits[1:]])).path == ()
    assert verify_tree_greedy(kids, np.array([-1, -1]), np.vstack([logits, logits[1:]]), lenience=0.5).path == (1,)
