r"""Adam's diagonal preconditioner and its edge of stability, read from an optimizer's state: what the
preconditioned sharpness :math:`\lambda_{\max}(P^{-1/2} H P^{-1/2})`
(:func:`~curvlab.curvature.preconditioned.preconditioned_sharpness`, ``curvlab spectrum --preconditioned``)
is measured with and against.

**The preconditioner.** After t steps Adam (and AdamW, whose decoupled weight decay is left out) holds
:math:`m_t = \beta_1 m_{t-1} + (1-\beta_1) g_t` and :math:`v_t = \beta_2 v_{t-1} + (1-\beta_2) g_t^2`, and
steps

.. math::
    W \leftarrow W - \eta\,\frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t)} + \epsilon}
      = W - \eta\,P_t^{-1} m_t,\qquad
    P_t = (1-\beta_1^t)\Bigl(\sqrt{\hat v_t} + \epsilon\Bigr),\quad \hat v_t = \frac{v_t}{1-\beta_2^t}

(Cohen et al. 2022, "Adaptive gradient methods at the edge of stability"). With P frozen, that is
heavy-ball momentum on the *uncorrected* average :math:`m_t` in P's metric, whose threshold is
:func:`adam_edge_of_stability`: the factor :math:`1-\beta_1^t` (the first moment's bias correction)
belongs in P for the preconditioned sharpness to be compared with it. It is 0.65 at t = 10 and within
:math:`10^{-4}` of 1 from t = 88 on (:math:`\beta_1 = 0.9`); leaving it out
(``bias_correction=False``: :math:`P = \sqrt{\hat v_t} + \epsilon`) multiplies the sharpness by
:math:`1-\beta_1^t`, under-reporting it early in training.

**Groups at different learning rates** (AdamW's ``hidden_lr``, µP-style: the hidden matrices at their own
lr). Group g steps :math:`W_g \leftarrow W_g - \eta_g P_g^{-1} m_g
= W_g - \eta_{\max}\,(\eta_g/\eta_{\max})\,P_g^{-1} m_g`: one step of size :math:`\eta_{\max}`, the
largest lr, with the preconditioner :math:`P_g\,\eta_{\max}/\eta_g`. The edge-of-stability analysis
holds for it unchanged, exactly, provided the groups share :math:`\beta_1` (the momentum recursion):
:func:`adam_step_settings` gives :math:`\eta_{\max}`, and ``adam_preconditioner(..., scale_by_lr=True)``
that P (:func:`adam_lr_ratios`: :math:`\eta_g/\eta_{\max}` per parameter), so that
:math:`P^{-1} = \operatorname{diag}\bigl((\eta_g/\eta_{\max})\,/\,((1-\beta_1^t)(\sqrt{\hat v_t} + \epsilon))\bigr)`.
With one lr every ratio is 1 and P is unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from curvlab.engine import params as param_dicts
from curvlab.errors import CurvlabError


def adam_preconditioner(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    names: Sequence[str] | None = None,
    *,
    bias_correction: bool = True,
    scale_by_lr: bool = False,
) -> dict[str, Tensor]:
    r"""Adam's diagonal preconditioner :math:`P_t` (module docstring) from an optimizer's state, per
    parameter, with its own step count t and its group's :math:`\beta_1, \beta_2, \epsilon` (AMSGrad's
    running maximum of v in place of v), so that the next step is :math:`-\eta P^{-1} m` with the state's
    :math:`m` (``exp_avg``) exactly when ``bias_correction`` is True.

    Args:
        optimizer: a ``torch.optim.Adam`` or ``AdamW`` (or any optimizer with their state and groups)
            after at least one step.
        model: the module whose parameters it steps.
        names: the parameters to read, by their names in ``model`` (default: every parameter that
            requires a gradient).
        bias_correction: whether P carries the first moment's bias correction :math:`1 - \beta_1^t` (the
            paper's P, the one :func:`adam_edge_of_stability` applies to) or is :math:`\sqrt{\hat v_t} + \epsilon`;
            the second moment is bias-corrected either way, as Adam's step is.
        scale_by_lr: whether each P is divided by its group's :math:`\eta_g/\eta_{\max}`
            (:func:`adam_lr_ratios`; module docstring), so that every group's next step is
            :math:`-\eta_{\max} P^{-1} m` with :math:`\eta_{\max}` from :func:`adam_step_settings`: the P
            to compare with the edge of stability at that lr when the groups' lrs differ (default False:
            each group's own P, stepped at its own lr; the same P where the lrs are equal).

    Returns:
        ``{name: P}``, each float64 and shaped like its parameter, on its state's device, in ``names``'
        order: a preconditioner for :func:`~curvlab.curvature.preconditioned.preconditioned_sharpness`.

    Raises:
        CurvlabError: a name not in the model, a parameter without Adam state (``exp_avg_sq``, e.g.
            Muon's matrices), a state before its first step, or (``scale_by_lr``) a group at lr 0 beside
            groups that step.
    """
    table = dict(model.named_parameters())
    names = [n for n, p in table.items() if p.requires_grad] if names is None else list(names)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise CurvlabError(f"the model has no parameters {param_dicts.names_text(unknown)}")
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    ratios = adam_lr_ratios(optimizer, model, names) if scale_by_lr else {}
    out = {}
    for n in names:
        p = table[n]
        state, group = optimizer.state.get(p, {}), group_of.get(id(p), {})
        if "exp_avg_sq" not in state or "betas" not in group:
            raise CurvlabError(f"{n} has no Adam state (exp_avg_sq): the preconditioned sharpness needs Adam's")
        (beta1, beta2), eps, step = group["betas"], group["eps"], float(state["step"])
        if not step >= 1:
            raise CurvlabError(f"{n}'s Adam state has taken no step yet: no preconditioner")
        v = state["max_exp_avg_sq"] if group.get("amsgrad") else state["exp_avg_sq"]
        diagonal = (v.detach().double() / (1 - float(beta2) ** step)).sqrt() + eps
        diagonal = diagonal * (1 - float(beta1) ** step) if bias_correction else diagonal
        # (a ratio of 1, every group at the largest lr, leaves P exactly as it was)
        out[n] = diagonal / ratios[n] if ratios.get(n, 1.0) != 1.0 else diagonal
    return out


def adam_lr_ratios(
    optimizer: torch.optim.Optimizer, model: torch.nn.Module, names: Sequence[str] | None = None
) -> dict[str, float]:
    r"""Each parameter's Adam group lr over the largest lr of the optimizer's Adam groups,
    :math:`\eta_g/\eta_{\max}` (module docstring): what ``adam_preconditioner(..., scale_by_lr=True)``
    divides P by.

    Args:
        optimizer: the optimizer whose groups (those with ``betas``) give the lrs.
        model: the module whose parameters it steps.
        names: the parameters, by their names in ``model`` (default: every parameter that requires a
            gradient); one outside every Adam group gets no entry.

    Returns:
        ``{name: ratio}`` in ``names``' order, each in (0, 1]; exactly 1 where the group's lr is the largest,
        and everywhere when the lrs are all equal (0 among them included).

    Raises:
        CurvlabError: a group at lr 0 beside groups that step: in the largest lr's metric its P would be
            infinite.
    """
    table = dict(model.named_parameters())
    names = [n for n, p in table.items() if p.requires_grad] if names is None else list(names)
    groups = [g for g in optimizer.param_groups if "betas" in g]
    lr_of = {id(p): float(g["lr"]) for g in groups for p in g["params"]}
    top = max((float(g["lr"]) for g in groups), default=0.0)  # (adam_step_settings' lr, empty groups included)
    out = {}
    for n in names:
        lr = lr_of.get(id(table[n])) if n in table else None
        if lr is None:
            continue
        if not lr > 0 and top > 0:
            raise CurvlabError(f"{n}'s Adam group has lr {lr} beside groups at up to {top}: no common step size")
        out[n] = 1.0 if lr == top else lr / top
    return out


def adam_edge_of_stability(lr: float, beta1: float) -> float:
    r"""Adam's edge of stability

    .. math::  \frac{2 + 2\beta_1}{(1 - \beta_1)\,\eta}

    On a quadratic, heavy-ball momentum :math:`m \leftarrow \beta_1 m + (1 - \beta_1) g`,
    :math:`W \leftarrow W - \eta P^{-1} m` with a frozen P is stable while the preconditioned sharpness
    :math:`\lambda_{\max}(P^{-1/2} H P^{-1/2})` stays below it (Cohen et al. 2022); 38/η at
    :math:`\beta_1 = 0.9`, and gradient descent's 2/η at :math:`\beta_1 = 0`. It applies to P with the
    first moment's bias correction (:func:`adam_preconditioner`).

    Args:
        lr: the learning rate η (> 0).
        beta1: the momentum :math:`\beta_1`, in [0, 1).

    Returns:
        The threshold, in the units of the sharpness.

    Raises:
        CurvlabError: a learning rate that is not positive, or :math:`\beta_1` outside [0, 1).
    """
    if not lr > 0:
        raise CurvlabError(f"the learning rate must be positive for an edge of stability, got {lr}")
    if not 0 <= beta1 < 1:
        raise CurvlabError(f"beta1 must lie in [0, 1), got {beta1}")
    return (2 + 2 * beta1) / ((1 - beta1) * lr)


def adam_step_settings(optimizer: torch.optim.Optimizer, *, mixed_lrs: bool = False) -> tuple[float, float]:
    r"""The ``(lr, beta1)`` of ``optimizer``'s Adam groups for their edge of stability: the one lr they share, or
    with ``mixed_lrs`` the largest lr :math:`\eta_{\max}` of the groups (those at smaller lrs then enter through
    their P, ``adam_preconditioner(..., scale_by_lr=True)``; module docstring), and the :math:`\beta_1` that every
    group shares.

    Raises:
        CurvlabError: no Adam group, groups that differ in beta1 (no one momentum recursion), or (without
            ``mixed_lrs``) in lr: the caller's P must then be scaled to the largest.
    """
    groups = [g for g in optimizer.param_groups if "betas" in g]
    beta1s = {float(g["betas"][0]) for g in groups}
    if len(beta1s) != 1:
        raise CurvlabError(
            f"the preconditioned sharpness needs one Adam beta1, found {len(beta1s)} among the optimizer's groups"
        )
    lrs = {float(g["lr"]) for g in groups}
    if len(lrs) > 1 and not mixed_lrs:
        raise CurvlabError(
            f"the optimizer's Adam groups have {len(lrs)} learning rates: pass mixed_lrs=True and scale P with "
            "adam_preconditioner(..., scale_by_lr=True)"
        )
    return max(lrs), beta1s.pop()
