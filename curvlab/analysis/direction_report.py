"""The paired-direction report of one checkpoint (``curvlab nds --directions``): the NDS, alignment and
q = cos^2 / NDS of several optimizers' next directions at the same W, batch and H
(:mod:`curvlab.analysis.directions` holds the measurement itself).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from curvlab.analysis.directions import PairedDirections, measured_directions, parse_directions
from curvlab.analysis.targets import (
    DTYPES,
    AnalysisSettings,
    Target,
    evaluation_batches,
    method_renamed,
    open_checkpoint,
)
from curvlab.engine.loss import make_loss_fn
from curvlab.runs.foreign import Rebuild
from curvlab.steps.update import next_update
from curvlab.util.atomic import atomic_write_text
from curvlab.util.codec import Record, meta
from curvlab.util.versions import SoftwareVersions

DIRECTIONS_SCHEMA_VERSION = 2  # 2: settings.hvp_method is settings.method (1 is read as 2: method_renamed)


@dataclass(frozen=True)
class DirectionReport(Record):
    """Counterfactual directions at one checkpoint (``curvlab nds CKPT --directions ...``): each
    direction's NDS, cos(G, Z) and q over all parameters and the hidden matrices, at the same W, on the
    same batch D, under the same H (:mod:`curvlab.analysis.directions`).

    JSON (``DIRECTIONS_SCHEMA_VERSION`` = 2; one of 1, whose settings name the method ``hvp_method``, is read
    as one of 2)::

        schema_version, checkpoint, step, val_loss (or null), optimizer, settings{...}, paired{base, real, multiplier,
        hidden_names, shadow (its settings, or null), directions[{name, source, scaling, all{nds,
        first_order, curvature_penalty, update_norm, grad_norm, cosine, q}, hidden{...}}]}, seconds,
        versions (:mod:`curvlab.util.versions`; null in a report from before they were kept)
    """

    checkpoint: str
    step: int
    val_loss: float = field(metadata=meta(strict=True))  # (none recorded: null, where the rest keeps NaN)
    optimizer: str
    settings: AnalysisSettings
    paired: PairedDirections
    seconds: float
    versions: SoftwareVersions | None = None  # what it was made with
    SCHEMA_VERSION: ClassVar[int] = DIRECTIONS_SCHEMA_VERSION
    MIGRATIONS: ClassVar[dict] = {1: method_renamed}  # 1 -> 2: settings.hvp_method is settings.method
    WHAT: ClassVar[str] = "directions"

    def save(self, path: str | Path) -> None:
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, allow_nan=True))


def analyze_directions(target: Target, names, settings: AnalysisSettings, checkpoint: str = "") -> DirectionReport:
    """The directions ``names`` (``"adamw,muon,sgd,sign"`` or a list; :data:`curvlab.analysis.directions.DIRECTIONS`)
    at ``target``'s W, with G and H on the evaluation batch D of ``settings``, and the real step and the
    optimizer state from the next step's batch, as :func:`~curvlab.analysis.report.analyze` takes them (dropout off).

    Raises:
        CurvlabError: an unknown direction, a state the directions can't be formed from (see
            :func:`curvlab.analysis.directions.counterfactual_directions`), bad settings.
    """
    settings.validate()
    names = parse_directions(names)
    start = time.perf_counter()
    model = target.model
    model.eval()  # dropout off, as in analyze
    loss_fn = make_loss_fn(model)
    G, Z = next_update(model, target.optimizer, loss_fn, target.train_batches[0], max_grad_norm=target.grad_clip)
    D = evaluation_batches(target, settings)
    params = {n: p.detach() for n, p in model.named_parameters()}
    paired, _ = measured_directions(
        model, target.optimizer, loss_fn, params, D, G, Z, names=names, shadow=target.shadow,
        method=settings.method, dtype=DTYPES[settings.dtype], gauss_newton=settings.gauss_newton,
    )  # fmt: skip
    return DirectionReport(
        checkpoint,
        target.step,
        target.val_loss,
        target.optimizer_name,
        settings,
        paired,
        time.perf_counter() - start,
        SoftwareVersions.current(),
    )


def checkpoint_directions(
    path: str | Path,
    names,
    settings: AnalysisSettings | None = None,
    data: str | Path | None = None,
    device: str = "cpu",
    rebuild: Rebuild | None = None,
) -> DirectionReport:
    """Open a checkpoint (any format :func:`open_checkpoint` reads; ``rebuild`` for those that need it) and
    compare the directions ``names`` at it (see :func:`analyze_directions`)."""
    settings = settings or AnalysisSettings()
    settings.validate()
    names = parse_directions(names)  # (bad names fail before the checkpoint is opened)
    target = open_checkpoint(path, data, device, settings.batches, rebuild)
    return analyze_directions(target, names, settings, str(path))
