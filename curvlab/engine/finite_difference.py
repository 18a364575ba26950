r"""A finite-difference Hessian-vector product: central differences of gradients, with its error stated.

For a direction v with unit :math:`u = v/\|v\|` and a step h,

.. math::
    D(h) = \|v\|\,\frac{G(W + h u) - G(W - h u)}{2h}
         = H[v] + \frac{h^2}{6}\|v\|\,\nabla^3 L[u, u, \cdot] + O(h^4) + \delta,

with :math:`\delta` the rounding of the gradients, of order :math:`\epsilon\,\|G\|\,\|v\|/h` (ε the unit
roundoff of the working dtype). The truncation term is estimated by Richardson's rule from the same
difference at 2h, :math:`\|D(h) - D(2h)\|/3` (its :math:`h^2` terms differ by a factor 4), so the stated
error is

.. math::
    e = \frac{\|D(h) - D(2h)\|}{3} + 4\epsilon\,\frac{\|G(W+hu)\| + \|G(W-hu)\|}{2h}\,\|v\|,

a bound on :math:`\|D(h) - H[v]\|_F` whenever the third derivative varies little over :math:`[-2h, 2h]`.
The default step :math:`h = \epsilon^{1/3}` balances the two terms. Four gradients, no second
derivatives: a cross-check of the exact HVPs, and a fallback for ops without double backward.
Parameters may be sharded (DTensors), and the result is sharded like them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from curvlab.engine import params as param_dicts
from curvlab.engine.hvp import CurvaturePoint, working_dtype
from curvlab.engine.loss import LossFn
from curvlab.errors import CurvlabError
from curvlab.util import schema

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class FiniteDifferenceHVP:
    r"""A central-difference :math:`H[v]` and its stated error.

    Attributes:
        hvp: :math:`D(h)`, a dict like the parameters (sharded like them).
        step: h, along the unit direction.
        error: the stated bound on :math:`\|D(h) - H[v]\|_F`, ``truncation + rounding``.
        truncation: :math:`\|D(h) - D(2h)\|/3`.
        rounding: :math:`4\epsilon(\|G_+\| + \|G_-\|)\|v\|/(2h)`.
        norm: :math:`\|D(h)\|_F` (so that ``error / norm`` is the relative error).
    """

    hvp: dict[str, Tensor]
    step: float
    error: float
    truncation: float
    rounding: float
    norm: float
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION
    WHAT: ClassVar[str] = "finite-difference record"

    # by hand: the JSON keeps no tensors, and reads the version under its older key "schema" too
    def to_dict(self) -> dict[str, Any]:
        """The scalars (not the tensors), with the schema version."""
        keys = ("step", "error", "truncation", "rounding", "norm")
        return {"schema_version": SCHEMA_VERSION, **{k: getattr(self, k) for k in keys}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FiniteDifferenceHVP:
        """The scalars of :meth:`to_dict`'s JSON (the loaded ``hvp`` is empty)."""
        d = {"schema_version": d.get("schema"), **d}  # (JSON written before the key was schema_version: "schema")
        schema.check(d, cls)
        return cls(hvp={}, **{k: float(d[k]) for k in ("step", "error", "truncation", "rounding", "norm")})


def finite_difference_hvp(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    v: Mapping[str, Tensor],
    *,
    step: float | None = None,
    dtype: torch.dtype | None = None,
) -> FiniteDifferenceHVP:
    r""":math:`H[v]` by central differences of gradients, :math:`D(h)`, with its stated error (module docstring).

    Args:
        loss_fn: as for :func:`curvlab.engine.hvp.hvp`.
        params: as for :func:`curvlab.engine.hvp.hvp` (they may be sharded DTensors).
        batch: as for :func:`curvlab.engine.hvp.hvp`.
        v: the direction, a dict like ``params`` (sharded like them when they are).
        step: h along :math:`v/\|v\|` (default :math:`\epsilon^{1/3}` of the working dtype).
        dtype: computation dtype (default float32, or float64 when the parameters are).
    """
    param_dicts.check_like(params, v)
    dt = working_dtype(params, dtype=dtype)
    p, vc = param_dicts.cast(params, dt), param_dicts.cast(v, dt)
    vnorm = param_dicts.norm(vc)
    if vnorm == 0.0:
        raise CurvlabError("the direction is zero")
    eps = torch.finfo(dt).eps
    h = float(eps ** (1 / 3)) if step is None else float(step)
    if not h > 0:
        raise CurvlabError(f"the finite-difference step must be positive, got {step}")
    u = param_dicts.scale(vc, 1.0 / vnorm)

    def gradient(t: float) -> param_dicts.Params:
        # method fwd_rev: the point's first order only, no graph kept (no forward mode runs for a gradient)
        return CurvaturePoint(loss_fn, param_dicts.add(p, u, t), batch, method="fwd_rev", dtype=dt).gradient

    g_plus, g_minus = gradient(h), gradient(-h)
    d1 = param_dicts.scale(param_dicts.add(g_plus, g_minus, -1.0), vnorm / (2 * h))
    d2 = param_dicts.scale(param_dicts.add(gradient(2 * h), gradient(-2 * h), -1.0), vnorm / (4 * h))
    truncation = param_dicts.norm(param_dicts.add(d1, d2, -1.0)) / 3
    rounding = 4 * eps * (param_dicts.norm(g_plus) + param_dicts.norm(g_minus)) * vnorm / (2 * h)
    return FiniteDifferenceHVP(d1, h, truncation + rounding, truncation, rounding, param_dicts.norm(d1))
