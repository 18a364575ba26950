r"""Estimators of the directional curvature :math:`\langle Z, H[Z]\rangle` along one direction, each with its
own cost and, where it has one, its own error estimate, to be calibrated against the exact one (issue 52).

For parameters W, a direction Z with unit :math:`u = Z/\|Z\|`, gradient G, Hessian H and the loss along the
line :math:`\phi(\alpha) = L(W - \alpha Z)`:

.. math::
    \phi(\alpha) = L - \alpha\langle G, Z\rangle + \tfrac{\alpha^2}{2}\langle Z, H[Z]\rangle
        - \tfrac{\alpha^3}{6}\nabla^3 L[Z, Z, Z] + O(\alpha^4),\qquad
    \mathrm{NDS} = \frac{\langle Z, H[Z]\rangle}{\|Z\|^2}.

* ``exact``: one HVP by double backward at a :class:`~curvlab.engine.hvp.CurvaturePoint`,
  :math:`\langle Z, H[Z]\rangle` exact up to floating-point rounding (error ``None``).
* ``finite_difference``: :math:`d(h) = \langle u, G(W + hu) - G(W - hu)\rangle / (2h) = \mathrm{NDS} +
  \tfrac{h^2}{6}\nabla^3 L[u,u,u] + O(h^4) + \delta`, at the step rule of
  :func:`~curvlab.engine.finite_difference.finite_difference_hvp` (:math:`h = \epsilon^{1/3}`); error
  :math:`|d(h) - d(2h)|/3 + 4\epsilon(\|G_+\| + \|G_-\|)/(2h)` (Richardson's h² truncation plus rounding).
* ``quadratic_fit``: :math:`f(\alpha) = \phi(\alpha) - L + \alpha\langle G, Z\rangle = a\alpha^2 + b\alpha^3`
  fitted by least squares on a grid of α, :math:`\langle Z, H[Z]\rangle = 2a`, :math:`b = -\nabla^3L[Z,Z,Z]/6`;
  error: the change of 2a when a quartic term joins the fit, plus the rounding of the losses carried through
  the fit.
* ``forward``: forward-over-forward AD, the second derivative of φ at 0
  (:func:`~curvlab.engine.forward.forward_quadratic_form`), exact up to rounding (error ``None``).

Not here yet: critical sharpness (the step where the loss along -Z stops decreasing, 2<G, Z>/α*). On a tiny
GPT in float32 along a random direction whose exact NDS is negative, the loss curved up even at α*/16, and the
root-based estimate was 7x off, outside any error its cubic and quartic corrections could state: it needs a
test of its own validity that holds there before it can ship.

Costs count passes: a gradient is one forward and one backward; a second backward through a kept graph counts
as one backward (it costs about two first backwards); a forward carrying second-order tangents counts as one
forward (it costs about three plain forwards).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from curvlab.curvature.taylor import _checked
from curvlab.engine import params as param_dicts
from curvlab.engine.forward import forward_quadratic_form
from curvlab.engine.hvp import CurvaturePoint, working_dtype
from curvlab.engine.loss import LossFn
from curvlab.errors import CurvlabError
from curvlab.util.codec import Record


@dataclass(frozen=True)
class DirectionalCurvatureEstimate(Record):
    r"""One estimate of :math:`\langle Z, H[Z]\rangle` along a direction Z.

    Attributes:
        estimator: the estimator's name (one of :data:`ESTIMATORS`).
        zhz: the estimate of :math:`\langle Z, H[Z]\rangle`.
        nds: ``zhz`` / :math:`\|Z\|^2`.
        error: the estimator's own error estimate on ``nds`` (``None``: exact up to rounding).
        forwards: forward passes spent (a gradient is one forward and one backward).
        backwards: backward passes spent (a second backward through a kept graph counts as one).
        detail: method-specific values (steps, fitted terms, parts of the error).
    """

    estimator: str
    zhz: float
    nds: float
    error: float | None
    forwards: int
    backwards: int
    detail: dict[str, Any] = field(default_factory=dict)


def _prepared(params: Mapping[str, Tensor], z: Mapping[str, Tensor], dtype: torch.dtype | None):
    r"""The working dtype, Z checked and cast to it, and :math:`\|Z\|^2`."""
    dt = working_dtype(params, dtype=dtype)
    zc, squares = _checked(params, z, dt)
    return dt, zc, float(sum(squares.values()))


def unit_roundoff(dt: torch.dtype, device: torch.device) -> float:
    """The unit roundoff the loss is computed with: the working dtype's, or autocast's where it is on for
    ``device``'s type and coarser (under bfloat16 autocast a float32 point's products round at 2^-7)."""
    eps = torch.finfo(dt).eps
    if torch.is_autocast_enabled(device.type):
        eps = max(eps, torch.finfo(torch.get_autocast_dtype(device.type)).eps)
    return float(eps)


def _estimate(name: str, zhz: float, zz: float, error: float | None, f: int, b: int, **detail):
    return DirectionalCurvatureEstimate(name, zhz, zhz / zz, error, f, b, detail)


def exact(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
) -> DirectionalCurvatureEstimate:
    r""":math:`\langle Z, H[Z]\rangle` by one HVP, double backward at a :class:`~curvlab.engine.hvp.CurvaturePoint`.

    Cost: one forward and the first backward (its graph kept), then one second backward: ``forwards=1``,
    ``backwards=2``. Error ``None``: exact up to the rounding of the working dtype.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or several (accumulated with loss-term weights).
        z: the direction Z, a dict like ``params``.
        dtype: computation dtype (default float32, or float64 when the parameters are).

    Returns:
        The :class:`DirectionalCurvatureEstimate` (``detail``: ``gz`` = :math:`\langle G, Z\rangle`).

    Raises:
        CurvlabError: Z mismatched with the parameters, non-finite, or zero.
    """
    dt, zc, zz = _prepared(params, z, dtype)
    with CurvaturePoint(loss_fn, params, batch, dtype=dt) as point:
        zhz = param_dicts.dot(zc, point.hvp(zc))
        gz = param_dicts.dot(point.gradient, zc)
    return _estimate("exact", zhz, zz, None, 1, 2, gz=gz)


def finite_difference(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
    step: float | None = None,
) -> DirectionalCurvatureEstimate:
    r"""The NDS by central differences of gradients projected on :math:`u = Z/\|Z\|` (module docstring).

    With :math:`d(h) = \langle u, G(W+hu) - G(W-hu)\rangle/(2h)`, the estimate is :math:`d(h)` and its stated
    error is :math:`e = |d(h) - d(2h)|/3 + 4\epsilon(\|G(W+hu)\| + \|G(W-hu)\|)/(2h)`: Richardson's estimate of
    the :math:`h^2` truncation (the :math:`h^2` terms of d(h) and d(2h) differ by a factor 4) plus the gradients'
    rounding (ε the unit roundoff of the working dtype, or autocast's where it is on: :func:`unit_roundoff`), a
    bound whenever the third derivative varies little over :math:`[-2h, 2h]`. Default step :math:`h =
    \epsilon^{1/3}`, the rule of :func:`~curvlab.engine.finite_difference.finite_difference_hvp`, which balances
    the two terms. Cost: four gradients, ``forwards=4``, ``backwards=4``.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or several (accumulated with loss-term weights).
        z: the direction Z, a dict like ``params``.
        dtype: computation dtype (default float32, or float64 when the parameters are).
        step: h along u (default :math:`\epsilon^{1/3}`).

    Returns:
        The :class:`DirectionalCurvatureEstimate` (``detail``: ``step``, ``truncation``, ``rounding``,
        ``nds_2h`` = d(2h)).

    Raises:
        CurvlabError: Z mismatched with the parameters, non-finite or zero; a step that is not positive.
    """
    dt, zc, zz = _prepared(params, z, dtype)
    eps = unit_roundoff(dt, next(iter(params.values())).device)
    h = float(eps ** (1 / 3)) if step is None else float(step)
    if not h > 0:
        raise CurvlabError(f"the finite-difference step must be positive, got {step}")
    p, u = param_dicts.cast(params, dt), param_dicts.scale(zc, zz**-0.5)

    def gradient(t: float) -> param_dicts.Params:
        # a "fwd_rev" point keeps no graph: its gradient is one forward and one backward
        return CurvaturePoint(loss_fn, param_dicts.add(p, u, t), batch, method="fwd_rev", dtype=dt).gradient

    g_plus, g_minus = gradient(h), gradient(-h)
    d1 = (param_dicts.dot(u, g_plus) - param_dicts.dot(u, g_minus)) / (2 * h)
    d2 = (param_dicts.dot(u, gradient(2 * h)) - param_dicts.dot(u, gradient(-2 * h))) / (4 * h)
    truncation = abs(d1 - d2) / 3
    rounding = 4 * eps * (param_dicts.norm(g_plus) + param_dicts.norm(g_minus)) / (2 * h)
    return _estimate(
        "finite_difference", d1 * zz, zz, truncation + rounding, 4, 4,
        step=h, truncation=truncation, rounding=rounding, nds_2h=d2,
    )  # fmt: skip


def _first_order(loss_fn: LossFn, params, batch, zc, dt) -> tuple[CurvaturePoint, param_dicts.Params, float, float]:
    """A graph-free point (its loss and gradient: one forward, one backward), W cast, L(W) and <G, Z>."""
    point = CurvaturePoint(loss_fn, params, batch, method="fwd_rev", dtype=dt)
    return point, point.params, point.loss, param_dicts.dot(point.gradient, zc)


def _rounding(eps: float, loss: float, other: float) -> float:
    """The stated rounding of a loss difference: 4ε(|L(W)| + |L(W')|), as for the gradients."""
    return 4 * eps * (abs(loss) + abs(other))


def _fit(alphas: np.ndarray, f: np.ndarray, powers: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    r"""Least squares of ``f`` on the columns :math:`\alpha^k`, scaled to unit columns: coefficients and the
    pseudo-inverse's rows (each coefficient as a linear functional of f)."""
    design = np.stack([alphas**k for k in powers], axis=1)
    norms = np.linalg.norm(design, axis=0)
    pinv = np.linalg.pinv(design / norms) / norms[:, None]
    return pinv @ f, pinv


def quadratic_fit(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
    steps: Sequence[float] | None = None,
    points: int = 4,
) -> DirectionalCurvatureEstimate:
    r""":math:`\langle Z, H[Z]\rangle = 2a` from a least-squares fit of :math:`f(\alpha) = L(W - \alpha Z) - L(W) +
    \alpha\langle G, Z\rangle = a\alpha^2 + b\alpha^3` over a grid of step sizes α (losses only, and one gradient).

    Grid: :math:`\alpha_k = s_0 2^k / \|Z\|`, k = 0 … ``points`` - 1, with :math:`s_0 = (\epsilon \max(|L|,
    1))^{1/4}`: the step length along u at which the rounding of f, about :math:`\epsilon|L|`, divided by
    :math:`s^2`, balances the quartic truncation, about :math:`s^2` (so it assumes parameters and curvatures of
    order one). The error is ``truncation + rounding``: ``truncation`` = :math:`|2a_4 - 2a|`, the change of 2a
    when a quartic term joins the fit; ``rounding`` = :math:`2\sum_k |c_k| \max(\delta_k, \hat\sigma)`, with
    :math:`c_k` the weights that make a from the :math:`f_k`, :math:`\delta_k = 4\epsilon(|L| + |L(W-\alpha_k Z)|)`
    and :math:`\hat\sigma` the fit's residual RMS. Cost: one gradient and ``points`` losses: ``forwards = 1 +
    points``, ``backwards = 1``.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or several (accumulated with loss-term weights).
        z: the direction Z, a dict like ``params``.
        dtype: computation dtype (default float32, or float64 when the parameters are).
        steps: the step sizes α yourself (at least 3, positive; default the grid above).
        points: the grid's number of step sizes (at least 3; ignored with ``steps``).

    Returns:
        The :class:`DirectionalCurvatureEstimate` (``detail``: ``steps``, ``cubic`` = b, ``third_derivative`` =
        :math:`\nabla^3L[Z,Z,Z] = -6b`, ``gz``, ``truncation``, ``rounding``, ``residual``).

    Raises:
        CurvlabError: Z mismatched with the parameters, non-finite or zero; fewer than 3 step sizes, or one
            that is not positive.
    """
    dt, zc, zz = _prepared(params, z, dtype)
    point, p, loss, gz = _first_order(loss_fn, params, batch, zc, dt)
    eps = unit_roundoff(dt, next(iter(params.values())).device)
    if steps is None:
        s0 = (eps * max(abs(loss), 1.0)) ** 0.25
        steps = [s0 * 2**k / zz**0.5 for k in range(points)]
    alphas = np.asarray([float(a) for a in steps], dtype=np.float64)
    if alphas.size < 3 or not (alphas > 0).all():
        raise CurvlabError(f"quadratic_fit needs at least 3 positive step sizes, got {list(alphas)}")
    losses = np.asarray([point.loss_at(param_dicts.add(p, zc, -float(a))) for a in alphas])
    f = losses - loss + alphas * gz
    (a, b), pinv = _fit(alphas, f, (2, 3))
    a4 = _fit(alphas, f, (2, 3, 4))[0][0] if alphas.size > 3 else a
    residual = f - a * alphas**2 - b * alphas**3
    sigma = float(np.sqrt(np.mean(residual**2) * alphas.size / max(alphas.size - 2, 1)))
    delta = np.asarray([max(_rounding(eps, loss, x), sigma) for x in losses])
    truncation, rounding = 2 * abs(float(a4 - a)), 2 * float(np.abs(pinv[0]) @ delta)
    return _estimate(
        "quadratic_fit", 2 * float(a), zz, (truncation + rounding) / zz, 1 + alphas.size, 1,
        steps=alphas.tolist(), cubic=float(b), third_derivative=-6 * float(b), gz=gz,
        truncation=truncation / zz, rounding=rounding / zz, residual=sigma,
    )  # fmt: skip


def forward(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
) -> DirectionalCurvatureEstimate:
    r""":math:`\langle Z, H[Z]\rangle` by forward-over-forward AD, the second derivative of
    :math:`t \mapsto L(W + tZ)` at 0 (:func:`~curvlab.engine.forward.forward_quadratic_form`).

    That function runs the model under :func:`~curvlab.engine.exact.exact_second_order` with method
    ``"fwd_fwd"``, which reroutes LayerNorm, InstanceNorm and batch-statistics BatchNorm through composites (their
    fused kernels' second-order forward-mode formulas are wrong on torch 2.13), so it is exact on any model. Cost:
    one forward pass carrying two tangents (about three plain forwards), no backward: ``forwards=1``,
    ``backwards=0``. Error ``None``: exact up to rounding.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or several (accumulated with loss-term weights).
        z: the direction Z, a dict like ``params``.
        dtype: computation dtype (default float32, or float64 when the parameters are).

    Returns:
        The :class:`DirectionalCurvatureEstimate` (``detail``: ``gz`` = :math:`\langle G, Z\rangle`).

    Raises:
        CurvlabError: Z mismatched with the parameters, non-finite, or zero.
    """
    dt, zc, zz = _prepared(params, z, dtype)
    gz, zhz = forward_quadratic_form(loss_fn, params, batch, zc, dtype=dt)
    return _estimate("forward", zhz, zz, None, 1, 0, gz=gz)


_BY_NAME = {
    "exact": exact,
    "finite_difference": finite_difference,
    "quadratic_fit": quadratic_fit,
    "forward": forward,
}
ESTIMATORS = tuple(_BY_NAME)
"""The estimators' names, for :func:`directional_curvature`'s ``estimator=``."""


def directional_curvature(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    *,
    estimator: str = "exact",
    **options: Any,
) -> DirectionalCurvatureEstimate:
    r"""One estimate of :math:`\langle Z, H[Z]\rangle` by the estimator named (module docstring).

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or several (accumulated with loss-term weights).
        z: the direction Z, a dict like ``params``.
        estimator: one of :data:`ESTIMATORS` (default ``"exact"``).
        **options: the estimator's keyword options (``dtype``, ``step``, ``steps``, ``points``, ``rtol``).

    Returns:
        The :class:`DirectionalCurvatureEstimate`.

    Raises:
        CurvlabError: an unknown estimator, or the estimator's own errors.
    """
    if estimator not in _BY_NAME:
        raise CurvlabError(f"unknown estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
    return _BY_NAME[estimator](loss_fn, params, batch, z, **options)
