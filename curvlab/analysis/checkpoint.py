"""One checkpoint analysed as ``curvlab nds`` asks (:func:`checkpoint_analysis`)."""

from __future__ import annotations

from pathlib import Path

from curvlab.analysis.direction_report import DirectionReport, checkpoint_directions
from curvlab.analysis.report import CurvatureReport, analyze_checkpoint
from curvlab.analysis.sharded import analyze_sharded_checkpoint
from curvlab.analysis.targets import AnalysisSettings
from curvlab.errors import CurvlabError
from curvlab.runs.foreign import Rebuild


def checkpoint_analysis(
    path: str | Path,
    settings: AnalysisSettings,
    *,
    data: str | Path | None = None,
    device: str = "cpu",
    rebuild: Rebuild | None = None,
    directions: str | None = None,
    fsdp: bool = False,
) -> CurvatureReport | DirectionReport:
    """The report of the checkpoint at ``path`` under ``settings``: with ``directions``
    (``"adamw,muon,sgd,sign"``), their :class:`DirectionReport`; else its :class:`CurvatureReport`, analysed
    sharded with ``fsdp`` (a DCP directory, every rank under torchrun). ``rebuild``: what a Lightning or
    state-dict checkpoint doesn't record.

    Raises:
        CurvlabError: bad settings; ``rebuild``, ``directions`` or the Gauss–Newton split with ``fsdp``; what the
            analysis raises.
    """
    if fsdp and rebuild is not None and rebuild.given():
        raise CurvlabError("--config, --optimizer and --batch-size are for Lightning and state-dict checkpoints")
    if fsdp and settings.gauss_newton:
        raise CurvlabError("--gauss-newton is not available with --fsdp yet")
    if directions is not None:
        if fsdp:
            raise CurvlabError("--directions is not available with --fsdp yet")
        return checkpoint_directions(path, directions, settings=settings, data=data, device=device, rebuild=rebuild)
    if fsdp:
        return analyze_sharded_checkpoint(path, settings=settings, data=data, device=device)
    return analyze_checkpoint(path, settings=settings, data=data, device=device, rebuild=rebuild)
