r"""A power law fitted in log-log space, and its extrapolation (issue 51: a ratio against model size).

Ordinary least squares of :math:`\log y` on :math:`\log x` over every point given (a design passes one point
per seed and size, so the residual variance holds the seeds' spread and the power law's lack of fit alike):

.. math::
    \hat b = S_{xy} / S_{xx}, \qquad \hat a = \bar y - \hat b \bar x, \qquad
    s^2 = \frac{\sum_i (y_i - \hat a - \hat b x_i)^2}{n - 2},

with the slope's interval :math:`\hat b \pm t_{n-2} \, s / \sqrt{S_{xx}}`, and at a new :math:`x_0` the
prediction :math:`\hat y_0 = \hat a + \hat b x_0` with the prediction interval of one new point there,
:math:`\hat y_0 \pm t_{n-2} \, s \sqrt{1 + 1/n + (x_0 - \bar x)^2 / S_{xx}}` (x and y in logs;
the values are reported back on the original scale). Far outside the fitted range that interval assumes
the power law holds there: an extrapolation, which a report must call one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats

from curvlab.errors import CurvlabError
from curvlab.util.codec import Record


@dataclass(frozen=True)
class LogLogFit(Record):
    r"""A power law :math:`y = e^{a} x^{b}` fitted by :func:`log_log_fit`, and its prediction at ``at``.

    Attributes:
        slope: :math:`\hat b`, the exponent.
        slope_ci95: its interval (t with n − 2 degrees of freedom).
        intercept: :math:`\hat a` (natural logs).
        n: the points fitted.
        at: where the prediction is made (on x's scale).
        prediction: :math:`e^{\hat y_0}`, on y's scale.
        prediction_pi95: the prediction interval of one new point at ``at``, on y's scale.
        extrapolated: whether ``at`` lies outside the fitted x range.
    """

    slope: float
    slope_ci95: list[float]
    intercept: float
    n: int
    at: float
    prediction: float
    prediction_pi95: list[float]
    extrapolated: bool


def log_log_fit(x: Sequence[float], y: Sequence[float], at: float, confidence: float = 0.95) -> LogLogFit:
    r"""Fit :math:`\log y = a + b \log x` by least squares and predict at ``at`` (module docstring).

    Args:
        x: positive abscissae (e.g. non-embedding parameters), one per point.
        y: positive values (e.g. a seed's ratio), one per point.
        at: a positive x at which to predict (e.g. 124M parameters).
        confidence: the intervals' level.

    Returns:
        The :class:`LogLogFit`.

    Raises:
        CurvlabError: fewer than 3 points, fewer than 2 distinct x, a value that is not positive and finite,
            or lengths that differ.
    """
    lx, ly = np.log(_positive(x, "x")), np.log(_positive(y, "y"))
    if lx.size != ly.size:
        raise CurvlabError(f"x and y differ in length ({lx.size} and {ly.size})")
    distinct = np.unique(lx).size
    if lx.size < 3 or distinct < 2:
        raise CurvlabError(f"a log-log fit needs 3 points or more at 2 x or more, got {lx.size} at {distinct}")
    (x0,) = np.log(_positive([at], "at"))
    n, mx = lx.size, lx.mean()
    sxx = float(((lx - mx) ** 2).sum())
    slope = float(((lx - mx) * (ly - ly.mean())).sum() / sxx)
    intercept = float(ly.mean() - slope * mx)
    s = math.sqrt(float(((ly - intercept - slope * lx) ** 2).sum()) / (n - 2))
    t = float(stats.t.ppf(0.5 + confidence / 2, n - 2))
    half_slope = t * s / math.sqrt(sxx)
    y0 = intercept + slope * x0
    half_pred = t * s * math.sqrt(1 + 1 / n + (x0 - mx) ** 2 / sxx)
    return LogLogFit(
        slope=slope,
        slope_ci95=[slope - half_slope, slope + half_slope],
        intercept=intercept,
        n=n,
        at=float(at),
        prediction=math.exp(y0),
        prediction_pi95=[math.exp(y0 - half_pred), math.exp(y0 + half_pred)],
        extrapolated=not lx.min() <= x0 <= lx.max(),
    )


def _positive(values: Sequence[float], what: str) -> np.ndarray:
    a = np.asarray(values, dtype=float)
    if not np.all(np.isfinite(a) & (a > 0)):
        raise CurvlabError(f"a log-log fit needs positive, finite {what}, got {a[~(np.isfinite(a) & (a > 0))][:3]}")
    return a
