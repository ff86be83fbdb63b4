"""Statistical exactness of Algorithm 1 (``verify_batch``), vectorized over many draws.

The target and draft are bigram models over a small vocabulary: row a of P (Q) is the
target's (draft's) standardized next-token distribution after token a, so p and q depend on
the tokens drawn before them exactly as in a real decode. For each draw the draft proposes
x_1..x_γ from Q, the target rows are P[s0], P[x_1], ..., P[x_γ], and one verification runs.

What exactness means here: every emitted token e_j, given the token before it (a), is
distributed as P[a] (whether e_j is an accepted draft token, a correction or the bonus).
So the pooled transition counts a -> b must pass a chi-square test against P, and a token
P gives zero mass must never appear. The acceptance of each evaluated draft token must
average sum_x min(P[a], Q[a]) (Theorem 3.5).

Tolerances: the seeds are fixed, so each test is deterministic. We reject at p < 1e-4 for
the chi-square and |z| > 4.5 for the acceptance rate, i.e. a correct rule fails with
probability well under 1e-4 per check on a fresh seed, while the wrong rules below give
p-values far below 1e-30 at these sample sizes (shown by the tests that expect failure).
"""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

import specdec.runtime.speculative as spec
from specdec.runtime.analysis import acceptance
from specdec.runtime.sampling import SamplingConfig, sample, standardize

V = 8
DRAWS = 200_000
MODES = {
    "plain": SamplingConfig(temperature=1.0),
    "temperature": SamplingConfig(temperature=0.6),
    "top_k": SamplingConfig(temperature=1.0, top_k=3),
    "top_p": SamplingConfig(temperature=1.0, top_p=0.7),
    "temp_topk_topp": SamplingConfig(temperature=1.3, top_k=5, top_p=0.85),
    "greedy": SamplingConfig(temperature=0.0),
}


def bigram_tables(seed: int, cfg: SamplingConfig) -> tuple[np.ndarray, np.ndarray]:
    """Standardized target P [V, V] and a related but different draft Q [V, V]."""
    rng = np.random.default_rng(seed)
    target_logits = rng.normal(scale=2.0, size=(V, V))
    draft_logits = target_logits + rng.normal(scale=1.5, size=(V, V))
    return standardize(target_logits, cfg), standardize(draft_logits, cfg)


def simulate(P, Q, gamma, rng, step):
    """One speculative step for DRAWS independent prefixes. Returns (s0, draft, accepted, token)."""
    s0 = rng.integers(0, V, size=DRAWS)
    draft = np.empty((DRAWS, gamma), dtype=np.int64)
    prev = s0
    for i in range(gamma):
        draft[:, i] = sample(Q[prev], rng)
        prev = draft[:, i]
    ctx = np.concatenate([s0[:, None], draft], axis=1)  # [B, γ+1]: the token before each position
    q = Q[ctx[:, :gamma]]  # [B, γ, V]
    p = P[ctx]  # [B, γ+1, V]
    accepted, token = step(draft, q, p, rng)
    return s0, draft, np.asarray(accepted), np.asarray(token)


def transitions(s0, draft, accepted, token):
    """Pooled counts [V, V] of (previous token -> emitted token) over every emitted position."""
    gamma = draft.shape[1]
    ctx = np.concatenate([s0[:, None], draft], axis=1)
    counts = np.zeros((V, V), dtype=np.int64)
    for j in range(gamma + 1):
        emitted = accepted >= j  # position j is emitted iff the first j drafts were kept
        prev = ctx[emitted, j]
        nxt = np.where(accepted[emitted] > j, draft[emitted, min(j, gamma - 1)], token[emitted])
        np.add.at(counts, (prev, nxt), 1)
    return counts


def chi2_pvalue(counts: np.ndarray, P: np.ndarray) -> float:
    """Chi-square of pooled transitions against P; raises if a zero-mass token was emitted."""
    expected = counts.sum(axis=1, keepdims=True) * P
    impossible = (P == 0) & (counts > 0)
    if impossible.any():
        return 0.0
    support = P > 0
    stat = (((counts - expected) ** 2)[support] / expected[support]).sum()
    dof = int((support.sum(axis=1) - 1)[counts.sum(axis=1) > 0].sum())
    return 1.0 if dof == 0 else float(stats.chi2.sf(stat, dof))


def acceptance_z(P, Q, s0, draft, accepted) -> float:
    """z-score of the number of kept drafts against sum of β over every evaluated draft token."""
    gamma = draft.shape[1]
    ctx = np.concatenate([s0[:, None], draft], axis=1)
    beta = acceptance(P, Q)  # [V]: β after each previous token
    expected = var = 0.0
    for i in range(gamma):
        evaluated = accepted >= i  # draft i is tested iff drafts before it were kept
        b = beta[ctx[evaluated, i]]
        expected += b.sum()
        var += (b * (1 - b)).sum()
    observed = accepted.sum()
    return 0.0 if var == 0 else float((observed - expected) / np.sqrt(var))


def real_step(draft, q, p, rng):
    return spec.verify_batch(draft, q, p, rng)


@pytest.mark.parametrize("mode", list(MODES))
def test_emitted_tokens_follow_target(mode):
    cfg = MODES[mode]
    P, Q = bigram_tables(1, cfg)
    rng = np.random.default_rng(1234)
    for gamma in range(1, 9):
        s0, draft, accepted, token = simulate(P, Q, gamma, rng, real_step)
        assert accepted.min() >= 0 and accepted.max() <= gamma
        pval = chi2_pvalue(transitions(s0, draft, accepted, token), P)
        assert pval > 1e-4, f"{mode} γ={gamma}: emitted tokens do not follow p (chi-square p={pval:.2e})"
        z = acceptance_z(P, Q, s0, draft, accepted)
        assert abs(z) < 4.5, f"{mode} γ={gamma}: acceptance rate off by z={z:.2f}"


def test_acceptance_rate_matches_alpha():
    """The overall first-position acceptance equals alpha = E[sum min(p, q)] (Corollary 3.6)."""
    P, Q = bigram_tables(2, MODES["plain"])
    rng = np.random.default_rng(7)
    s0, draft, accepted, token = simulate(P, Q, 1, rng, real_step)
    alpha = acceptance(P, Q).mean()  # s0 is uniform over V
    assert 0.2 < alpha < 0.9  # the fixture is a meaningful test, not a trivial one
    assert abs((accepted == 1).mean() - alpha) < 4.5 * np.sqrt(alpha * (1 - alpha) / DRAWS)


# --- The same checks must catch a wrong rule -----------------------------------------------


def test_unadjusted_resampling_is_caught(monkeypatch):
    """Resampling from p itself (no max(0, p - q) residual) after a rejection skews the output."""
    monkeypatch.setattr(spec, "_residual", lambda p, q: p)
    P, Q = bigram_tables(1, MODES["plain"])
    s0, draft, accepted, token = simulate(P, Q, 3, np.random.default_rng(1234), real_step)
    assert chi2_pvalue(transitions(s0, draft, accepted, token), P) < 1e-30


def test_unclamped_residual_is_caught(monkeypatch):
    """Dropping the max(0, ·) clamp lets p - q go negative and corrupts the residual draw."""
    monkeypatch.setattr(spec, "_residual", lambda p, q: np.abs(p - q))
    P, Q = bigram_tables(1, MODES["plain"])
    s0, draft, accepted, token = simulate(P, Q, 3, np.random.default_rng(1234), real_step)
    assert chi2_pvalue(transitions(s0, draft, accepted, token), P) < 1e-30


def test_bonus_from_wrong_row_is_caught():
    """An off-by-one that draws the bonus token from p_γ instead of p_{γ+1}."""

    def off_by_one(draft, q, p, rng):
        v = spec.verify_batch(draft, q, p, rng)
        full = v.accepted == draft.shape[1]
        token = v.token.copy()
        token[full] = sample(p[full, -2], rng)
        return v.accepted, token

    P, Q = bigram_tables(1, MODES["plain"])
    s0, draft, accepted, token = simulate(P, Q, 2, np.random.default_rng(1234), off_by_one)
    assert chi2_pvalue(transitions(s0, draft, accepted, token), P) < 1e-30


# --- Greedy path --------------------------------------------------------------------------


def test_greedy_batch_matches_general_rule_on_one_hot_rows():
    rng = np.random.default_rng(3)
    logits_p = rng.normal(size=(5000, 5, V))
    logits_q = logits_p + rng.normal(scale=0.8, size=(5000, 5, V))
    draft = logits_q[:, :4].argmax(-1)
    greedy = spec.verify_greedy_batch(draft, logits_p)
    p = standardize(logits_p, SamplingConfig(temperature=0))
    q = standardize(logits_q[:, :4], SamplingConfig(temperature=0))
    general = spec.verify_batch(draft, q, p, rng)
    np.testing.assert_array_equal(greedy.accepted, general.accepted)
    np.testing.assert_array_equal(greedy.token, general.token)
    assert 0 < greedy.accepted.mean() < 4  # both full and partial acceptance occur


def argmax_decode(table: np.ndarray, start: int, n: int) -> list[int]:
    out, tok = [], start
    for _ in range(n):
        tok = int(table[tok].argmax())
        out.append(tok)
    return out


def speculative_greedy_decode(target: np.ndarray, draft: np.ndarray, start: int, n: int, gamma: int):
    """A minimal speculative loop over bigram logit tables; returns tokens and target calls."""
    out, calls = [], 0
    while len(out) < n:
        ctx = [out[-1] if out else start]
        for _ in range(gamma):
            ctx.append(int(draft[ctx[-1]].argmax()))
        verdict = spec.verify_greedy(np.array(ctx[1:]), target[ctx])
        calls += 1
        out += ctx[1 : 1 + verdict.accepted] + [verdict.token]
    return out[:n], calls


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_path_equals_argmax_decoding(gamma):
    rng = np.random.default_rng(gamma)
    vocab = 64
    target = rng.normal(size=(vocab, vocab)) * 3
    draft = target + rng.normal(size=(vocab, vocab)) * 1.5
    total_calls = 0
    for start in range(10):
        ref = argmax_decode(target, start, 200)
        got, calls = speculative_greedy_decode(target, draft, start, 200, gamma)
        assert got == ref
        total_calls += calls
    assert total_calls < 0.8 * 10 * 200  # drafts were accepted, so rejections and acceptances both ran


def test_single_sequence_forms_return_ints():
    rng = np.random.default_rng(0)
    p = standardize(rng.normal(size=(4, V)), SamplingConfig())
    q = standardize(rng.normal(size=(3, V)), SamplingConfig())
    v = spec.verify(np.array([1, 2, 3]), q, p, rng)
    assert isinstance(v.accepted, int) and isinstance(v.token, int)
    g = spec.verify_greedy(np.array([1, 2, 3]), rng.normal(size=(4, V)))
    assert isinstance(g.accepted, int) and 0 <= g.accepted <= 3


def test_same_seed_same_verdicts():
    P, Q = bigram_tables(5, MODES["plain"])
    a = simulate(P, Q, 4, np.random.default_rng(99), real_step)
    b = simulate(P, Q, 4, np.random.default_rng(99), real_step)
    c = simulate(P, Q, 4, np.random.default_rng(100), real_step)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert not np.array_equal(a[3], c[3])
