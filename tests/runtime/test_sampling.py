"""Standardized sampling: Hugging Face semantics, checked against transformers' own warpers."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from specdec.errors import SamplingError
from specdec.runtime.sampling import SamplingConfig, sample, softmax, standardize


def hf_reference(logits: np.ndarray, cfg: SamplingConfig) -> np.ndarray:
    """The distribution transformers' generate(do_sample=True) samples from, via its real warpers."""
    torch = pytest.importorskip("torch")
    gen = pytest.importorskip("transformers.generation.logits_process")
    scores = torch.tensor(logits, dtype=torch.float64)
    ids = torch.zeros((scores.shape[0], 1), dtype=torch.long)
    warpers = [gen.TemperatureLogitsWarper(cfg.temperature)]
    if cfg.top_k:
        warpers.append(gen.TopKLogitsWarper(cfg.top_k))
    if cfg.top_p is not None and cfg.top_p < 1.0:
        warpers.append(gen.TopPLogitsWarper(cfg.top_p))
    for w in warpers:
        scores = w(ids, scores)
    return torch.softmax(scores, dim=-1).numpy()


CONFIGS = [
    SamplingConfig(1.0),
    SamplingConfig(0.5),
    SamplingConfig(2.0),
    SamplingConfig(1.0, top_k=1),
    SamplingConfig(1.0, top_k=7),
    SamplingConfig(0.7, top_k=40),
    SamplingConfig(1.0, top_p=0.5),
    SamplingConfig(1.0, top_p=0.95),
    SamplingConfig(0.8, top_k=20, top_p=0.9),
    SamplingConfig(1.5, top_k=3, top_p=0.3),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=str)
def test_matches_transformers_warpers(cfg):
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=3.0, size=(64, 100))
    # No exact ties here: transformers breaks them through torch.sort, which is unstable, so
    # which tied token it keeps is arbitrary. Our rule for ties is tested below.
    np.testing.assert_allclose(standardize(logits, cfg), hf_reference(logits, cfg), atol=1e-12)


def test_greedy_is_one_hot_first_argmax():
    logits = np.array([[0.0, 3.0, 3.0, -1.0], [5.0, 1.0, 2.0, 5.0]])
    np.testing.assert_array_equal(standardize(logits, SamplingConfig(0.0)), [[0, 1, 0, 0], [1, 0, 0, 0]])


def test_top_p_tie_keeps_lower_index_like_argmax():
    logits = np.array([0.0, 2.0, 2.0, -1.0])
    np.testing.assert_array_equal(standardize(logits, SamplingConfig(top_p=0.3)) > 0, [0, 1, 0, 0])


@pytest.mark.parametrize("shape", ["peaked", "flat"])
def test_top_p_at_a_large_vocabulary_matches_transformers(shape):
    """The nucleus is found by sorting a growing set of top candidates (64, 512, ...), not the
    whole row: a peaked row closes inside the first 64, a flat one grows to the full sort."""
    rng = np.random.default_rng(1)
    logits = rng.normal(scale=3.0, size=(3, 50_000))
    if shape == "peaked":
        logits[:, rng.choice(50_000, 20, replace=False)] += 25.0
    for cfg in (SamplingConfig(1.0, top_p=0.9), SamplingConfig(0.7, top_k=5000, top_p=0.5)):
        np.testing.assert_allclose(standardize(logits, cfg), hf_reference(logits, cfg), atol=1e-12)
    kept = (standardize(logits, SamplingConfig(1.0, top_p=0.9)) > 0).sum(-1)
    assert (kept < 64).all() if shape == "peaked" else (kept > 512).all(), kept


def test_top_p_with_ties_at_the_candidates_edge_keeps_lower_indices():
    """Ties where the first 64 candidates end: the set grows until the nucleus closes strictly
    inside it, and among equal scores the lower index stays (the full sort's rule)."""
    logits = np.zeros(1000)
    logits[[900, 10, 500]] = [5.0, 5.0, 4.0]  # two tied leaders, then 997 tied zeros
    probs = standardize(logits, SamplingConfig(top_p=0.9))
    p = softmax(logits)
    need = int(np.searchsorted(np.cumsum(np.sort(p)[::-1]) - np.sort(p)[::-1], 0.9))  # tokens whose mass above is < 0.9
    assert (probs > 0).sum() == need and need > 64
    zeros_kept = np.flatnonzero((probs > 0) & (logits == 0))
    np.testing.assert_array_equal(zeros_kept, np.flatnonzero(logits == 0)[: need - 3])  # the lowest indices among the ties


def test_top_p_keeps_smallest_set_reaching_mass():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    assert (standardize(logits, SamplingConfig(top_p=0.5)) > 0).sum() == 1
    assert (standardize(logits, SamplingConfig(top_p=0.79)) > 0).sum() == 2
    assert (standardize(logits, SamplingConfig(top_p=0.81)) > 0).sum() == 3
    assert (standardize(logits, SamplingConfig(top_p=1.0)) > 0).sum() == 4


def test_sample_follows_probabilities_and_skips_zero_mass():
    rng = np.random.default_rng(1)
    probs = np.array([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    draws = sample(np.broadcast_to(probs, (200_000, 6)), rng)
    counts = np.bincount(draws, minlength=6)
    assert counts[probs == 0].sum() == 0
    assert stats.chisquare(counts[probs > 0], 200_000 * probs[probs > 0]).pvalue > 1e-4


def test_sample_accepts_unnormalized_rows():
    rng = np.random.default_rng(2)
    draws = sample(np.broadcast_to([2.0, 6.0], (100_000, 2)), rng)
    assert abs(draws.mean() - 0.75) < 0.01


def test_softmax_handles_masked_logits():
    p = softmax(np.array([0.0, -np.inf, 1.0]))
    assert p[1] == 0 and np.isclose(p.sum(), 1)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.2}, "top_p"),
    ],
)
def test_bad_settings_are_refused(kwargs, field):
    with pytest.raises(SamplingError, match=field) as err:
        SamplingConfig(**kwargs)
    assert isinstance(err.value, ValueError)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("cfg", [*CONFIGS, SamplingConfig(1.0, top_k=200), SamplingConfig(1.2, min_p=0.05), SamplingConfig(100.0)], ids=str)
def test_a_draw_within_the_draft_vocabulary_has_the_full_rows_law(cfg):
    """A feature head's logits are NEVER outside its draft vocabulary; draw_within standardizes
    the vocabulary alone and writes the same q as the full row's draw (float64 sums in another
    order: 1e-12), draws only supported tokens, and the tokens follow q (chi-square)."""
    from specdec.runtime.sampling import NEVER, draw, draw_within, support_of

    rng = np.random.default_rng(3)
    vocab = 1000
    support = np.sort(rng.choice(vocab, 120, replace=False))
    logits = np.full(vocab, NEVER, dtype=np.float32)
    logits[support] = rng.normal(0, 3, len(support))
    assert np.array_equal(support_of(logits), support) and support_of(logits[support]) is None
    q_full, q_within = np.zeros(vocab), np.zeros(vocab)
    q_within[5] = 0.7  # a row another drafter wrote (lookup's one-hot): rewritten whole
    draw(logits, cfg, np.random.default_rng(0), q_full)
    draw_within(logits, support, cfg, np.random.default_rng(0), q_within)
    np.testing.assert_allclose(q_within, q_full, rtol=0, atol=1e-12)
    counts = np.zeros(vocab)
    r = np.random.default_rng(1)
    for _ in range(4000):
        counts[draw_within(logits, support, cfg, r, q_within)] += 1
    assert counts[np.setdiff1d(np.arange(vocab), support)].sum() == 0 and counts[q_full == 0].sum() == 0
    kept = q_full > 0
    if kept.sum() > 1:
        expected = q_full[kept] * counts.sum()
        big = expected >= 5  # chi-square's usual validity rule; the rest pooled
        obs = np.append(counts[kept][big], counts[kept][~big].sum())
        exp = np.append(expected[big], expected[~big].sum())
        obs, exp = (obs, exp) if exp[-1] > 0 else (obs[:-1], exp[:-1])
        assert stats.chisquare(obs, exp).pvalue > 1e-4


def test_a_draw_whose_vocabulary_a_constraint_masked_is_drawn_whole():
    from specdec.runtime.sampling import NEVER, draw, draw_within

    logits = np.full(10, NEVER, dtype=np.float32)
    support = np.array([1, 2, 3])
    logits[support] = -np.inf  # a grammar allows none of the drafted tokens
    logits[7] = 0.0  # ... but token 7 (the head gives it NEVER: the full row's law is what decides)
    q_full, q_within = np.zeros(10), np.zeros(10)
    a = draw(logits, SamplingConfig(1.0), np.random.default_rng(0), q_full)
    b = draw_within(logits, support, SamplingConfig(1.0), np.random.default_rng(0), q_within)
    assert a == b and np.array_equal(q_full, q_within)
