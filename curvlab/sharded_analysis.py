"""The analysis of a sharded (DCP) checkpoint: ``curvlab nds --fsdp`` under ``torchrun``.

:func:`open_sharded_checkpoint` rebuilds the run of a checkpoint written by :mod:`curvlab.dcp`, under
the world size that wrote it, with its model sharded by FSDP2 and its optimizer state on the sharded
parameters, as the :class:`~curvlab.analysis.Target` the analysis takes; the report equals the
unsharded run's.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from curvlab.analysis import AnalysisSettings, CurvatureReport, Target, analyze
from curvlab.dcp import check_shapes, load_sharded_into, read_meta, shard_run
from curvlab.distributed import rank_and_world
from curvlab.errors import CurvlabError
from curvlab.train import TrainConfig, build_run


def open_sharded_checkpoint(
    path: str | Path, data: str | Path | None = None, device: str = "cpu", batches: int = 1
) -> Target:
    """The sharded run of ``path`` (under the world size that wrote it) as an analysis target."""
    path = Path(path)
    meta = read_meta(path)
    fields = dict(meta["config"])
    if data is not None:
        fields["data"] = str(data)
    fields["device"] = device
    cfg = TrainConfig.from_dict(fields)
    cfg = replace(cfg, val_windows=max(cfg.val_windows, batches * cfg.batch_size))
    if not Path(cfg.data).is_dir():
        raise CurvlabError(f"{path}: its data directory {cfg.data} is gone; pass --data DIR")
    run = build_run(cfg)
    check_shapes(path, run)
    world = rank_and_world()[1]
    if meta["world_size"] != world:
        raise CurvlabError(
            f"{path}: written by {meta['world_size']} ranks, opened on {world}: run under "
            f"torchrun --nproc_per_node {meta['world_size']}"
        )
    shard_run(run)
    load_sharded_into(run, path, meta)
    return Target(
        run.model,
        run.optimizer,
        [tuple(t.to(run.device) for t in run.loader.next()) for _ in range(batches)],
        [tuple(t.to(run.device) for t in b) for b in run.val_batches],
        cfg.grad_clip,
        run.step,
        float(meta.get("val_loss", float("nan"))),
        cfg.optimizer,
    )


def analyze_sharded_checkpoint(
    path: str | Path, settings: AnalysisSettings | None = None, data: str | Path | None = None, device: str = "cpu"
) -> CurvatureReport:
    """:func:`~curvlab.analysis.analyze` of a sharded checkpoint's next step, on every rank (the
    curvature of its sharded parameters, see :mod:`curvlab.sharded`)."""
    settings = settings or AnalysisSettings()
    settings.validate()
    return analyze(open_sharded_checkpoint(path, data, device, settings.batches), settings, str(path))
