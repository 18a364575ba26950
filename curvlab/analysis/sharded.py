"""The analysis of a sharded (DCP) checkpoint: ``curvlab nds --fsdp`` under ``torchrun``.

:func:`open_sharded_checkpoint` rebuilds the run of a checkpoint written by :mod:`curvlab.runs.dcp`, under
the world size that wrote it, with its model sharded by FSDP2 and its optimizer state on the sharded
parameters, as the :class:`~curvlab.analysis.targets.Target` the analysis takes; the report equals the
unsharded run's.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from curvlab.analysis.report import CurvatureReport, analyze
from curvlab.analysis.targets import AnalysisSettings, Target, analysis_config, run_target
from curvlab.errors import CurvlabError
from curvlab.runs.dcp import check_shapes, load_sharded_into, read_meta, shard_run
from curvlab.runs.train import build_run
from curvlab.util.distributed import rank_and_world


def open_sharded_checkpoint(
    path: str | Path, data: str | Path | None = None, device: str = "cpu", batches: int = 1
) -> Target:
    """The sharded run of ``path`` (under the world size that wrote it) as an analysis target."""
    path = Path(path)
    meta = read_meta(path)
    run = build_run(analysis_config(path, meta["config"], data, device, batches))
    check_shapes(path, run)
    world = rank_and_world()[1]
    if meta["world_size"] != world:
        raise CurvlabError(
            f"{path}: written by {meta['world_size']} ranks, opened on {world}: run under "
            f"torchrun --nproc_per_node {meta['world_size']}"
        )
    shard_run(run)
    load_sharded_into(run, path, meta)
    run.shadow = None  # a DCP checkpoint holds no shadow state: no paired directions from an empty one
    run.controls = {}
    return run_target(run, batches, float(meta.get("val_loss", float("nan"))))


def analyze_sharded_checkpoint(
    path: str | Path, settings: AnalysisSettings | None = None, data: str | Path | None = None, device: str = "cpu"
) -> CurvatureReport:
    """:func:`~curvlab.analysis.report.analyze` of a sharded checkpoint's next step, on every rank (the
    curvature of its sharded parameters, see :mod:`curvlab.engine.gathered`)."""
    settings = settings or AnalysisSettings()
    settings.validate()
    return analyze(open_sharded_checkpoint(path, data, device, settings.train_batches()), settings, str(path))


def checkpoint_analyzer(fsdp: bool) -> Callable | None:
    """The analysis of one checkpoint for :func:`~curvlab.analysis.report.cached_report`: sharded (a DCP
    directory, every rank under torchrun), or ``None`` for the report's own (the unsharded one)."""
    return analyze_sharded_checkpoint if fsdp else None
