"""``summary.json`` (:class:`Summary`, ``SUMMARY_SCHEMA_VERSION``): what a reproduction concludes, for the
report, the README and the figures."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from curvlab.errors import CurvlabError
from curvlab.studies.controls import ControlEntry, StabilityEntry
from curvlab.studies.headline import HeadlineEntry, ZipfPoint
from curvlab.studies.mechanism import CellEntry, Term
from curvlab.studies.primary import Calibration, PrimaryEntry
from curvlab.studies.records import JsonFile
from curvlab.studies.tuning import TuningRecord
from curvlab.theory.quadratic import QuadraticStudy
from curvlab.util.codec import Record
from curvlab.util.versions import SoftwareVersions

SUMMARY_SCHEMA_VERSION = 3  # 2: the primary family and the A/A calibration; headline descriptive; 3: controls,
# edge of stability, exact p-values, the calibration's pairs, claims and power


@dataclass(frozen=True)
class QuadraticRecord(Record):
    """The quadratic model's closed-form checks in ``summary.json`` (the example of
    :class:`~curvlab.theory.quadratic.QuadraticStudy`): Muon's NDS, its contraction Γ² and gradient
    descent's two-step contraction."""

    muon_nds: float
    muon_contraction: float
    gd_two_step_contraction: float

    @classmethod
    def from_study(cls, study: QuadraticStudy) -> QuadraticRecord:
        closed = study.closed_forms
        return cls(closed.muon_nds, closed.muon_contraction, closed.gd_two_step_contraction)


@dataclass(frozen=True)
class FinewebRecord(Record):
    """Muon against AdamW on FineWeb at the paper's learning rates (one seed: no interval):
    AdamW/Muon ratios of means per quantity over ``levels`` matched levels."""

    ratio_of_means: dict[str, float]
    levels: int
    seeds: int = 1
    note: str = "one seed: no interval"


@dataclass
class Summary(JsonFile):
    """``summary.json``: the headline, the Taylor check, tuning, caveats, timings and figures."""

    STRICT: ClassVar[bool] = True
    preset: str
    headline: list[HeadlineEntry]
    zipf: list[ZipfPoint]  # normalized NDS per (optimizer, s), for the figure and the report
    taylor: dict[str, dict[str, int]]  # arm -> {"checked", "failed"}
    tuning: TuningRecord
    notes: list[str]
    final_val_loss: dict[str, dict[str, list[float]]]  # s -> arm -> per seed
    quadratic: QuadraticRecord
    timing: dict[str, float] = field(default_factory=dict)  # stage -> seconds, over every invocation
    seconds: float = 0.0
    invocations: int = 1
    figures: dict[str, list[str]] = field(default_factory=dict)
    fineweb: FinewebRecord | None = None
    disk_bytes: int = 0  # what the job leaves in its output directory
    primary: list[PrimaryEntry] = field(default_factory=list)  # the primary family (primary_family)
    calibration: Calibration = field(default_factory=Calibration)  # the A/A calibration (calibration)
    versions: SoftwareVersions | None = None  # what it was made with (None: a summary from before they were kept)
    controls: list[ControlEntry] = field(default_factory=list)  # curvlab.studies.controls.controls
    edge_of_stability: list[StabilityEntry] = field(default_factory=list)  # curvlab.studies.controls.stability
    cells: list[CellEntry] = field(default_factory=list)  # the factorial (curvlab.studies.mechanism.cells)
    decomposition: dict[str, Term] | None = None  # curvlab.studies.mechanism.decomposition, where measured
    paired_parts: dict[str, Term] | None = None  # curvlab.studies.mechanism.paired_parts
    schema_version: int = SUMMARY_SCHEMA_VERSION
    SCHEMA_VERSION: ClassVar[int] = SUMMARY_SCHEMA_VERSION
    WHAT: ClassVar[str] = "summary.json"

    def entry(self, name: str, scope: str = "all") -> HeadlineEntry:
        for e in self.headline:
            if e.name == name and e.scope == scope:
                return e
        raise CurvlabError(f"no headline entry {name!r} ({scope})")

    def primary_entry(self, name: str) -> PrimaryEntry:
        for e in self.primary:
            if e.name == name:
                return e
        raise CurvlabError(f"no primary entry {name!r}")
