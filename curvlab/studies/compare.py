"""Two optimizers at matched validation loss (``curvlab compare``). Each analysed checkpoint's report is
cached (by default under ``OUT/reports/``), so a re-run (after an interruption, say) skips what is done;
one run along its trajectory is :mod:`curvlab.studies.track`.

A matched level of a comparison averages each quantity over a *window*: the matched checkpoint and its
neighbours in the same schedule phase (see :mod:`curvlab.runs.match`). Aggregates over levels leave out the
levels on the unigram plateau, and nothing else: the Taylor check (:func:`curvlab.curvature.scalars.taylor_holds`)
judges only claims about predicted against realized decrease, and is reported as a count, never used to
drop a checkpoint from an NDS mean.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from curvlab.analysis.directions import PAIRED, SCOPES, DirectionLandscape
from curvlab.analysis.report import CurvatureReport, cached_report, load_report, report_cache_path
from curvlab.analysis.sharded import checkpoint_analyzer
from curvlab.analysis.targets import AnalysisSettings, method_renamed
from curvlab.curvature.scalars import RATIO_KEYS, CheckpointScalars
from curvlab.errors import CurvlabError
from curvlab.inference.statistics import standard_error
from curvlab.runs.match import Checkpoint, MatchCriteria, NoMatchedLevel, match_runs
from curvlab.util.atomic import atomic_write_csv, atomic_write_text, remove_stale_temporaries
from curvlab.util.codec import Record, meta
from curvlab.util.distributed import is_main
from curvlab.util.lock import check_not_owned, own_directory
from curvlab.util.progress import progress as progress_bar
from curvlab.util.versions import SoftwareVersions

# 2: window means per level, plateau flags, schedule per side, no Taylor filter; 3: settings.hvp_method is
# settings.method (a comparison of 2, in a levels.json written before, is read as one of 3: method_renamed)
COMPARE_SCHEMA_VERSION = 3
# a run still training is refused, not read up to where it has got: its matched levels, and the reports
# cached from them, would depend on the moment of the reading
STILL_TRAINING = "its checkpoint series is still being written; compare or track it once it is done"
SIDE_COLUMNS = ("step", "loss", "multiplier", "lr", "window", "taylor_failures")  # each side's in compare.csv


@dataclass(frozen=True)
class WindowSide(Record):
    """One run's side of a matched level: its matched checkpoint (step, loss, schedule) and the
    per-checkpoint scalars of the window around it, with their means and standard errors."""

    optimizer: str
    step: int
    val_loss: float
    multiplier: float | None
    lr: float | None
    members: list[CheckpointScalars]  # each window member's, in step order
    reports: list[str]
    # the window's aggregates, written for readers of the JSON (not read back: derived from the members)
    JSON_KEYS: ClassVar[tuple] = (..., "update_norm_over_multiplier", "mean", "stderr", "taylor_failures")

    @property
    def mean(self) -> dict[str, float]:
        """Per float scalar every member has (paired ones only where every checkpoint carries them),
        its mean over the window."""
        values = [m.floats() for m in self.members]
        keys = [k for k in values[0] if all(k in v for v in values)]
        return {k: float(np.mean([v[k] for v in values])) for k in keys}

    @property
    def stderr(self) -> dict[str, float]:
        values = [m.floats() for m in self.members]
        return {k: standard_error([v[k] for v in values]) for k in self.mean}

    @property
    def taylor_failures(self) -> int:
        return sum(not m.taylor_ok for m in self.members)

    @property
    def update_norm_over_multiplier(self) -> float | None:
        """The window's mean ||Z|| over the schedule's multiplier (``None`` without a multiplier)."""
        return self.mean["update_norm"] / self.multiplier if self.multiplier else None


@dataclass(frozen=True)
class Level(Record):
    """One matched validation-loss level: the two runs' windows."""

    target: float
    mismatch: float
    on_plateau: bool
    a: WindowSide
    b: WindowSide
    JSON_KEYS: ClassVar[tuple] = (..., ("paired", "paired_terms"))  # (derived, for readers: not read back)

    @property
    def paired_terms(self) -> dict[str, DirectionLandscape] | None:
        """Per scope, the split of the between-run NDS ratio (AdamW over Muon) into a direction and a
        landscape term (:class:`~curvlab.analysis.directions.DirectionLandscape`), from the window means of the
        paired NDS of both arms' directions at both runs' checkpoints; ``None`` unless the level pairs an
        AdamW with a Muon run whose checkpoints carry shadow states."""
        values = self.paired_nds
        return None if values is None else {s: DirectionLandscape.of(*v) for s, v in values.items()}

    @property
    def paired_nds(self) -> dict[str, tuple[float, float, float, float]] | None:
        """Per scope, the window means (adamw at the AdamW run, muon at the AdamW run, adamw at the Muon
        run, muon at the Muon run) of the paired NDS; ``None`` as for :attr:`paired_terms`."""
        sides = {self.a.optimizer: self.a, self.b.optimizer: self.b}
        if set(sides) != set(PAIRED):
            return None
        a, m = sides["adamw"].mean, sides["muon"].mean
        keys = [f"paired_nds_{x}_{s}" for x in PAIRED for s in SCOPES]
        if not all(k in a and k in m for k in keys):
            return None
        return {s: tuple(side[f"paired_nds_{x}_{s}"] for side in (a, m) for x in PAIRED) for s in SCOPES}


@dataclass(frozen=True)
class Comparison(Record):
    """Matched-loss comparison of two runs. ``ratio_label`` says which is over which (Adam/Muon when
    the runs are AdamW and Muon, else B/A). The aggregates run over the levels off the unigram
    plateau; every level stays in ``levels``."""

    SCHEMA_VERSION: ClassVar[int] = COMPARE_SCHEMA_VERSION
    MIGRATIONS: ClassVar[dict] = {2: method_renamed}  # 2 -> 3: settings.hvp_method is settings.method
    WHAT: ClassVar[str] = "comparison"
    # the settings first, then the aggregates over levels (derived, for readers: not read back), the levels
    JSON_KEYS: ClassVar[tuple] = (
        *("schema_version", "ratio", "optimizers", "runs", "phase", "window", "plateau_ceiling", "settings"),
        *("mean_ratios", "median_ratios", "ratio_of_means", "paired_ratio_of_means", "pairs", "refused"),
    )

    levels: list[Level] = field(metadata=meta(key="pairs"))  # one per matched level
    ratio_label: str = field(metadata=meta(key="ratio"))
    refused: list[str]
    optimizers: tuple[str, str] = ("", "")
    phase: str = "any"
    window: int = 0
    plateau_ceiling: float | None = None
    runs: tuple[str, str] = ("", "")
    settings: dict[str, Any] = field(default_factory=dict)

    @property
    def numerator(self) -> str:
        """``"a"`` or ``"b"``: the side on top of the ratios (AdamW's, or else B's)."""
        return "a" if self.optimizers == ("adamw", "muon") else "b"

    def sides(self, level: Level) -> tuple[WindowSide, WindowSide]:
        """(the numerator's side, the denominator's) of one of its levels: AdamW's first, against Muon."""
        return (level.a, level.b) if self.numerator == "a" else (level.b, level.a)

    @property
    def headline_levels(self) -> list[Level]:
        return [lv for lv in self.levels if not lv.on_plateau]

    def level_ratio(self, level: Level, key: str) -> float:
        """One level's ratio of window means of ``key``, the numerator's over the other's (NaN over 0)."""
        num, den = self.sides(level)
        return num.mean[key] / den.mean[key] if den.mean[key] else float("nan")

    def _ratios(self, key: str) -> list[float]:
        return [self.level_ratio(lv, key) for lv in self.headline_levels]

    @property
    def mean_ratios(self) -> dict[str, float]:
        """Mean over levels of the per-level ratios."""
        return {k: float(np.nanmean(self._ratios(k))) if self.headline_levels else float("nan") for k in RATIO_KEYS}

    @property
    def median_ratios(self) -> dict[str, float]:
        return {k: float(np.nanmedian(self._ratios(k))) if self.headline_levels else float("nan") for k in RATIO_KEYS}

    @property
    def ratio_of_means(self) -> dict[str, float]:
        """Sum over levels of one run's values over the other's: robust to near-zero levels."""
        out = {}
        for k in RATIO_KEYS:
            sides = [self.sides(lv) for lv in self.headline_levels]
            den = sum(d.mean[k] for _, d in sides)
            out[k] = sum(n.mean[k] for n, _ in sides) / den if den else float("nan")
        return out

    @property
    def paired_ratio_of_means(self) -> dict[str, DirectionLandscape] | None:
        """Per scope, the direction/landscape split of the ratio of sums over the levels off the plateau
        (each of the four paired NDS summed over levels: the identity holds for the sums too); ``None``
        unless every such level has paired terms."""
        values = [lv.paired_nds for lv in self.headline_levels]
        if not values or any(v is None for v in values):
            return None
        return {s: DirectionLandscape.of(*np.sum([v[s] for v in values], axis=0).tolist()) for s in SCOPES}

    @property
    def rows(self) -> list[dict[str, Any]]:
        """One flat row per level (the CSV): window means of both sides and their ratios."""
        rows = []
        for lv in self.levels:
            row = {"target": lv.target, "mismatch": lv.mismatch, "on_plateau": lv.on_plateau}
            for tag, side in (("a", lv.a), ("b", lv.b)):
                values = (side.step, side.val_loss, side.multiplier, side.lr, len(side.members), side.taylor_failures)
                row.update({f"{k}_{tag}": v for k, v in zip(SIDE_COLUMNS, values)})
                row.update({f"{k}_{tag}": v for k, v in side.mean.items()})
            row.update({f"ratio_{k}": self.level_ratio(lv, k) for k in RATIO_KEYS})
            for scope, terms in (lv.paired_terms or {}).items():
                row.update({f"{k}_{scope}": v for k, v in terms.to_dict().items()})
            rows.append(row)
        return rows


def _window_side(
    window: Sequence[Checkpoint], centre_step: int, cache: Path, settings, device, fsdp: bool = False
) -> WindowSide:
    reports = [
        cached_report(cache, c.path, settings, device=device, analyze_fn=checkpoint_analyzer(fsdp)) for c in window
    ]
    centre = next(c for c in window if c.step == centre_step)
    paths = [str(report_cache_path(cache, c.path, settings)) for c in window]
    scalars = [r.scalars() for r in reports]
    return WindowSide(reports[0].optimizer, centre.step, centre.val_loss, centre.multiplier, centre.lr, scalars, paths)


def compare_runs(
    run_a: str | Path,
    run_b: str | Path,
    out: str | Path,
    criteria: MatchCriteria | None = None,
    settings: AnalysisSettings | None = None,
    *,
    device: str = "cpu",
    progress: bool = True,
    cache: str | Path | None = None,
    fsdp: bool = False,
) -> Comparison:
    """Analyse every level of two runs matched by ``criteria`` (default :class:`MatchCriteria`: 8
    levels in the stable phase), each side averaged over its window of ``2 window + 1`` checkpoints
    at most, under ``settings``; write ``compare.json`` and ``compare.csv`` to ``out``.

    Args:
        cache: where reports are cached (default ``out/reports``); share one between studies to
            analyse a checkpoint once.
        fsdp: the runs' checkpoints are sharded (DCP directories, ``curvlab train --fsdp``): every
            rank under torchrun analyses each one sharded (:mod:`curvlab.analysis.sharded`); the
            reports equal the unsharded ones, rank 0 writes the outputs.

    A run that a live process still trains (its directory held: :mod:`curvlab.util.lock`) is refused;
    ``out`` is held while the comparison writes there (a second comparison into it is refused).

    Raises:
        CurvlabError: a run still training, ``out`` in use by another process, bad runs (see
            :func:`curvlab.runs.match.match_runs`), or no level within tolerance.
    """
    criteria = criteria or MatchCriteria()
    criteria.validate()
    settings = settings or AnalysisSettings()
    settings.validate()
    out = Path(out)
    cache = Path(cache) if cache else out / "reports"
    levels, phase, window, plateau_ceiling = criteria.levels, criteria.phase, criteria.window, criteria.plateau_ceiling
    for run in (run_a, run_b):
        check_not_owned(run, STILL_TRAINING)
    options = {"phase": phase, "plateau_ceiling": plateau_ceiling, "window_width": window}
    matching = match_runs(
        run_a, run_b, levels if isinstance(levels, int) else list(levels), criteria.tolerance, **options
    )
    if not matching.pairs:
        raise NoMatchedLevel("no matched pair within tolerance: " + "; ".join(matching.refused))
    with own_directory(out, "compare"):
        remove_stale_temporaries(out, cache)  # (what killed writes left: never read)
        matched = []
        for pair in progress_bar(matching.pairs, desc="compare", disable=not progress):
            a = _window_side(pair.window_a, pair.a.step, cache, settings, device, fsdp)
            b = _window_side(pair.window_b, pair.b.step, cache, settings, device, fsdp)
            matched.append(Level(pair.target, pair.mismatch, pair.on_plateau, a, b))
        names = (matched[0].a.optimizer, matched[0].b.optimizer)
        label = "adamw/muon" if set(names) == {"muon", "adamw"} else f"B/A ({names[1]}/{names[0]})"
        runs = (str(run_a), str(run_b))
        result = Comparison(
            matched, label, matching.refused, names, phase, window, plateau_ceiling, runs, asdict(settings)
        )
        if is_main():
            made_with = {"versions": SoftwareVersions.current().to_dict()}
            atomic_write_text(out / "compare.json", json.dumps({**result.to_dict(), **made_with}, indent=1))
            atomic_write_csv(out / "compare.csv", result.rows)
    return result


def pair_reports(level: Level) -> dict[str, CurvatureReport]:
    """The reports of the matched checkpoints (the window centres) of one level, keyed by optimizer."""
    out = {}
    for side in (level.a, level.b):
        centre = next(i for i, m in enumerate(side.members) if m.step == side.step)
        out[side.optimizer] = load_report(side.reports[centre])
    return out


def within_layer_gap(comparisons: Sequence[Comparison]) -> tuple[list[str], list[float], list[float]]:
    """Per block, the within-layer entry M[l,l] of AdamW minus Muon's at the matched checkpoints,
    averaged over the levels off the plateau of one or more comparisons (seeds), and its standard
    error over those levels."""
    gaps, names = [], []
    for comparison in comparisons:
        for level in comparison.headline_levels:
            reports = pair_reports(level)
            if set(reports) != {"muon", "adamw"}:
                raise CurvlabError("within_layer_gap needs a comparison of a Muon run with an AdamW run")
            names = list(reports["muon"].blocks.names)
            gaps.append(np.diag(reports["adamw"].blocks.matrix) - np.diag(reports["muon"].blocks.matrix))
    if not gaps:
        raise CurvlabError("no matched level off the unigram plateau to take the within-layer gap from")
    gaps = np.array(gaps)
    se = gaps.std(axis=0, ddof=1) / np.sqrt(len(gaps)) if len(gaps) > 1 else np.full(gaps.shape[1], np.nan)
    return names, gaps.mean(axis=0).tolist(), se.tolist()
