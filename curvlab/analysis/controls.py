r"""The controls at one checkpoint, beyond the paired directions (docs/science.md section 14): what
:mod:`curvlab.studies.controls` aggregates over a reproduction's points.

At a checkpoint analysed with ``AnalysisSettings.held_out``, the *held-out H* is the Hessian of a batch that
made no step here (the first validation batch). G and H on one batch couple a direction to the curvature it
is judged by; the held-out H removes that coupling. Under it are measured, on the hidden matrices:

* both arms' own directions (made from the next training batch, as at the point);
* each arm's *exchangeable twin* (:func:`exchangeable_twins`): the same optimizer state and settings, whose
  last gradient comes from an independent training batch (the one after the step's). Own and twin
  directions are exchangeable, and neither's batch is the one that judges them, so NDS(own) / NDS(twin)
  under the held-out H is a null that can fail: anything that tells the two apart (a bug, a coupling, a
  lag) moves it from 1.

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

Every Lanczos eigenvalue carries its true residual and a converged flag (:class:`PointControls`): Lanczos
runs until each relative residual is within :data:`LANCZOS_TOL` or ``m`` iterations are spent, and a
preconditioned sharpness below the Rayleigh bound :math:`v_1^\top H v_1 / v_1^\top P v_1` is unconverged
whatever its residual (:mod:`curvlab.steps.stability_point`). The aggregates leave unconverged values out
(:func:`curvlab.studies.controls.stability`). The injected directions keep an unconverged :math:`v_1`: their
closed form reads :math:`\lambda_1 = \langle v_1, H v_1\rangle`, exact for any unit vector, so the known
ratio holds for it; only the direction is then less sharp than the top one.

JSON (``PointControls.to_dict``; a report written before the flags reads them as null)::

    held_out{direction: NDS on the hidden matrices} or null, held_out_cos{direction: cos(G', Z), G' the held-out
    batch's gradient} or null (directions adamw, muon, adamw_exchangeable, muon_exchangeable), lambda_max,
    lambda_residual, lanczos_matvecs,
    preconditioned_sharpness, edge_of_stability, lr, injected{r: measured ratio},
    closed_form{r: ratio from the closed form}, coefficients{r: c}, note, lambda_converged,
    preconditioned_residual, preconditioned_converged, preconditioned_bound, weight_decay, lambda_min,
    lambda_min_residual, lambda_min_converged (null in a report from before them)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

from curvlab.analysis.directions import PAIRED, Direction, counterfactual_directions, measure_hidden
from curvlab.engine import params as param_dicts
from curvlab.engine.hvp import CurvaturePoint
from curvlab.errors import CurvlabError
from curvlab.steps.shadow import ShadowState
from curvlab.steps.stability import inject, injection_scalars
from curvlab.steps.stability_point import stability_point
from curvlab.steps.update import next_update
from curvlab.util.codec import Record

LANCZOS_TOL = 1e-3  # relative residual: the context needs lambda_max to a tenth of a percent, not more
INJECTED_RATIOS = (1.2, 1.5, 2.0)  # the positive control's known ratios NDS(Z') / NDS(Z_muon)
STABILITY_QUANTITIES = {  # the per-point scalar of each edge-of-stability quantity
    "lambda_max": "control_lambda_max",  # of H over all parameters
    "preconditioned_sharpness": "control_preconditioned_sharpness",  # the arm's own
    "edge_of_stability": "control_edge_of_stability",  # the arm's own threshold at the current lr
    "two_over_lr": "control_two_over_lr",
}
LAMBDA_MIN = "control_lambda_min"  # lambda_min(H) over all parameters (reports since issue 52)


def injected_key(ratio: float) -> str:
    """The per-point scalar of an injected direction: its measured NDS over Muon's, over all parameters."""
    return f"control_injected_{ratio:g}"


EXCHANGEABLE = "_exchangeable"  # the suffix of an exchangeable twin's direction name


def heldout_key(arm: str, quantity: str = "nds") -> str:
    """The per-point scalar: the ``quantity`` (``nds`` or ``cos``) of direction ``arm`` (an arm, or its
    exchangeable twin ``arm + EXCHANGEABLE``) on the hidden matrices under the held-out H."""
    return f"control_heldout_{quantity}_{arm}_hidden"


@dataclass(frozen=True)
class PointControls(Record):
    """The controls measured at one checkpoint (module docstring); ``None`` where not asked for (or, for the
    flags, residual and bound, in a report written before them)."""

    held_out: dict[str, float] | None = None
    held_out_cos: dict[str, float] | None = None
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
    lambda_converged: bool | None = None
    preconditioned_residual: float | None = None
    preconditioned_converged: bool | None = None
    preconditioned_bound: float | None = None  # v1'Hv1 / v1'Pv1 (Adam's arm): the sharpness is at least this
    weight_decay: float | None = None  # the decoupled gamma in Adam's threshold (StabilityPoint.weight_decay)
    lambda_min: float | None = None  # lambda_min(H), its residual and flag (StabilityPoint's)
    lambda_min_residual: float | None = None
    lambda_min_converged: bool | None = None

    def scalars(self) -> dict[str, float]:
        """The ``control_*`` scalars of :class:`curvlab.curvature.scalars.CheckpointScalars`."""
        out = {heldout_key(name): v for name, v in (self.held_out or {}).items()}
        out |= {heldout_key(name, "cos"): v for name, v in (self.held_out_cos or {}).items()}
        values = {"lambda_max": self.lambda_max, "preconditioned_sharpness": self.preconditioned_sharpness}
        values |= {"edge_of_stability": self.edge_of_stability, "two_over_lr": 2 / self.lr if self.lr else None}
        out |= {STABILITY_QUANTITIES[k]: v for k, v in values.items() if v is not None}
        out |= {LAMBDA_MIN: self.lambda_min} if self.lambda_min is not None else {}
        checks = {"lambda_residual": self.lambda_residual, "preconditioned_residual": self.preconditioned_residual}
        checks |= {"lambda_converged": self.lambda_converged, "preconditioned_converged": self.preconditioned_converged}
        checks |= {"lambda_min_residual": self.lambda_min_residual, "lambda_min_converged": self.lambda_min_converged}
        out |= {f"control_{k}": float(v) for k, v in checks.items() if v is not None}  # a flag as 1.0 or 0.0
        out |= {injected_key(float(r)): v for r, v in self.injected.items()}
        return out


def held_out_measures(
    loss_fn,
    params: Mapping[str, Tensor],
    batch,
    directions: Sequence[Direction],
    hidden: Sequence[str],
    *,
    method,
    dtype,
) -> tuple[dict[str, float], dict[str, float]]:
    """Each direction's NDS and cosine with the batch's gradient on the hidden matrices, under the Hessian
    of ``batch`` (by ``method``, in ``dtype``): ``({name: nds}, {name: cos})``. The hidden scope alone, so one
    batched HVP over the stacked directions serves them all (the paired directions' two scopes take two each)."""
    with CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype) as point:
        measured = measure_hidden(point, directions, hidden)
    return {d.name: d.hidden.nds for d in measured}, {d.name: d.hidden.cosine for d in measured}


def exchangeable_twins(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn, batch, shadow: ShadowState, *, max_grad_norm=None
) -> list[Direction]:
    """Both arms' directions had the next step's gradient come from ``batch`` (an independent training batch)
    instead: the run's own optimizer state and the shadow's, unchanged (:func:`~curvlab.steps.update.next_update`
    leaves no trace), named ``adamw_exchangeable`` and ``muon_exchangeable``."""
    G, Z = next_update(model, optimizer, loss_fn, batch, max_grad_norm=max_grad_norm)
    _, _, directions = counterfactual_directions(model, optimizer, G, Z, PAIRED, shadow=shadow)
    source = "its last gradient from an independent batch"
    return [replace(d, name=d.name + EXCHANGEABLE, source=f"{d.source}, {source}") for d in directions]


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
    iterations per eigenproblem (to :data:`LANCZOS_TOL`, with every residual and converged flag). The closed
    form takes :math:`\langle v_1, H v_1\rangle` for :math:`\lambda_1`, exact for any unit :math:`v_1`,
    converged or not; the note says where a value did not converge."""
    point = stability_point(
        loss_fn, params, batch, model, optimizer, G, max_iter=iterations, tol=LANCZOS_TOL, dtype=dtype, method=method,
        smallest=True,
    )  # fmt: skip
    skipped = [] if point.lambda_converged else [f"lambda_max unconverged in {iterations} iterations"]
    bound = point.preconditioned_bound
    if not point.preconditioned_converged and bound is not None and point.preconditioned_sharpness < bound:
        skipped.append(f"preconditioned sharpness below its bound v1'Hv1/v1'Pv1 = {bound:.6g}: Lanczos missed the top")
    elif not point.preconditioned_converged:
        skipped.append(f"preconditioned sharpness unconverged in {iterations} iterations")
    v1 = param_dicts.unflatten(point.eigenvector, params)
    z = {n: muon.z[n] for n in params}
    scalars = injection_scalars(loss_fn, params, batch, z, v1, dtype=dtype, method=method)
    coefficients = {}
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
    read = ("lambda_max", "lambda_residual", "lambda_converged", "preconditioned_sharpness", "edge_of_stability", "lr")
    read += ("preconditioned_residual", "preconditioned_converged", "preconditioned_bound", "weight_decay")
    read += ("lambda_min", "lambda_min_residual", "lambda_min_converged")
    measured = {k: getattr(point, k) for k in read} | {"lanczos_matvecs": point.num_matvecs}
    derived = {"injected": injected, "closed_form": closed, "coefficients": coefficients, "note": "; ".join(skipped)}
    return PointControls(**measured, **derived)
