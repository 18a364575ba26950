r"""The Gauss–Newton part of the curvature along a direction, and the residual that carries all its negative part.

For a loss :math:`L(W) = \ell(f(W))` of the model's outputs f (the logits), the Hessian splits into the
generalized Gauss–Newton matrix and a residual:

.. math::
    H = J^\top H_\ell J + \sum_k \frac{\partial \ell}{\partial f_k} \nabla^2 f_k,\qquad
    \langle Z, H[Z]\rangle = \underbrace{\langle JZ, H_\ell\, JZ\rangle}_{\text{Gauss–Newton}}
        + \underbrace{\langle Z, R[Z]\rangle}_{\text{residual}},

with J the Jacobian of the outputs and :math:`H_\ell` the loss's Hessian in the outputs. For cross-entropy and
squared error :math:`H_\ell` is positive semidefinite, so the Gauss–Newton part is never negative and every
negative curvature along Z lives in the residual: the network's own second derivatives, weighted by the loss's
gradient in the outputs (which vanishes where the model fits its targets).

:math:`JZ` is one forward-mode Jacobian-vector product through the network (``torch.func.jvp``, inside the
exact mode of the ``"fwd_rev"`` method, whose reroutings make forward-mode derivatives exact), and
:math:`H_\ell` is in closed form, per counted position t of a mean over N:

* cross-entropy, :math:`p_t = \mathrm{softmax}(f_t)`: :math:`\langle v, H_\ell v\rangle = \frac1N \sum_t
  \big(\sum_c p_{tc} v_{tc}^2 - (\sum_c p_{tc} v_{tc})^2\big)`, the variance of :math:`v_t` under
  :math:`p_t` (label smoothing changes the targets' linear term only, so the same form holds);
* squared error (``mse_loss``): :math:`\frac{2}{n}\sum v^2` for the mean over n entries, :math:`2\sum v^2`
  for the sum.

Several batches are weighted by their loss terms, as the loss itself (:func:`~curvlab.engine.loss.weighted_batches`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import jvp

from curvlab.curvature.taylor import _checked
from curvlab.engine import params as param_dicts
from curvlab.engine.hvp import CurvaturePoint, working_dtype
from curvlab.engine.loss import ModuleLoss, base_model, logits_of, router_losses, token_cross_entropy
from curvlab.errors import CurvlabError
from curvlab.util.codec import Record

OutputForm = Callable[[Tensor, Tensor, Any], Tensor]
"""``form(logits, tangent, targets) -> <v, H_l v>`` for one batch (already shifted as the loss compares them)."""


@dataclass(frozen=True)
class GaussNewtonSplit(Record):
    r""":math:`\langle Z, H[Z]\rangle` along one direction split into its Gauss–Newton part and the residual.

    Attributes:
        zhz: :math:`\langle Z, H[Z]\rangle`, exact (double backward).
        gauss_newton: :math:`\langle JZ, H_\ell JZ\rangle` (never negative for cross-entropy and squared error).
        residual: ``zhz - gauss_newton``.
        nds: ``zhz`` / :math:`\|Z\|^2`.
        nds_gauss_newton: ``gauss_newton`` / :math:`\|Z\|^2`.
        nds_residual: ``residual`` / :math:`\|Z\|^2`.
    """

    zhz: float
    gauss_newton: float
    residual: float
    nds: float
    nds_gauss_newton: float
    nds_residual: float


def _variance_form(logits: Tensor, tangent: Tensor, targets: Tensor, ignore_index: int) -> Tensor:
    """The cross-entropy form over the positions whose target isn't ``ignore_index``, mean over them."""
    if logits.dtype in (torch.bfloat16, torch.float16):  # (as token_cross_entropy computes the loss)
        logits, tangent = logits.float(), tangent.float()
    classes = logits.size(-1)
    keep = targets.reshape(-1) != ignore_index
    if targets.is_floating_point() or keep.numel() != logits.numel() // max(classes, 1):
        raise CurvlabError(
            f"the cross-entropy's Gauss–Newton form takes one class index per position: targets "
            f"{tuple(targets.shape)} ({targets.dtype}) don't index logits {tuple(logits.shape)}"
        )
    f, v = logits.reshape(-1, classes)[keep], tangent.reshape(-1, classes)[keep]
    if f.shape[0] == 0:
        raise CurvlabError("the batch has no counted target (every label is ignore_index): the loss is undefined")
    p = torch.softmax(f, dim=-1)
    # centred before squaring: E[v^2] - E[v]^2 cancels catastrophically when v shares a large shift per position
    # (which softmax ignores), and could even come out negative
    centred = v - (p * v).sum(-1, keepdim=True)
    return (p * centred * centred).sum(-1).mean()


def cross_entropy_form(ignore_index: int = -100) -> OutputForm:
    r"""The closed-form :math:`\langle v, H_\ell v\rangle` of the mean token cross-entropy (module docstring).

    Args:
        ignore_index: the target value left out of the mean.

    Returns:
        ``form(logits, tangent, targets)``, classes along the last axis.
    """
    return lambda logits, tangent, targets: _variance_form(logits, tangent, targets, ignore_index)


def squared_error_form(reduction: str = "mean") -> OutputForm:
    r"""The closed-form :math:`\langle v, H_\ell v\rangle` of ``mse_loss``: :math:`\frac2n\sum v^2` (mean over n
    entries) or :math:`2\sum v^2` (sum).

    Args:
        reduction: ``"mean"`` or ``"sum"``, as the loss reduces.

    Returns:
        ``form(logits, tangent, targets)``.

    Raises:
        CurvlabError: another reduction (``"none"`` is no scalar loss).
    """
    if reduction not in ("mean", "sum"):
        raise CurvlabError(f"the squared error's Gauss–Newton form needs reduction 'mean' or 'sum', got {reduction!r}")
    scale = (lambda n: 2.0 / n) if reduction == "mean" else (lambda n: 2.0)

    def form(logits: Tensor, tangent: Tensor, targets: Any) -> Tensor:
        v = tangent.float() if tangent.dtype in (torch.bfloat16, torch.float16) else tangent
        return scale(v.numel()) * (v * v).sum()

    return form


def _criterion_form(criterion: Any, logits_dim: int) -> OutputForm | None:
    """The form of a criterion curvlab knows (None: unknown)."""
    if criterion is F.mse_loss:
        return squared_error_form()
    if isinstance(criterion, nn.MSELoss):
        return squared_error_form(criterion.reduction)
    if criterion is token_cross_entropy:
        return cross_entropy_form()
    plain_ce = criterion is F.cross_entropy
    module_ce = isinstance(criterion, nn.CrossEntropyLoss) and criterion.weight is None
    if (plain_ce or module_ce) and logits_dim == 2:  # (classes on the last axis, as the closed form takes them)
        if module_ce and criterion.reduction != "mean":
            return None
        return cross_entropy_form(criterion.ignore_index if module_ce else -100)
    return None


def output_form(loss_fn: ModuleLoss, logits: Tensor, targets: Any = None) -> OutputForm:
    r"""The closed-form output Hessian's quadratic form of a :class:`~curvlab.engine.loss.ModuleLoss`'s loss.

    Args:
        loss_fn: the loss function (its criterion, or the model's own loss).
        logits: one batch's logits, as the model returns them (their rank picks the criterion's class axis).
        targets: the batch's targets (a sequence classifier without a problem type decides by their dtype).

    Returns:
        The :data:`OutputForm`.

    Raises:
        CurvlabError: a loss whose output Hessian curvlab has no closed form for (a criterion other than
            cross-entropy or squared error, class weights, a multi-label model).
    """
    if loss_fn.criterion is not None:
        form = _criterion_form(loss_fn.criterion, logits.dim())
        if form is None:
            name = getattr(loss_fn.criterion, "__name__", type(loss_fn.criterion).__name__)
            raise CurvlabError(
                f"the Gauss–Newton split knows cross-entropy (no class weights, mean, classes on the last axis) "
                f"and squared error (mean or sum), not the criterion {name}"
            )
        return form
    if loss_fn.task == "sequence_classification":
        problem = _sequence_problem(loss_fn, targets)
        if problem == "regression":
            return squared_error_form()
        if problem != "single_label_classification":
            raise CurvlabError(f"the Gauss–Newton split knows cross-entropy and squared error, not a {problem} model")
    return cross_entropy_form(loss_fn.ignore_index)


def _sequence_problem(loss_fn: ModuleLoss, targets: Any) -> str:
    """A sequence classifier's problem type as its own loss decides it (:meth:`ModuleLoss._sequence_loss`): the
    config's, else regression for one label, single-label for integer labels, multi-label otherwise."""
    config = base_model(loss_fn.model).config
    if config.problem_type is not None:
        return config.problem_type
    if config.num_labels == 1:
        return "regression"
    integer = isinstance(targets, Tensor) and targets.dtype in (torch.int64, torch.int32)
    return "single_label_classification" if integer else "multi_label_classification"


def _batch_form(loss_fn: ModuleLoss, params: Mapping[str, Tensor], z: Mapping[str, Tensor], batch: Any) -> Tensor:
    r""":math:`\langle JZ, H_\ell JZ\rangle` on one batch."""
    targets = None

    def logits(p: Mapping[str, Tensor]) -> Tensor:
        nonlocal targets
        output, targets = loss_fn.forward(p, batch)
        if loss_fn.router_loss and router_losses(output):
            raise CurvlabError(
                "the model adds router losses, whose output Hessian curvlab has no closed form for: "
                "make the loss function with router_loss=False (the language model's loss alone)"
            )
        return logits_of(output)

    f, v = jvp(logits, (dict(params),), (dict(z),))
    form = output_form(loss_fn, f, targets)
    shifted = loss_fn.targets(targets)
    if loss_fn.shift:
        f, v = f[..., :-1, :], v[..., :-1, :]
    return form(f, v, shifted)


def gauss_newton_at(point: CurvaturePoint, z: Mapping[str, Tensor]) -> float:
    r""":math:`\langle JZ, H_\ell JZ\rangle` at an open :class:`~curvlab.engine.hvp.CurvaturePoint`, on its batches with
    their weights (:meth:`~curvlab.engine.hvp.CurvaturePoint.batch_sum`): one forward pass carrying one tangent
    per batch (about two plain forwards), no backward.

    Args:
        point: the point, of a :class:`~curvlab.engine.loss.ModuleLoss` (the split needs the model's outputs,
            which a plain ``loss_fn(params, batch)`` hides).
        z: the direction Z, a dict like the point's parameters (cast to its dtype).

    Returns:
        The Gauss–Newton quadratic form, a Python float.

    Raises:
        CurvlabError: a loss function that isn't a ``ModuleLoss`` (sharded parameters' included), a loss
            without a closed-form output Hessian (:func:`output_form`), Z mismatched with the parameters.
    """
    loss_fn = point.loss_fn
    if point.sharded:
        raise CurvlabError("the Gauss–Newton split of sharded (FSDP) parameters is not available yet: run unsharded")
    if not isinstance(loss_fn, ModuleLoss):
        raise CurvlabError(
            f"the Gauss–Newton split needs the model's outputs: pass a ModuleLoss (curvlab.make_loss_fn(model)), "
            f"not a {type(loss_fn).__name__}"
        )
    param_dicts.check_like(point.params, z)
    zc = param_dicts.cast(dict(z), point.dtype)
    with torch.no_grad():  # (forward mode alone: no graph to keep)
        return point.batch_sum(lambda b: _batch_form(loss_fn, point.params, zc, b), method="fwd_rev")


def gauss_newton_form(
    loss_fn: ModuleLoss,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
) -> float:
    r""":math:`\langle JZ, H_\ell JZ\rangle`, the Gauss–Newton part of :math:`\langle Z, H[Z]\rangle` (module docstring;
    :func:`gauss_newton_at` at a point made for it, which keeps nothing).

    Args:
        loss_fn: a :class:`~curvlab.engine.loss.ModuleLoss` (:func:`~curvlab.engine.loss.make_loss_fn`).
        params: parameter dict W (not modified).
        batch: one batch, or several (weighted by their loss terms).
        z: the direction Z, a dict like ``params``.
        dtype: computation dtype (default float32, or float64 when the parameters are).

    Returns:
        The Gauss–Newton quadratic form, a Python float.

    Raises:
        CurvlabError: as :func:`gauss_newton_at`; Z non-finite or zero.
    """
    dt = working_dtype(params, dtype=dtype)
    zc, _ = _checked(params, z, dt)
    with CurvaturePoint(loss_fn, params, batch, method="fwd_rev", dtype=dt) as point:
        return gauss_newton_at(point, zc)


def gauss_newton_split(
    loss_fn: ModuleLoss,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
) -> GaussNewtonSplit:
    r""":math:`\langle Z, H[Z]\rangle` (exact, one HVP by double backward) and its Gauss–Newton part and residual
    (module docstring), at one point.

    Args:
        loss_fn: a :class:`~curvlab.engine.loss.ModuleLoss`.
        params: parameter dict W (not modified).
        batch: one batch, or several (weighted by their loss terms).
        z: the direction Z, a dict like ``params``.
        dtype: computation dtype (default float32, or float64 when the parameters are).

    Returns:
        The :class:`GaussNewtonSplit`.

    Raises:
        CurvlabError: as :func:`gauss_newton_form`.
    """
    dt = working_dtype(params, dtype=dtype)
    zc, squares = _checked(params, z, dt)
    zz = float(sum(squares.values()))
    with CurvaturePoint(loss_fn, params, batch, dtype=dt) as point:
        gn = gauss_newton_at(point, zc)
        zhz = param_dicts.dot(zc, point.hvp(zc))
    return GaussNewtonSplit(zhz, gn, zhz - gn, zhz / zz, gn / zz, (zhz - gn) / zz)
