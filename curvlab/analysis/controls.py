r"""The controls at one checkpoint, beyond the paired directions (docs/science.md section 14): what
:mod:`curvlab.studies.controls` aggregates over a reproduction's points.

At a checkpoint analysed with ``AnalysisSettings.held_out``, both arms' directions are measured again under
the Hessian of a held-out batch (the first validation batch), on the hidden matrices: G and H on one batch
couple the direction to the curvature it is judged by, and the held-out H removes that coupling.

At one analysed with ``AnalysisSettings.stability`` = m > 0 (m Lanczos iterations at most per
eigenproblem), on the evaluation batch D:

* :math:`\lambda_{\max}(H)` over all parameters, with its eigenvector :math:`v_1`;
* the arm's own preconditioned sharpness beside its stability threshold at the current lr: for an Adam
  state :math:`\lambda_{\max}(P^{-1/2} H P^{-1/2})`, :math:`P = (1 - \beta_1^t)(\sqrt{\hat v} + \epsilon)`, against
  :math:`(2 + 2\beta_1) / ((1 - \beta_1)\eta)` (:mod:`curvlab.optim.adam`); for a Muon state the same
  on the hidden matrices with Muon's frozen polar preconditioner, against the threshold of its Nesterov
  momentum (:mod:`curvlab.steps.stability`);
* the injected sharp directions :math:`Z' = Z_\text{muon} + c\,v_1`, c chosen in closed form from
  :math:`\langle Z, HZ\rangle`, :math:`\langle v_1, HZ\rangle`, :math:`\langle v_1, Z\rangle` and
  :math:`\lambda_1` so that NDS(Z') / NDS(Z_muon) is r (:data:`INJECTED_RATIOS`),
  each then *measured* by HVPs like any direction: the positive control's data.

JSON (``PointControls.to_dict``)::

    held_out{direction: NDS on the hidden matrices} or null, lambda_max, lambda_residual, lanczos_matvecs,
    preconditioned_sharpness, edge_of_stability, lr, injected{r: measured ratio},
    closed_form{r: ratio from the closed form}, coefficients{r: c}, note
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from curvlab.analysis.directions import Direction, measure_directions
from curvlab.engine import params as param_dicts
from curvlab.engine.hvp import CurvaturePoint
from curvlab.errors import CurvlabError
from curvlab.steps.stability import inject, injection_scalars
from curvlab.steps.stability_point import stability_point
from curvlab.util.codec import Record

LANCZOS_TOL = 1e-3  # relative residual: the context needs lambda_max to a tenth of a percent, not more
INJECTED_RATIOS = (1.2, 1.5, 2.0)  # the positive control's known ratios NDS(Z') / NDS(Z_muon)
STABILITY_QUANTITIES = {  # the per-point scalar of each edge-of-stability quantity
    "lambda_max": "control_lambda_max",  # of H over all parameters
    "preconditioned_sharpness": "control_preconditioned_sharpness",  # the arm's own
    "edge_of_stability": "control_edge_of_stability",  # the arm's own threshold at the current lr
    "two_over_lr": "control_two_over_lr",
}


def injected_key(ratio: float) -> str:
    """The per-point scalar of an injected direction: its measured NDS over Muon's, over all parameters."""
    return f"control_injected_{ratio:g}"


def heldout_key(arm: str) -> str:
    """The per-point scalar: the NDS of ``arm``'s direction on the hidden matrices under the held-out H."""
    return f"control_heldout_nds_{arm}_hidden"


@dataclass(frozen=True)
class PointControls(Record):
    """The controls measured at one checkpoint (module docstring); ``None`` where not asked for."""

    held_out: dict[str, float] | None = None
    lambda_max: float | None = None
    lambda_residual: float | None = None
    lanczos_matvecs: int = 0
    preconditioned_sharpness: float | None = None
    edge_of_stability: float | None = None
    lr: float | None = None
    injected: dict[str, float] = field(default_factory=dict)
    closed_form: dict[str, float] = field(default_factory=dict)
    coefficients: dict[str, float] = field(default_factory=dict)
    note: str = ""

    def scalars(self) -> dict[str, float]:
        """The ``control_*`` scalars of :class:`curvlab.curvature.scalars.CheckpointScalars`."""
        out = {heldout_key(name): v for name, v in (self.held_out or {}).items()}
        values = {"lambda_max": self.lambda_max, "preconditioned_sharpness": self.preconditioned_sharpness}
        values |= {"edge_of_stability": self.edge_of_stability, "two_over_lr": 2 / self.lr if self.lr else None}
        out |= {STABILITY_QUANTITIES[k]: v for k, v in values.items() if v is not None}
        if self.lambda_residual is not None:
            out["control_lambda_residual"] = self.lambda_residual
        out |= {injected_key(float(r)): v for r, v in self.injected.items()}
        return out


def held_out_nds(
    loss_fn,
    params: Mapping[str, Tensor],
    batch,
    directions: Sequence[Direction],
    hidden: Sequence[str],
    *,
    method,
    dtype,
) -> dict[str, float]:
    """Each direction's NDS on the hidden matrices under the Hessian of ``batch`` (by ``method``, in ``dtype``)."""
    with CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype) as point:
        measured = measure_directions(point, directions, hidden)
    return {d.name: d.hidden.nds for d in measured}


def stability_controls(
    loss_fn,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    params: Mapping[str, Tensor],
    batch: Any,
    muon: Direction,
    G: Mapping[str, Tensor],
    iterations: int,
    *,
    method: str,
    dtype: torch.dtype | None,
) -> PointControls:
    r"""lambda_max(H), the arm's preconditioned sharpness (:func:`curvlab.steps.stability_point.stability_point`)
    and the injected directions at one point (module docstring), in at most ``iterations`` Lanczos
    iterations per eigenproblem. The closed form takes :math:`\langle v_1, H v_1\rangle` for
    :math:`\lambda_1`, exact for any unit :math:`v_1`, converged or not."""
    point = stability_point(
        loss_fn, params, batch, model, optimizer, G, max_iter=iterations, tol=LANCZOS_TOL, dtype=dtype, method=method
    )
    v1 = param_dicts.unflatten(point.eigenvector, params)
    z = {n: muon.z[n] for n in params}
    scalars = injection_scalars(loss_fn, params, batch, z, v1, dtype=dtype, method=method)
    coefficients, skipped = {}, []
    for ratio in INJECTED_RATIOS:
        try:
            coefficients[f"{ratio:g}"] = scalars.coefficient(ratio)
        except CurvlabError as e:  # NDS(Z) <= 0, or lambda_1 too small to reach the ratio: no value here
            skipped.append(f"{ratio:g}: {e}")
    injected = {}
    if coefficients:
        rows = [inject(z, v1, c) for c in coefficients.values()]
        with CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype) as at:
            stacked = {n: torch.stack([r[n].to(at.dtype) for r in rows]) for n in params}
            _, zhz = at.quadratic_forms(stacked)
            zz = param_dicts.stacked_dot(stacked, stacked, list(params))
        injected = {k: float(zhz[i] / zz[i]) / scalars.nds for i, k in enumerate(coefficients)}
    closed = {k: scalars.nds_at(c) / scalars.nds for k, c in coefficients.items()}
    read = ("lambda_max", "lambda_residual", "preconditioned_sharpness", "edge_of_stability", "lr")
    measured = {k: getattr(point, k) for k in read} | {"lanczos_matvecs": point.num_matvecs}
    derived = {"injected": injected, "closed_form": closed, "coefficients": coefficients, "note": "; ".join(skipped)}
    return PointControls(**measured, **derived)
