"""A cheap estimate of a checkpoint's next-step curvature (``curvlab nds --estimator ...``): the NDS of the real
next step Z by one of :data:`~curvlab.curvature.estimators.ESTIMATORS`, with its own error and cost, and the
Taylor split it implies, on the same batches and W as the exact report (:mod:`curvlab.analysis.report`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from curvlab.analysis.targets import DTYPES, AnalysisSettings, Target, evaluation_batches, open_checkpoint
from curvlab.curvature.estimators import ESTIMATORS, DirectionalCurvatureEstimate, directional_curvature
from curvlab.engine import params as param_dicts
from curvlab.engine.forward import evaluate_loss
from curvlab.engine.hvp import CurvaturePoint
from curvlab.engine.loss import make_loss_fn
from curvlab.errors import CurvlabError
from curvlab.runs.foreign import Rebuild
from curvlab.steps.update import next_update
from curvlab.util.atomic import atomic_write_text
from curvlab.util.codec import Record, meta
from curvlab.util.versions import SoftwareVersions

ESTIMATE_SCHEMA_VERSION = 1


@dataclass(frozen=True)
class EstimateReport(Record):
    r"""The next step's curvature at a checkpoint by one estimator.

    With :math:`\langle Z, HZ\rangle` estimated, the Taylor split is :math:`I_1 = \langle G, Z\rangle`,
    :math:`I_2 = \tfrac12\langle Z, HZ\rangle`, predicted :math:`I_1 - I_2` beside the realized
    :math:`L(W) - L(W - Z)`, on the evaluation batches D.

    JSON (``ESTIMATE_SCHEMA_VERSION`` = 1)::

        schema_version, checkpoint, step, val_loss (or null), optimizer, settings{...}, estimate{estimator, zhz,
        nds, error, forwards, backwards, detail}, first_order, curvature_penalty, predicted, realized,
        update_norm, seconds, versions
    """

    checkpoint: str
    step: int
    val_loss: float = field(metadata=meta(strict=True))
    optimizer: str
    settings: AnalysisSettings
    estimate: DirectionalCurvatureEstimate
    first_order: float
    curvature_penalty: float
    predicted: float
    realized: float
    update_norm: float
    seconds: float
    versions: SoftwareVersions | None = None
    SCHEMA_VERSION: ClassVar[int] = ESTIMATE_SCHEMA_VERSION
    WHAT: ClassVar[str] = "estimate"

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, allow_nan=True))


def estimate_next_step(
    target: Target, settings: AnalysisSettings, estimator: str, checkpoint: str = ""
) -> EstimateReport:
    """The estimate of ``target``'s next step Z (made as :func:`~curvlab.analysis.report.analyze` makes it: dropout
    off, the step's own batch) on the evaluation batches of ``settings``, in its dtype.

    Raises:
        CurvlabError: an unknown estimator, bad settings, what the estimator raises.
    """
    if estimator not in ESTIMATORS:
        raise CurvlabError(f"unknown estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
    settings.validate()
    start = time.perf_counter()
    model = target.model
    model.eval()
    loss_fn = make_loss_fn(model)
    _, Z = next_update(model, target.optimizer, loss_fn, target.train_batches[0], max_grad_norm=target.grad_clip)
    D = evaluation_batches(target, settings)
    params = {n: p.detach() for n, p in model.named_parameters()}
    dtype = DTYPES[settings.dtype]
    estimate = directional_curvature(loss_fn, params, D, Z, estimator=estimator, dtype=dtype)
    loss = evaluate_loss(loss_fn, params, D, dtype=dtype)
    stepped = evaluate_loss(loss_fn, param_dicts.add(params, Z, -1.0), D, dtype=dtype)
    first_order = _first_order(estimate, loss_fn, params, D, Z, dtype)
    penalty = 0.5 * estimate.zhz
    return EstimateReport(
        checkpoint, target.step, target.val_loss, target.optimizer_name, settings, estimate, first_order, penalty,
        first_order - penalty, loss - stepped, param_dicts.norm(Z), time.perf_counter() - start,
        SoftwareVersions.current(),
    )  # fmt: skip


def _first_order(estimate: DirectionalCurvatureEstimate, loss_fn, params, D, Z, dtype) -> float:
    r""":math:`\langle G_D, Z\rangle` on the evaluation batches: the estimator's own where it took that gradient,
    else one more gradient."""
    if "gz" in estimate.detail:
        return float(estimate.detail["gz"])
    point = CurvaturePoint(loss_fn, params, D, method="fwd_rev", dtype=dtype)
    return param_dicts.dot(point.gradient, param_dicts.cast(Z, point.dtype))


def checkpoint_estimate(
    path: str | Path,
    estimator: str,
    settings: AnalysisSettings | None = None,
    data: str | Path | None = None,
    device: str = "cpu",
    rebuild: Rebuild | None = None,
) -> EstimateReport:
    """Open a checkpoint (any format :func:`~curvlab.analysis.targets.open_checkpoint` reads) and estimate its
    next step's curvature (:func:`estimate_next_step`)."""
    settings = settings or AnalysisSettings()
    settings.validate()
    if estimator not in ESTIMATORS:  # (before the checkpoint is opened)
        raise CurvlabError(f"unknown estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
    target = open_checkpoint(path, data, device, settings.batches, rebuild)
    return estimate_next_step(target, settings, estimator, str(path))
