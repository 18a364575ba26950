"""The loss and the forward-mode quadratic forms at one point: one call, one :class:`CurvaturePoint` that
keeps nothing (no backward pass, no kept graph), asked one thing and closed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from curvlab.engine import checks, gathered
from curvlab.engine import params as param_dicts
from curvlab.engine.hvp import DEFAULT_METHOD, CurvaturePoint
from curvlab.engine.loss import LossFn


def evaluate_loss(
    loss_fn: LossFn, params: Mapping[str, Tensor], batch: Any, *, dtype: torch.dtype | None = None
) -> float:
    """:math:`L(W)` accumulated over batches with loss-term weights, evaluated exactly as the curvature
    functions evaluate it (:meth:`CurvaturePoint.loss_at`).

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or a ``list``/:class:`~curvlab.engine.loss.Batches` of batches to accumulate.
        dtype: computation dtype (default float32, or float64 when the parameters are).

    Returns:
        The loss :math:`L(W)`, a Python float.
    """
    return CurvaturePoint(loss_fn, params, batch, method="fwd_rev", dtype=dtype).loss_at(params)


def forward_quadratic_forms(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    zs: Mapping[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    r""":math:`(\langle G, z_k\rangle, \langle z_k, H z_k\rangle)` for K stacked directions by forward-over-forward
    AD, at one point (:meth:`CurvaturePoint.forward_quadratic_forms`: no backward pass, no gradient formed).

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or a ``list``/:class:`~curvlab.engine.loss.Batches` of batches to accumulate.
        zs: dict of tensors shaped ``(K, *param.shape)``, one per parameter.
        dtype: computation dtype (default float32, or float64 when the parameters are).
        chunk_size: directions per vectorized call (bounds memory; ``None`` = all K at once).

    Returns:
        ``(gz, zhz)``, float64 tensors of shape ``(K,)`` (the loss: :func:`evaluate_loss`).
    """
    checks.check_full(params, zs)
    # a "fwd_rev" point keeps nothing; sharded parameters take the pair by double backward
    method = DEFAULT_METHOD if gathered.is_sharded(params) else "fwd_rev"
    with CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype, chunk_size=chunk_size) as point:
        return point.forward_quadratic_forms(zs)


def forward_quadratic_form(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
) -> tuple[float, float]:
    r"""The pair :math:`(\langle G, z\rangle, \langle z, H[z]\rangle)` of one direction by forward-over-forward AD
    (:func:`forward_quadratic_forms` for K = 1).

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or a ``list``/:class:`~curvlab.engine.loss.Batches` of batches to accumulate.
        z: direction, a dict with ``params``' keys and shapes.
        dtype: computation dtype (default float32, or float64 when the parameters are).

    Returns:
        ``(gz, zhz)``: :math:`\langle G, z\rangle` and :math:`\langle z, H[z]\rangle`, Python floats.
    """
    param_dicts.check_like(params, z)
    gz, zhz = forward_quadratic_forms(loss_fn, params, batch, {n: t.unsqueeze(0) for n, t in z.items()}, dtype=dtype)
    return float(gz[0]), float(zhz[0])
