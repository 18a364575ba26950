"""One run along its trajectory (``curvlab track``): the curvature at every tracked checkpoint, from the
checkpoints themselves (each analysed checkpoint's report cached, by default under ``OUT/reports/``, so a
re-run skips what is done) or from the rows ``curvlab train --monitor`` wrote as it trained.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from curvlab.analysis.report import cached_report
from curvlab.analysis.sharded import checkpoint_analyzer
from curvlab.analysis.targets import AnalysisSettings
from curvlab.curvature.scalars import CheckpointScalars
from curvlab.errors import CurvlabError
from curvlab.runs.checkpoint import read_index
from curvlab.runs.match import run_checkpoints
from curvlab.runs.metrics import METRICS_FILE, monitor_rows, read_metrics
from curvlab.studies.compare import STILL_TRAINING
from curvlab.util.atomic import atomic_write_csv, atomic_write_text, remove_stale_temporaries
from curvlab.util.distributed import is_main
from curvlab.util.lock import check_not_owned, own_directory
from curvlab.util.progress import progress as progress_bar
from curvlab.util.versions import SoftwareVersions


def track_run(
    run: str | Path,
    out: str | Path,
    settings: AnalysisSettings | None = None,
    *,
    every: int = 1,
    steps: Sequence[int] | None = None,
    plateau_ceiling: float | None = None,
    device: str = "cpu",
    progress: bool = True,
    cache: str | Path | None = None,
    fsdp: bool = False,
    settings_at: Mapping[int, AnalysisSettings] | None = None,
) -> list[CheckpointScalars]:
    """Analyse every ``every``-th checkpoint of a run (step 0 excluded: there is no trajectory yet),
    or those at ``steps``; write ``track.json`` and ``track.csv`` to ``out``. Returns the
    per-checkpoint scalars, with the schedule (multiplier, phase) of each step and whether it sits on
    the unigram plateau (at or above ``plateau_ceiling``). ``fsdp``: sharded checkpoints, analysed
    sharded on every rank (as in :func:`~curvlab.studies.compare.compare_runs`). ``settings_at``: steps
    analysed with other settings (a reproduction takes the controls' stability context at a subset of
    the tracked steps). A run still training is refused, and ``out`` is held while the track writes
    there, as in :func:`~curvlab.studies.compare.compare_runs`."""
    settings = settings or AnalysisSettings()
    settings_at = dict(settings_at or {})
    for s in (settings, *settings_at.values()):
        s.validate()
    if every < 1:
        raise CurvlabError(f"--every must be >= 1, got {every}")
    run, out = Path(run), Path(out)
    cache = Path(cache) if cache else out / "reports"
    check_not_owned(run, STILL_TRAINING)
    checkpoints = [c for c in run_checkpoints(run) if c.step > 0]
    if steps is not None:
        missing = sorted(set(steps) - {c.step for c in checkpoints})
        if missing:
            raise CurvlabError(f"{run}: no checkpoint with a validation loss at step(s) {missing[:5]}")
        checkpoints = [c for c in checkpoints if c.step in set(steps)]
    checkpoints = checkpoints[::every]
    if not checkpoints:
        raise CurvlabError(f"{run}: no checkpoint after step 0 to track")
    rows = []
    with own_directory(out, "track"):
        remove_stale_temporaries(out, cache)  # (what killed writes left: never read)
        for c in progress_bar(checkpoints, desc=f"track {run.name}", disable=not progress):
            chosen = settings_at.get(c.step, settings)
            report = cached_report(cache, c.path, chosen, device=device, analyze_fn=checkpoint_analyzer(fsdp))
            spectrum = report.spectrum
            row = report.scalars().with_context(
                optimizer=report.optimizer,
                multiplier=c.multiplier,
                lr=c.lr,
                phase=c.phase,
                on_plateau=plateau_ceiling is not None and c.val_loss >= plateau_ceiling,
                lambda_max=None if spectrum is None else spectrum.lambda_max,
                overlap_top_k=None if spectrum is None else spectrum.overlap_top_k,
            )
            rows.append(row)
        head = {"run": str(run), "settings": asdict(settings), "plateau_ceiling": plateau_ceiling}
        _write_track(out, rows, head, settings_at={str(k): asdict(v) for k, v in sorted(settings_at.items())})
    return rows


def _write_track(out: Path, rows: list[CheckpointScalars], head: dict[str, Any], **tail: Any) -> None:
    """On rank 0, ``track.json`` (``head``, the rows, ``tail``, the versions) and ``track.csv``."""
    if is_main():
        dicts = [r.to_dict() for r in rows]
        track = {**head, "rows": dicts, **tail, "versions": SoftwareVersions.current().to_dict()}
        atomic_write_text(out / "track.json", json.dumps(track, indent=1))
        atomic_write_csv(out / "track.csv", dicts)


def _validation_losses(run: Path) -> dict[int, float]:
    """Step -> validation loss, from the checkpoint index and the training rows of metrics.jsonl."""
    losses = {e["step"]: e["val_loss"] for e in read_index(run) if e.get("val_loss") is not None}
    losses.update({r["step"]: r["val_loss"] for r in read_metrics(run) if r.get("kind") is None and "val_loss" in r})
    return losses


def track_monitor(run: str | Path, out: str | Path, every: int = 1) -> list[CheckpointScalars]:
    """:func:`track_run` without checkpoints: every ``every``-th curvature row a monitored run
    recorded while it trained (nothing is recomputed), each with the validation loss of its step
    where one was evaluated (else NaN); write ``track.json`` and ``track.csv`` to ``out``. Rows whose
    status is not ``ok`` stay, with their message, and count as Taylor failures.

    A run still training may be drawn: its rows are whole lines, each final once written, so this is
    the rows recorded so far (watching a run as it trains); only checkpoints are refused while written."""
    if every < 1:
        raise CurvlabError(f"--every must be >= 1, got {every}")
    run, out = Path(run), Path(out)
    rows = monitor_rows(run)[::every]
    if not rows:
        raise CurvlabError(f"{run}: metrics.jsonl holds no curvature rows (train with --curvature-every K)")
    config = json.loads((run / "config.json").read_text()) if (run / "config.json").is_file() else {}
    val = _validation_losses(run)
    summaries = [r.scalars(val.get(r.step, float("nan")), config.get("optimizer", "")) for r in rows]
    with own_directory(out, "track"):
        _write_track(out, summaries, {"run": str(run), "source": "monitor", "heldout_tokens": rows[0].heldout_tokens})
    return summaries


TRACK_SOURCES = ("auto", "monitor", "checkpoints")


def track_source(run: str | Path, source: str = "auto") -> str:
    """``"monitor"`` or ``"checkpoints"``: what ``curvlab track`` draws for ``source``; ``"auto"``
    takes the monitor's rows when the run's metrics.jsonl holds any, else analyses the checkpoints."""
    if source not in TRACK_SOURCES:
        raise CurvlabError(f"unknown track source {source!r}; choose one of {', '.join(TRACK_SOURCES)}")
    if source != "auto":
        return source
    return "monitor" if (Path(run) / METRICS_FILE).is_file() and monitor_rows(run) else "checkpoints"


@dataclass(frozen=True)
class Track:
    """A run's trajectory as ``curvlab track`` draws it.

    Attributes:
        source: ``"monitor"`` (the rows training recorded, :func:`track_monitor`) or ``"checkpoints"``
            (the checkpoints analysed, :func:`track_run`).
        rows: one per tracked step, in step order.
    """

    source: str
    rows: list[CheckpointScalars]


def track(
    run: str | Path,
    out: str | Path,
    settings: AnalysisSettings | None = None,
    *,
    source: str = "auto",
    every: int = 1,
    device: str = "cpu",
    progress: bool = True,
    fsdp: bool = False,
) -> Track:
    """The trajectory of ``run`` from ``source`` (:func:`track_source`): its monitor rows
    (:func:`track_monitor`; ``settings``, ``device`` and ``fsdp`` unused) or its checkpoints analysed under
    ``settings`` (:func:`track_run`); ``track.json`` and ``track.csv`` written to ``out``.

    Raises:
        CurvlabError: an unknown source; a spectrum asked of sharded checkpoints; what the two raise.
    """
    if fsdp and settings is not None and settings.spectrum_top:
        raise CurvlabError(
            "--spectrum is not available with --fsdp yet "
            "(from Python: curvlab.curvature.sharded_spectral.sharded_lanczos)"
        )
    if track_source(run, source) == "monitor":
        return Track("monitor", track_monitor(run, out, every=every))
    rows = track_run(run, out, settings=settings, every=every, device=device, progress=progress, fsdp=fsdp)
    return Track("checkpoints", rows)
