"""The log-log fit of a ratio against model size (issue 51) against scipy.stats.linregress and the textbook
prediction interval written out by hand."""

import math

import numpy as np
import pytest
from scipy import stats

from curvlab.errors import CurvlabError
from curvlab.inference.loglog import log_log_fit


def test_the_fit_is_scipys_regression_and_the_prediction_interval_the_hand_formula():
    rng = np.random.default_rng(0)
    sizes = np.repeat([2e5, 5e5, 1e6, 3e6, 9e6], 3)
    ratios = 7.0 * (sizes / 1e6) ** 0.3 * np.exp(rng.normal(0, 0.2, sizes.size))
    fit = log_log_fit(sizes, ratios, at=124e6)
    ref = stats.linregress(np.log(sizes), np.log(ratios))
    assert fit.slope == pytest.approx(ref.slope, rel=1e-12) and fit.intercept == pytest.approx(ref.intercept)
    t = stats.t.ppf(0.975, sizes.size - 2)
    assert fit.slope_ci95 == pytest.approx([ref.slope - t * ref.stderr, ref.slope + t * ref.stderr], rel=1e-12)
    # by hand: residual SD, leverage of the new point, exp back
    lx, ly = np.log(sizes), np.log(ratios)
    n = lx.size
    resid = ly - (ref.intercept + ref.slope * lx)
    s = math.sqrt(resid @ resid / (n - 2))
    x0 = math.log(124e6)
    y0 = ref.intercept + ref.slope * x0
    half = t * s * math.sqrt(1 + 1 / n + (x0 - lx.mean()) ** 2 / ((lx - lx.mean()) ** 2).sum())
    assert fit.prediction == pytest.approx(math.exp(y0), rel=1e-12)
    assert fit.prediction_pi95 == pytest.approx([math.exp(y0 - half), math.exp(y0 + half)], rel=1e-12)
    assert fit.extrapolated and not log_log_fit(sizes, ratios, at=1e6).extrapolated


def test_an_exact_power_law_is_recovered_with_a_zero_width_interval():
    x = np.array([1.0, 10.0, 100.0, 1000.0])
    fit = log_log_fit(x, 3.0 * x**-0.5, at=1e4)
    assert fit.slope == pytest.approx(-0.5) and fit.prediction == pytest.approx(3.0 * 1e4**-0.5)
    assert fit.slope_ci95 == pytest.approx([-0.5, -0.5]) and fit.prediction_pi95 == pytest.approx([0.03, 0.03])


@pytest.mark.parametrize(
    ("x", "y", "match"),
    [
        ([1, 2], [1, 2], "3 points or more"),
        ([1, 1, 1], [1, 2, 3], "at 2 x or more"),
        ([1, 2, 3], [1, -2, 3], "positive, finite y"),
        ([1, 2, float("nan")], [1, 2, 3], "positive, finite x"),
        ([1, 2, 3], [1, 2], "differ in length"),
    ],
)
def test_bad_points_are_refused_by_name(x, y, match):
    with pytest.raises(CurvlabError, match=match):
        log_log_fit(x, y, at=10.0)
