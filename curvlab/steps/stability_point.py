r"""Everything the edge of stability asks at one point, in one call (:func:`stability_point`): the
sharpness :math:`\lambda_{\max}(H)`, the optimizer's preconditioned sharpness
:math:`\lambda_{\max}(P^{-1/2} H P^{-1/2})` with its frozen P, and the thresholds they are compared with.

Gradient descent with step η is stable on the quadratic model while :math:`\lambda_{\max}(H) < 2/\eta`;
a preconditioned momentum method while :math:`\lambda_{\max}(P^{-1/2} H P^{-1/2})` stays below its own
threshold: Adam's :math:`(2 + 2\beta_1)/((1 - \beta_1)\eta)` (:func:`~curvlab.optim.adam.adam_edge_of_stability`),
Muon's :math:`2(1+\mu)/((1-\mu)(1+2\mu)\eta)` (:mod:`curvlab.steps.stability`). Full-batch training
drives the sharpness up to the threshold and holds it there (Cohen et al. 2021, 2022).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from curvlab.curvature.spectral import lanczos
from curvlab.engine.hvp import DEFAULT_METHOD, CurvaturePoint
from curvlab.engine.loss import LossFn
from curvlab.engine.operator import hessian_operator, preconditioned_operator
from curvlab.optim.adam import adam_edge_of_stability, adam_preconditioner, adam_step_settings
from curvlab.steps.stability import is_muon_group, muon_sharpness
from curvlab.util.codec import Record, meta


@dataclass(frozen=True)
class StabilityPoint(Record):
    r"""The edge-of-stability quantities at one point (:func:`stability_point`).

    Attributes:
        arm: ``"adam"`` or ``"muon"``: whose preconditioner.
        lr: the learning rate η of the arm's groups.
        lambda_max: :math:`\lambda_{\max}(H)` over all parameters.
        lambda_residual: its true residual :math:`\|H v - \lambda v\|`.
        lambda_converged: whether Lanczos converged to it within ``tol``.
        preconditioned_sharpness: :math:`\lambda_{\max}(P^{-1/2} H P^{-1/2})` (Adam's P over all
            parameters; Muon's frozen polar preconditioner on its matrices).
        preconditioned_residual: its true residual :math:`\|A u - \theta u\|`.
        preconditioned_converged: whether Lanczos converged to it within ``tol``.
        edge_of_stability: the arm's threshold at ``lr``, beside gradient descent's ``two_over_lr``.
        num_matvecs: the Hessian-vector products both eigenproblems took.
        bias_correction: Adam's P with the first moment's :math:`1 - \beta_1^t` or without; None for Muon.
        eigenvector: the unit eigenvector v of :math:`\lambda_{\max}(H)`, flat (not written to JSON).
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
    JSON_KEYS: ClassVar[tuple] = (..., "two_over_lr")  # (derived, for readers: not read back)

    @property
    def two_over_lr(self) -> float:
        """Gradient descent's edge of stability 2/η at this point's lr."""
        return 2 / self.lr


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
        tol: Lanczos' stopping tolerance, relative to the eigenvalue.
        dtype: computation dtype (default float32, or float64 when the parameters are).
        method: the HVP method (:data:`~curvlab.engine.hvp.METHODS`).
        seed: Lanczos' start vector's seed.
        memory: bytes each Lanczos basis may take.

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
    eig = {"max_iter": max_iter, "tol": tol, "seed": seed, "memory": memory}
    top = lanczos(H, k=1, **eig)
    if muon_ids:
        hidden = [n for n in names if n in table and id(table[n]) in muon_ids]
        sharp, edge, lr, residual, converged = muon_sharpness(H, model, optimizer, hidden, names, gradient, **eig)
        arm, correction = "muon", None
    else:
        lr, beta1 = adam_step_settings(optimizer)
        diagonal = adam_preconditioner(optimizer, model, names, bias_correction=bias_correction)
        pre = lanczos(preconditioned_operator(H, torch.cat([d.reshape(-1) for d in diagonal.values()])), **eig)
        sharp, residual, converged = float(pre.eigenvalues[0]), float(pre.residuals[0]), pre.converged
        edge, arm, correction = adam_edge_of_stability(lr, beta1), "adam", bias_correction
    v = top.eigenvectors[:, 0]  # a float32 Ritz vector's norm is 1 only to ~1e-4 over a million entries
    v = v / torch.linalg.vector_norm(v.double()).to(v.dtype)
    return StabilityPoint(
        arm=arm, lr=lr, lambda_max=float(top.eigenvalues[0]), lambda_residual=float(top.residuals[0]),
        lambda_converged=top.converged, preconditioned_sharpness=sharp, preconditioned_residual=residual,
        preconditioned_converged=converged, edge_of_stability=edge, num_matvecs=H.num_matvecs,
        bias_correction=correction, eigenvector=v,
    )  # fmt: skip
