r"""The preconditioned sharpness: the largest eigenvalue of the Hessian in a diagonal preconditioner's metric.

A method that steps :math:`W \leftarrow W - \eta P^{-1} m` with a positive diagonal P (Adam's
:func:`~curvlab.optim.adam.adam_preconditioner`, frozen at the point) is, on the quadratic model
:math:`L(W) \approx L + \langle g, \Delta\rangle + \tfrac12 \langle \Delta, H \Delta\rangle`, gradient descent
(or heavy ball, with momentum) in the coordinates :math:`x = P^{1/2} W`, where the Hessian is
:math:`P^{-1/2} H P^{-1/2}`. Its stability is decided by

.. math::
    \lambda_{\max}\bigl(P^{-1/2} H P^{-1/2}\bigr) = \max_{x \ne 0}
        \frac{\langle x, P^{-1/2} H P^{-1/2} x\rangle}{\langle x, x\rangle}
        = \max_{\Delta \ne 0} \frac{\langle \Delta, H \Delta\rangle}{\langle \Delta, P \Delta\rangle},

the largest eigenvalue of the generalized problem :math:`H\Delta = \lambda P \Delta`, against the method's
threshold (:func:`~curvlab.optim.adam.adam_edge_of_stability`: :math:`38/\eta` for Adam at
:math:`\beta_1 = 0.9`; :math:`2/\eta` for gradient descent), by :func:`~curvlab.curvature.spectral.lanczos`
on :func:`~curvlab.engine.operator.preconditioned_operator`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from curvlab.curvature.spectral import EigenResult, lanczos
from curvlab.engine import params as param_dicts
from curvlab.engine.hvp import DEFAULT_METHOD, CurvaturePoint
from curvlab.engine.loss import LossFn
from curvlab.engine.operator import hessian_operator_at, preconditioned_operator


def preconditioned_sharpness_at(
    point: CurvaturePoint,
    preconditioner: Mapping[str, Tensor],
    *,
    max_iter: int = 100,
    tol: float = 1e-6,
    seed: int = 0,
    memory: int | None = None,
) -> EigenResult:
    r""":func:`preconditioned_sharpness` at a :class:`~curvlab.engine.hvp.CurvaturePoint`: Lanczos on
    :math:`P^{-1/2} H P^{-1/2}` with the point's HVPs (shared with whatever else is measured there).

    Args:
        point: the point.
        preconditioner: P's diagonal, a dict like ``point.params`` (the same keys and shapes), positive.
        max_iter: Lanczos iterations (HVPs) at most.
        tol: Lanczos' stopping tolerance, relative to the eigenvalue.
        seed: the start vector's seed.
        memory: bytes the Lanczos basis may take (:func:`~curvlab.curvature.spectral.lanczos`).

    Returns:
        The :class:`~curvlab.curvature.spectral.EigenResult` of the largest eigenvalue, with its residual
        and ``converged``; the eigenvector u is in the preconditioned coordinates (:math:`\Delta = P^{-1/2}
        u` in the parameters), flat in the parameters' order.

    Raises:
        CurvlabError: a preconditioner unlike the parameters, non-finite or not positive.
    """
    param_dicts.check_like(point.params, preconditioner, "preconditioner")
    diagonal = torch.cat([preconditioner[n].reshape(-1) for n in point.params])
    op = preconditioned_operator(hessian_operator_at(point), diagonal)
    return lanczos(op, k=1, max_iter=max_iter, tol=tol, seed=seed, memory=memory)


def preconditioned_sharpness(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    preconditioner: Mapping[str, Tensor],
    *,
    method: str = DEFAULT_METHOD,
    dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
    max_iter: int = 100,
    tol: float = 1e-6,
    seed: int = 0,
    memory: int | None = None,
) -> EigenResult:
    r"""The preconditioned sharpness :math:`\lambda_{\max}(P^{-1/2} H P^{-1/2})` of a positive diagonal P
    (module docstring), e.g. Adam's (:func:`~curvlab.optim.adam.adam_preconditioner`), by Lanczos with
    exact HVPs over every parameter.

    Args:
        loss_fn: as for :func:`curvlab.engine.hvp.hvp`.
        params: as for :func:`curvlab.engine.hvp.hvp` (not modified).
        batch: as for :func:`curvlab.engine.hvp.hvp`.
        preconditioner: P's diagonal, a dict like ``params`` (the same keys and shapes), positive.
        method: the HVP method (:data:`~curvlab.engine.hvp.METHODS`).
        dtype: computation dtype (default float32, or float64 when the parameters are).
        chunk_size: columns per vectorized HVP call.
        max_iter: Lanczos iterations (HVPs) at most.
        tol: Lanczos' stopping tolerance, relative to the eigenvalue.
        seed: the start vector's seed.
        memory: bytes the Lanczos basis may take (:func:`~curvlab.curvature.spectral.lanczos`).

    Returns:
        As :func:`preconditioned_sharpness_at`: the eigenvalue with its true residual and ``converged``.

    Raises:
        CurvlabError: a preconditioner unlike the parameters, non-finite or not positive.
    """
    param_dicts.check_like(params, preconditioner, "preconditioner")
    with CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype, chunk_size=chunk_size) as point:
        return preconditioned_sharpness_at(point, preconditioner, max_iter=max_iter, tol=tol, seed=seed, memory=memory)
