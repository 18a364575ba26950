"""What ``curvlab reproduce --preset robustness`` concludes (``summary.json``, :class:`RobustnessSummary`):
the paired direction ratio, with its controls and edge-of-stability context, at each setting a reviewer
would change (docs/science.md section 15), judged from each setting's own ``levels.json`` alone.

A setting's ratio is the primary family's ``paired_direction_ratio`` (:func:`curvlab.studies.primary.
primary_family`, judged alone: one claim, no Holm correction across settings, which are not a family of
tests of one hypothesis but one estimate under changed conditions), with direction efficiency beside it,
judged alone alike, its controls those of every
reproduction (:func:`curvlab.studies.controls.controls`), and ``controls_passed`` whether every measured
control passed (``None``: none was measured). Nothing is dropped: a setting whose ratio is not measured,
or whose controls fail, is a row saying so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from curvlab.studies.controls import ControlEntry, StabilityEntry, controls, stability
from curvlab.studies.primary import primary_family
from curvlab.studies.records import JsonFile, LevelData
from curvlab.util.codec import Record
from curvlab.util.versions import SoftwareVersions

ROBUSTNESS_SCHEMA_VERSION = 1
PAIRED = "paired_direction_ratio"
EFFICIENCY = "direction_efficiency_ratio"


@dataclass(frozen=True)
class SettingResult(Record):
    """One setting's paired ratio (geometric mean over seeds of the per-seed medians, 95% log-t interval),
    its verdict alone, its controls, its edge-of-stability context, and the learning rates it ran at."""

    setting: str
    label: str
    paired_ratio: float | None
    ci95: list[float] | None
    n_seeds: int
    n_points: int
    direction: str
    verdict: str  # the direction with what the exact test says where it can't back it (PrimaryEntry.verdict_text)
    p_exact: float | None
    controls_passed: bool | None
    failed_controls: list[str]
    lr: dict[str, dict[str, float]]
    controls: list[ControlEntry] = field(default_factory=list)
    edge_of_stability: list[StabilityEntry] = field(default_factory=list)
    # direction efficiency, judged alone like the paired ratio (value, ci95, verdict); ``registered`` False: a
    # setting run before issue 50 registered its rule and the equivalence bands, which are descriptive in it
    efficiency: dict[str, Any] | None = None
    registered: bool = True


def setting_result(
    setting: str, label: str, levels: LevelData, lr: dict[str, dict[str, float]], registered: bool = True
) -> SettingResult:
    """One setting's row, from its ``levels.json`` (module docstring); ``registered`` False: a run made before
    direction efficiency's rule and the controls' equivalence bands were registered, where they are
    descriptive."""
    p = next(e for e in primary_family(levels, judged=(PAIRED,)) if e.name == PAIRED)
    family = primary_family(levels, judged=(EFFICIENCY,) if registered else ())
    q = next(e for e in family if e.name == EFFICIENCY)
    efficiency = {"value": q.value, "ci95": q.ci95, "verdict": q.verdict_text}
    checks = controls(levels, registered)
    measured = [c for c in checks if c.passed is not None]
    ratio = (p.value, p.ci95, p.n_seeds, p.n_units, p.direction, p.verdict_text, p.p_exact)
    passed = all(c.passed for c in measured) if measured else None
    failed = [f"{c.name} ({c.arm})" for c in measured if not c.passed]
    context = stability(levels)
    return SettingResult(setting, label, *ratio, passed, failed, lr, checks, context, efficiency, registered)


@dataclass(frozen=True)
class RobustnessSummary(JsonFile):
    """``summary.json`` of the robustness design: one :class:`SettingResult` per setting, in the preset's
    order, with what the design was (``base``: the preset it varies; ``seeds``: each setting's measurement
    seeds) and how long it took."""

    STRICT: ClassVar[bool] = True

    preset: str
    base: str
    seeds: list[int]
    settings: list[SettingResult]
    timing: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    versions: SoftwareVersions | None = None
    figures: list[str] = field(default_factory=list)
    schema_version: int = ROBUSTNESS_SCHEMA_VERSION
    SCHEMA_VERSION: ClassVar[int] = ROBUSTNESS_SCHEMA_VERSION
    WHAT: ClassVar[str] = "robustness summary.json"

    def setting(self, name: str) -> SettingResult:
        return next(x for x in self.settings if x.setting == name)


@dataclass
class RobustnessLevels(JsonFile):
    """``levels.json`` of the robustness design: every setting's :class:`LevelData`, by setting name."""

    settings: dict[str, LevelData]
    schema_version: int = ROBUSTNESS_SCHEMA_VERSION
    SCHEMA_VERSION: ClassVar[int] = ROBUSTNESS_SCHEMA_VERSION
    WHAT: ClassVar[str] = "robustness levels.json"
    JSON_KEYS: ClassVar[tuple] = ("schema_version", ...)

    def save(self, path: str | Path, indent: int | None = None) -> None:
        """As :meth:`JsonFile.save <curvlab.studies.records.JsonFile.save>`, unindented: 27 seeds' levels are 10 MB
        with indentation."""
        super().save(path, indent)
