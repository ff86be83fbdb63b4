"""specdec check's chi-square arithmetic (specdec/commands/check/law.py) against SciPy's."""

import numpy as np
import pytest
from scipy import stats

from specdec.commands.check import law


@pytest.mark.parametrize("df", [1, 2, 5, 17, 100, 400])
def test_chi_square_tail_and_its_inverse_are_scipys(df):
    for x in (0.01, 0.7, 3.0, 12.0, 60.0, 250.0, 900.0):
        assert law.chi2_sf(x, df) == pytest.approx(stats.chi2.sf(x, df), rel=1e-9, abs=1e-14)
    for level in (0.05, 1e-3, 1e-6):
        assert law.chi2_isf(level, df) == pytest.approx(stats.chi2.isf(level, df), rel=1e-9)


@pytest.mark.parametrize("df", [1, 4, 20, 60])
def test_noncentral_tail_is_within_patnaiks_error(df):
    """Patnaik's approximation: within 0.02 of the exact noncentral tail at the critical values
    used (it matches mean and variance; 0.014 is the largest error seen over these cases). The
    power a report states is rounded to 'caught 4 times in 5', far coarser."""
    critical = stats.chi2.isf(1e-3, df)
    for lam in (0.5, 5.0, 20.0, 80.0, 300.0):
        assert law.ncx2_sf(critical, df, lam) == pytest.approx(stats.ncx2.sf(critical, df, lam), abs=0.02)


def test_pearson_is_scipys_over_the_kept_bins():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(40, 0.3))
    counts = rng.multinomial(2000, p)
    stat, df, pvalue = law.pearson(counts, p)
    obs, exp = law.bins(counts, p)
    want = stats.chisquare(obs, exp * obs.sum() / exp.sum())
    assert (stat, pvalue) == pytest.approx((want.statistic, want.pvalue), rel=1e-9)
    assert df == len(obs) - 1 and (p * 2000 >= 5).sum() <= len(obs) <= (p * 2000 >= 5).sum() + 1
    # another law: rejected
    assert law.pearson(rng.multinomial(2000, np.roll(p, 1)), p)[2] < 1e-6
    # one likely token: nothing to test
    assert law.pearson(np.array([1000, 0, 0]), np.array([1.0, 0.0, 0.0]))[1:] == (0, 1.0)


def test_detectable_effect_has_the_power_it_says():
    """At the returned w, the exact noncentral tail gives power ~0.8; at half of it, far less."""
    runs, df, level = 1000, 9, 1e-3
    w = law.detectable_effect(runs, df, level)
    critical = stats.chi2.isf(level, df)
    assert stats.ncx2.sf(critical, df, runs * w * w) == pytest.approx(0.8, abs=0.02)
    assert stats.ncx2.sf(critical, df, runs * (w / 2) ** 2) < 0.2
    assert law.detectable_effect(4 * runs, df, level) == pytest.approx(w / 2, rel=0.05)  # w scales as 1/sqrt(runs)
