r"""Everything the edge of stability asks at one point, in one call (:func:`stability_point`): the
sharpness :math:`\lambda_{\max}(H)`, the optimizer's preconditioned sharpness
:math:`\lambda_{\max}(P^{-1/2} H P^{-1/2})` with its frozen P, and the thresholds they are compared with.

Gradient descent with step η is stable on the quadratic model while :math:`\lambda_{\max}(H) < 2/\eta`;
a preconditioned momentum method while :math:`\lambda_{\max}(P^{-1/2} H P^{-1/2})` stays below its own
threshold: Adam's :math:`(2 + 2\beta_1)/((1 - \beta_1)\eta)` (:func:`~curvlab.optim.adam.adam_edge_of_stability`),
Muon's :math:`2(1+\mu)/((1-\mu)(1+2\mu)\eta)` (:mod:`curvlab.steps.stability`). Full-batch training
drives the sharpness up to the threshold and holds it there (Cohen et al. 2021, 2022).

**A lower bound from** :math:`v_1`. For any vector w, :math:`u = P^{1/2} w / \|P^{1/2} w\|` is a unit
vector with :math:`u^\top P^{-1/2} H P^{-1/2} u = w^\top H w / w^\top P w`, so

.. math::  \lambda_{\max}(P^{-1/2} H P^{-1/2}) \;\ge\; \frac{v_1^\top H v_1}{v_1^\top P v_1}

for the unit top eigenvector :math:`v_1` of H (no assumption on H's other eigenvalues; the numerator is
the Ritz value :math:`\lambda_{\max}`, the Rayleigh quotient of the Ritz vector). With Adam's diagonal P
the denominator is a weighted mean of P's entries, so the preconditioned sharpness lies *below*
:math:`\lambda_{\max}(H)` only where P's entries on :math:`v_1` exceed 1 (P shrinks), and never below
:math:`\lambda_{\max}(H)/\max_i P_i`. A Lanczos value under this bound has not found the top: it is marked
unconverged (:attr:`StabilityPoint.preconditioned_bound`). Muon's P is singular (gains of 0 below msign's rank
floor) and acts on the hidden matrices only: no bound is taken there.

**Decoupled weight decay.** AdamW steps :math:`W \leftarrow (1 - \eta\gamma) W - \eta P^{-1} m` with
:math:`m \leftarrow \beta_1 m + (1 - \beta_1) g`, the decay outside m. Along an eigenvector of
:math:`P^{-1/2} H P^{-1/2}` with eigenvalue a, :math:`h = \eta a` and :math:`d = \eta\gamma`, the state
:math:`(x, \eta P^{-1} m)` moves by :math:`\begin{psmallmatrix}1 - d - (1-\beta_1)h & -\beta_1\\
(1-\beta_1)h & \beta_1\end{psmallmatrix}`: trace :math:`T = 1 + \beta_1 - d - (1-\beta_1)h`, determinant
:math:`D = \beta_1(1 - d)`. Jury's conditions: :math:`|D| < 1`; :math:`1 - T + D = (1-\beta_1)(h + d) > 0`;
and the binding one, :math:`1 + T + D = (1+\beta_1)(2 - d) - (1-\beta_1)h > 0`, so it is stable iff

.. math::  a < \frac{(1+\beta_1)(2 - \eta\gamma)}{(1-\beta_1)\eta}
               = \frac{2 + 2\beta_1}{(1-\beta_1)\eta} - \frac{1+\beta_1}{1-\beta_1}\gamma

(:math:`38/\eta - 19\gamma` at :math:`\beta_1 = 0.9`). Where every Adam group decouples one γ the threshold
is this one (:attr:`StabilityPoint.weight_decay` records γ, 0 without decay); where the groups' γ differ the
decay is no multiple of the identity, no scalar threshold follows, and the point keeps the threshold without
it (``weight_decay`` None). Coupled (L2) decay is part of the loss, :math:`H + \gamma I`, not of the step.

**Adam groups at different learning rates** (AdamW's ``hidden_lr``). Group g's step
:math:`-\eta_g P_g^{-1} m_g` is :math:`-\eta\,(P_g\,\eta/\eta_g)^{-1} m_g` at the largest lr η, so the point
takes η (:func:`~curvlab.optim.adam.adam_step_settings`) and each group's P times :math:`\eta/\eta_g`
(``adam_preconditioner(..., scale_by_lr=True)``): the analysis above holds exactly, the groups sharing
:math:`\beta_1`. Group g's decay :math:`\eta_g\gamma_g` is :math:`\eta\,(\gamma_g\eta_g/\eta)`: a multiple of the
identity, and the threshold's γ, where every group's :math:`\gamma_g\eta_g` is the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from curvlab.curvature.spectral import EigenResult, lanczos
from curvlab.engine.hvp import DEFAULT_METHOD, CurvaturePoint
from curvlab.engine.loss import LossFn
from curvlab.engine.operator import hessian_operator, preconditioned_operator
from curvlab.optim.adam import adam_edge_of_stability, adam_preconditioner, adam_step_settings
from curvlab.steps.stability import is_muon_group, muon_sharpness
from curvlab.util.codec import Record, meta

BOUND_SLACK = 10  # a value this many tolerances below the v1 bound is unconverged (lanczos' own flag's slack)


@dataclass(frozen=True)
class StabilityPoint(Record):
    r"""The edge-of-stability quantities at one point (:func:`stability_point`).

    Attributes:
        arm: ``"adam"`` or ``"muon"``: whose preconditioner.
        lr: the learning rate η of the arm's groups (Adam's: the largest of its groups', module docstring).
        lambda_max: :math:`\lambda_{\max}(H)` over all parameters.
        lambda_residual: its true residual :math:`\|H v - \lambda v\|`.
        lambda_converged: whether Lanczos converged to it within ``tol``.
        preconditioned_sharpness: :math:`\lambda_{\max}(P^{-1/2} H P^{-1/2})` (Adam's P over all
            parameters; Muon's frozen polar preconditioner on its matrices).
        preconditioned_residual: its true residual :math:`\|A u - \theta u\|`.
        preconditioned_converged: whether Lanczos converged to it within ``tol`` and it is not below
            ``preconditioned_bound`` (module docstring).
        edge_of_stability: the arm's threshold at ``lr`` (Adam's with ``weight_decay``), beside gradient
            descent's ``two_over_lr``.
        num_matvecs: the Hessian-vector products both eigenproblems took.
        bias_correction: Adam's P with the first moment's :math:`1 - \beta_1^t` or without; None for Muon.
        eigenvector: the unit eigenvector v of :math:`\lambda_{\max}(H)`, flat (not written to JSON).
        preconditioned_bound: :math:`v^\top H v / v^\top P v`, a lower bound on the preconditioned
            sharpness (module docstring; Adam's arm, None for Muon's).
        weight_decay: the decoupled weight decay γ that Adam's threshold takes (module docstring; 0 without
            decay); None: Muon's arm, or Adam groups with different γ (the threshold without it).
        lambda_min: :math:`\lambda_{\min}(H)` over all parameters (None unless asked for: ``smallest``).
        lambda_min_residual: its true residual :math:`\|H u - \lambda u\|`.
        lambda_min_converged: whether Lanczos converged to it within ``tol`` relative to the spectrum's scale
            (:math:`\max|\theta|`: a small λ_min is resolved to λ_max's scale, not its own).
    """

    arm: str
    lr: float
    lambda_max: float
    lambda_residual: float
    lambda_converged: bool
    preconditioned_sharpness: float
    preconditioned_residual: float
    preconditioned_converged: bool
    edge_of_stability: float
    num_matvecs: int
    bias_correction: bool | None
    eigenvector: Tensor = field(repr=False, compare=False, metadata=meta(skip=True))
    preconditioned_bound: float | None = None
    weight_decay: float | None = None
    lambda_min: float | None = None
    lambda_min_residual: float | None = None
    lambda_min_converged: bool | None = None
    JSON_KEYS: ClassVar[tuple] = (..., "two_over_lr")  # (derived, for readers: not read back)

    @property
    def two_over_lr(self) -> float:
        """Gradient descent's edge of stability 2/η at this point's lr."""
        return 2 / self.lr


def decoupled_weight_decay(optimizer: torch.optim.Optimizer) -> float | None:
    r"""The decoupled weight decay γ that every Adam group of ``optimizer`` shares (torch's AdamW, or Adam with
    ``decoupled_weight_decay``; 0 for coupled decay or none), or None where the groups' γ differ. Groups at
    different lrs decay by :math:`\eta_g\gamma_g` a step: they share γ, in the largest lr η's terms, where every
    :math:`\eta_g\gamma_g` is the same (module docstring), and that γ is the largest-lr group's."""
    default = isinstance(optimizer, torch.optim.AdamW)  # (a torch before the group key: AdamW decouples)
    decays = [
        (float(g["lr"]), float(g.get("weight_decay", 0.0)) if g.get("decoupled_weight_decay", default) else 0.0)
        for g in optimizer.param_groups
        if "betas" in g
    ]
    if not decays:
        return None
    lr, gamma = max(decays)
    # (each product rounded once: equal decays read as equal to a few ulps, different ones never that close)
    same = all(math.isclose(lr_g * gamma_g, lr * gamma, rel_tol=1e-12, abs_tol=0) for lr_g, gamma_g in decays)
    return gamma if same else None


def stability_point(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    gradient: Mapping[str, Tensor] | None = None,
    *,
    bias_correction: bool = True,
    max_iter: int = 40,
    tol: float = 1e-3,
    dtype: torch.dtype | None = None,
    method: str = DEFAULT_METHOD,
    seed: int = 0,
    memory: int | None = None,
    smallest: bool = False,
) -> StabilityPoint:
    r"""The sharpness and the optimizer's preconditioned sharpness at one point beside their thresholds
    (module docstring): Muon's arm if the optimizer has a Muon group, else Adam's. One Hessian operator
    serves both eigenproblems, each by Lanczos.

    Args:
        loss_fn: as for :func:`curvlab.engine.hvp.hvp`.
        params: ``model``'s parameters at the point, named as in the model (not modified).
        batch: as for :func:`curvlab.engine.hvp.hvp`.
        model: the module ``optimizer`` steps.
        optimizer: its optimizer, whose state gives P (torch's Adam or AdamW, or a Muon).
        gradient: the gradient at the point (Muon's arm: it enters the next step's momentum); ``None``:
            computed here.
        bias_correction: Adam's P with the first moment's bias correction :math:`1 - \beta_1^t` (the one
            its threshold applies to) or without (:func:`~curvlab.optim.adam.adam_preconditioner`).
        max_iter: HVPs at most per eigenproblem.
        tol: Lanczos' stopping tolerance, relative to the eigenvalue (``relative_to="eigenvalue"`` of
            :func:`~curvlab.curvature.spectral.lanczos`).
        dtype: computation dtype (default float32, or float64 when the parameters are).
        method: the HVP method (:data:`~curvlab.engine.hvp.METHODS`).
        seed: Lanczos' start vector's seed.
        memory: bytes each Lanczos basis may take.
        smallest: also :math:`\lambda_{\min}(H)`, by a third Lanczos run (at most ``max_iter`` HVPs more).

    Returns:
        A :class:`StabilityPoint`.

    Raises:
        CurvlabError: an optimizer with neither Muon groups nor Adam state.
    """
    names = list(params)
    muon_ids = {id(p) for g in optimizer.param_groups if is_muon_group(g) for p in g["params"]}
    table = dict(model.named_parameters())
    if muon_ids and gradient is None:  # (before H: the two points' graphs are never held together)
        with CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype) as point:
            gradient = point.gradient
    H = hessian_operator(loss_fn, params, batch, dtype=dtype, method=method)
    # relative to each eigenvalue, not to the spectrum's far end: a large negative end would accept the top early
    eig = {"max_iter": max_iter, "tol": tol, "seed": seed, "memory": memory, "relative_to": "eigenvalue"}
    top = lanczos(H, k=1, **eig)
    v = top.eigenvectors[:, 0]  # a float32 Ritz vector's norm is 1 only to ~1e-4 over a million entries
    v = v / torch.linalg.vector_norm(v.double()).to(v.dtype)
    bound = gamma = None
    if muon_ids:
        hidden = [n for n in names if n in table and id(table[n]) in muon_ids]
        sharp, edge, lr, residual, converged = muon_sharpness(H, model, optimizer, hidden, names, gradient, **eig)
        arm, correction = "muon", None
    else:
        # (the largest lr: groups at smaller ones scale their P)
        lr, beta1 = adam_step_settings(optimizer, mixed_lrs=True)
        diagonal = adam_preconditioner(optimizer, model, names, bias_correction=bias_correction, scale_by_lr=True)
        flat = torch.cat([d.reshape(-1) for d in diagonal.values()])
        pre = lanczos(preconditioned_operator(H, flat), **eig)
        sharp, residual = float(pre.eigenvalues[0]), float(pre.residuals[0])
        w = v.double()  # the bound's numerator is the Ritz value: the Ritz vector's Rayleigh quotient
        bound = float(top.eigenvalues[0]) / float(torch.dot(w * flat.to(w.device).double(), w))
        # below the bound by more than a converged value's slack: Lanczos has not reached the top
        converged = pre.converged and not sharp < bound - BOUND_SLACK * tol * abs(bound)
        gamma = decoupled_weight_decay(optimizer)
        edge = adam_edge_of_stability(lr, beta1) - (1 + beta1) / (1 - beta1) * (gamma or 0.0)
        arm, correction = "adam", bias_correction
    bottom = lanczos(H, k=1, which="smallest", **{**eig, "relative_to": "spectrum"}) if smallest else None
    return StabilityPoint(
        arm=arm, lr=lr, lambda_max=float(top.eigenvalues[0]), lambda_residual=float(top.residuals[0]),
        lambda_converged=top.converged, preconditioned_sharpness=sharp, preconditioned_residual=residual,
        preconditioned_converged=converged, edge_of_stability=edge, num_matvecs=H.num_matvecs,
        bias_correction=correction, eigenvector=v, preconditioned_bound=bound, weight_decay=gamma,
        **(_bottom(bottom) if bottom is not None else {}),
    )  # fmt: skip


def _bottom(result: EigenResult) -> dict[str, Any]:
    """The λ_min fields of a :class:`StabilityPoint` from the bottom Lanczos run."""
    return {
        "lambda_min": float(result.eigenvalues[0]),
        "lambda_min_residual": float(result.residuals[0]),
        "lambda_min_converged": result.converged,
    }
