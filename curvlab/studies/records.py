"""What a reproduction measured, as typed data: ``analysis/levels.json`` (:class:`LevelData`,
``LEVELS_SCHEMA_VERSION``) holds every matched comparison of every seed (:class:`ComparisonRecord`: each
level's windows, with every analysed checkpoint's scalars) and every tracked trajectory
(:class:`TrackRecord`). The headline (:mod:`curvlab.studies.headline`), the primary family
(:mod:`curvlab.studies.primary`) and the figures derive from it alone, so a summary can be re-derived from
``levels.json`` (and the tests do so).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, TypeVar

import numpy as np

from curvlab.curvature.scalars import CheckpointScalars
from curvlab.studies.compare import Comparison
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_text
from curvlab.util.codec import Record

LEVELS_SCHEMA_VERSION = 1
SCOPES = ("all", "hidden")
MATCHED = {"muon": "adamw/muon", "muon-moonlight": "adamw/muon-moonlight"}  # Muon arm -> comparison name
PRIMARY_COMPARISON = MATCHED["muon"]  # what the paired and the between-run claims read


class JsonFile(Record):
    """A record kept as one JSON file, sealed (:func:`schema.sealed <curvlab.util.schema.sealed>`): :meth:`load`
    refuses an edited or damaged file, or one of another schema version."""

    __slots__ = ()
    STRICT: ClassVar[bool] = False  # a file other programs read: strict JSON, NaN as null (schema.save)

    def save(self, path: str | Path, indent: int | None = 1) -> None:
        """Write the JSON (``NaN`` kept, as per-level values need it, unless ``STRICT``), sealed, atomically."""
        if self.STRICT:
            schema.save(path, self)
            return
        atomic_write_text(path, json.dumps(schema.sealed(self.to_dict(), strict=False), indent=indent))

    @classmethod
    def load(cls: type[R], path: str | Path) -> R:
        return schema.load(path, cls)


R = TypeVar("R", bound=JsonFile)


@dataclass
class ComparisonRecord(Record):
    """One matched comparison of one seed: AdamW's run against one Muon arm's (or why there is none)."""

    name: str  # "adamw/muon" or "adamw/muon-moonlight"
    seed: int
    s: float
    comparison: Comparison | None
    error: str | None = None  # why no comparison (e.g. the runs never overlap in the stable phase)
    JSON_KEYS: ClassVar[tuple] = (..., "error", "comparison")  # (the short error before the long comparison)


@dataclass
class TrackRecord(Record):
    """The tracked checkpoints of one run (``track_run`` rows)."""

    arm: str
    s: float
    seed: int
    steps: int  # the run's length
    warmup_steps: int
    rows: list[CheckpointScalars]

    def after_warmup(self) -> list[CheckpointScalars]:
        """The checkpoints in the stable phase (after warmup, before the decay) and off the unigram plateau:
        what trajectory means average. The decay phase is left out: there Z shrinks with the multiplier,
        and the arms spend it at different losses."""
        stable = [r for r in self.off_plateau() if r.phase in (None, "stable")]
        return [r for r in stable if r.step >= self.warmup_steps]

    def off_plateau(self) -> list[CheckpointScalars]:
        """The checkpoints off the unigram plateau (kept out of the headline, like matched levels there:
        NDS is tiny and changes sign there, and the arms spend different times on it)."""
        return [r for r in self.rows if not r.on_plateau]

    def early_and_late(self) -> tuple[list[CheckpointScalars], list[CheckpointScalars]]:
        """The first and the last third, by step, of the analysed segment (:meth:`after_warmup`: the
        stable phase off the plateau), where rho_within is read early and late (docs/science.md section 3).

        Thirds of the segment, not of training: a short run can spend its first third of training on the
        unigram plateau (in standard's 400 steps, every AdamW checkpoint up to step 133), where nothing is
        analysed, and its last third partly in the decay, which trajectory statistics leave out. Each
        run's segment is its own, so an arm that leaves the plateau later reads a later, shorter span. A
        segment of fewer than two distinct steps has neither."""
        rows = sorted(self.after_warmup(), key=lambda r: r.step)
        first, last = (rows[0].step, rows[-1].step) if rows else (0, 0)
        if first == last:
            return [], []
        third = (last - first) / 3
        return [r for r in rows if r.step <= first + third], [r for r in rows if r.step >= last - third]


@dataclass(frozen=True)
class SeedBand:
    """One scalar along the trajectories of several seeds: at each step every track has, the mean over
    the seeds and the lowest and highest seed's value."""

    steps: list[int]
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray


def seed_band(tracks: Sequence[TrackRecord], key: str) -> SeedBand:
    """:class:`SeedBand` of the scalar ``key`` (a :data:`~curvlab.curvature.scalars.SCALAR_KEYS` name) over ``tracks``,
    at the steps common to all of them."""
    steps = sorted(set.intersection(*({r.step for r in t.rows} for t in tracks)))
    values = np.array([[next(r.value(key) for r in t.rows if r.step == k) for k in steps] for t in tracks])
    return SeedBand(steps, values.mean(0), values.min(0), values.max(0))


@dataclass
class LevelData(JsonFile):
    """Everything measured in one reproduction (``analysis/levels.json``)."""

    comparisons: list[ComparisonRecord]
    tracks: list[TrackRecord]
    plateau_ceiling: float | None
    s_values: list[float]
    schema_version: int = LEVELS_SCHEMA_VERSION
    SCHEMA_VERSION: ClassVar[int] = LEVELS_SCHEMA_VERSION
    WHAT: ClassVar[str] = "levels.json"
    JSON_KEYS: ClassVar[tuple] = ("schema_version", "plateau_ceiling", "s_values", ...)  # the short keys first

    def track(self, arm: str, s: float) -> list[TrackRecord]:
        return sorted((t for t in self.tracks if t.arm == arm and t.s == s), key=lambda t: t.seed)

    def matched(self, name: str) -> list[ComparisonRecord]:
        return sorted((c for c in self.comparisons if c.name == name), key=lambda c: c.seed)

    def against_adamw(self) -> dict[str, list[Comparison]]:
        """Muon arm -> its comparisons with AdamW that have levels off the plateau, in seed order (the A/A
        calibration comparisons, "adamw/adamw" and "muon/muon", are not among them)."""
        arms: dict[str, list[Comparison]] = {}
        for r in sorted(self.comparisons, key=lambda c: c.seed):
            first, second = r.name.split("/")
            if first == "adamw" != second and r.comparison is not None and r.comparison.headline_levels:
                arms.setdefault(second, []).append(r.comparison)
        return arms


def with_levels_off_plateau(records: list[ComparisonRecord]) -> list[ComparisonRecord]:
    """The records whose matched comparison has a level off the unigram plateau (what any claim reads)."""
    return [r for r in records if r.comparison is not None and r.comparison.headline_levels]


def analysed_points(record: ComparisonRecord, data: LevelData) -> dict[tuple[str, int], CheckpointScalars]:
    """Every distinct analysed checkpoint of one seed's matched comparison at the first s, by (optimizer,
    step): the members of its matched windows (off the plateau), then the tracked trajectory's
    checkpoints of both arms in the stable phase off the plateau (a window member analysed again for the
    trajectory counts once). These are the points of the paired claim and of the controls: at each, every
    direction is measured at one W, on one batch, under one H."""
    points: dict[tuple[str, int], CheckpointScalars] = {}
    for lv in record.comparison.headline_levels if record.comparison else []:
        for side in (lv.a, lv.b):
            for m in side.members:
                points[(side.optimizer, m.step)] = m
    s0 = data.s_values[0]
    for arm in ("adamw", "muon"):
        for t in (t for t in data.track(arm, s0) if t.seed == record.seed):
            for row in t.after_warmup():
                key = (row.optimizer or arm, row.step)
                if key not in points:
                    points[key] = row
                    continue
                # the same checkpoint, analysed for a window and for the trajectory: the window member's
                # scalars stand, and the controls only the trajectory took (held-out H, stability) join them
                extra = {
                    k: v for k, v in row.paired.items() if k.startswith("control_") and k not in points[key].paired
                }
                if extra:
                    points[key] = replace(points[key], paired={**points[key].paired, **extra})
    return points
