"""What ``curvlab reproduce --preset long`` concludes (``summary.json``, :class:`LongSummary`): the paper's
observations 3 (the AdamW − Muon gap widens with the grammar's imbalance) and 4 (within-layer curvature grows
in Muon's advantage in mid and late training) over a horizon long enough to have a middle and an end (issue 51;
docs/science.md section 18).

Each s is measured as its own reproduction at its own learning rates (a 3-point search at that s). The primary
family reads the trajectories of both s and the first s's comparisons; the preset judges observation 3 there
(``zipf_gap_change``), the rest descriptive. The matched levels of each s are split into thirds of training
(:mod:`curvlab.studies.thirds`), where observation 4 is judged (:data:`curvlab.studies.thirds.JUDGED`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from curvlab.studies.primary import PrimaryEntry
from curvlab.studies.records import JsonFile, LevelData
from curvlab.studies.thirds import ThirdEstimate
from curvlab.studies.tuning import TuningRecord
from curvlab.util.versions import SoftwareVersions

LONG_SCHEMA_VERSION = 1


def merged_levels(parts: dict[float, LevelData]) -> LevelData:
    """One :class:`LevelData` of every s's trajectories and the first s's comparisons (the primary family's paired
    and between-run claims are about one s; its Zipf and rho claims read the trajectories of both)."""
    s_values = sorted(parts)
    first = parts[s_values[0]]
    tracks = [t for s in s_values for t in parts[s].tracks]
    return LevelData(list(first.comparisons), tracks, first.plateau_ceiling, s_values)


@dataclass(frozen=True)
class LongSummary(JsonFile):
    """``summary.json`` of the long design: its horizon and seeds, each s's tuning, the primary family (judged
    as :attr:`~curvlab.studies.design.Inference.primary` says) and the estimates by third."""

    STRICT: ClassVar[bool] = True

    preset: str
    steps: int
    seeds: list[int]
    tuning: dict[str, TuningRecord]  # s -> its search
    primary: list[PrimaryEntry]
    thirds: list[ThirdEstimate]
    timing: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    versions: SoftwareVersions | None = None
    figures: list[str] = field(default_factory=list)
    schema_version: int = LONG_SCHEMA_VERSION
    SCHEMA_VERSION: ClassVar[int] = LONG_SCHEMA_VERSION
    WHAT: ClassVar[str] = "long summary.json"

    def primary_entry(self, name: str) -> PrimaryEntry:
        return next(e for e in self.primary if e.name == name)


@dataclass
class LongLevels(JsonFile):
    """``levels.json`` of the long design: each s's :class:`LevelData`, by s (``"0"``, ``"1"``)."""

    parts: dict[str, LevelData]
    schema_version: int = LONG_SCHEMA_VERSION
    SCHEMA_VERSION: ClassVar[int] = LONG_SCHEMA_VERSION
    WHAT: ClassVar[str] = "long levels.json"
    JSON_KEYS: ClassVar[tuple] = ("schema_version", ...)

    def save(self, path, indent: int | None = None) -> None:
        """Unindented, as the other composite designs' levels."""
        super().save(path, indent)
