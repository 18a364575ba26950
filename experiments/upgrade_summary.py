"""Bring a committed ``summary.json`` of schema 2 to schema 3 from its own ``levels.json``, without training,
or re-derive a schema-3 summary's derived parts (after a fix to how they are derived).

Schema 3 adds the exact p-values of the primary family, the A/A calibration's pairs, claims and power, the
controls and the edge-of-stability context. The first two follow from ``levels.json`` alone, so they are
re-derived here by the code as it is now (:func:`curvlab.studies.primary.primary_family` and
:func:`curvlab.studies.primary.calibration`). The controls need runs that kept twins, which a schema-2 run
did not, so they stay empty, and a note says so. Everything else (the headline, tuning, timings, versions)
is the run's own.

    python experiments/upgrade_summary.py docs/results/standard
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from curvlab.errors import CurvlabError
from curvlab.jobs.presets import PRESETS
from curvlab.studies.controls import controls, stability
from curvlab.studies.mechanism import paired_parts
from curvlab.studies.paper import PRIMARY
from curvlab.studies.primary import calibration, primary_family
from curvlab.studies.records import LevelData
from curvlab.studies.summary import SUMMARY_SCHEMA_VERSION, Summary
from curvlab.util import schema

NOTE = (
    "Upgraded from summary schema 2 by experiments/upgrade_summary.py: the primary family (now with exact "
    "p-values) and the A/A calibration (with its seed pairs, claims and power) re-derived from levels.json; "
    "this run predates the controls (docs/science.md section 14), so it has none."
)


REDERIVED = (
    "The primary family, the A/A calibration, the controls and the edge-of-stability context re-derived from "
    "levels.json by experiments/upgrade_summary.py, by the code of the commit that holds this file."
)
# direction efficiency was registered (docs/science.md section 12) after these runs were made, and its values in
# them were read then: it is shown in them, descriptive, never judged
AFTER_THE_RUN = "direction_efficiency_ratio"
DESCRIPTIVE_HERE = (
    "direction_efficiency_ratio is descriptive here, and so are the controls judged by an equivalence band: their "
    "rules were registered after this run was made and read (docs/science.md sections 12 and 14); the "
    "regenerated runs judge them."
)


def judged_then(preset) -> tuple[str, ...]:
    """The claims a committed run judges when re-derived: its design's, without those registered after it."""
    names = preset.inference.primary or tuple(c.name for c in PRIMARY)
    return tuple(n for n in names if n != AFTER_THE_RUN)


def upgrade(results: Path) -> Summary:
    """Schema 2 to 3 (no controls: the run kept no twins), or a schema-3 summary's derived parts again."""
    raw = schema.unsealed(json.loads((results / "summary.json").read_text()), results / "summary.json", "summary")
    version = raw.get("schema_version")
    if version not in (2, SUMMARY_SCHEMA_VERSION):
        raise CurvlabError(f"{results / 'summary.json'}: schema {version}, not 2 or {SUMMARY_SCHEMA_VERSION}")
    levels = LevelData.load(results / "levels.json")
    preset = PRESETS[raw["preset"]]
    aa = [(r.seed - 1, r.seed) for r in levels.comparisons if r.name in ("adamw/adamw", "muon/muon")]
    pairs = sorted(set(aa)) if version == 2 else [tuple(p) for p in raw["calibration"]["pairs"]]
    with_controls = version == SUMMARY_SCHEMA_VERSION and bool(raw["controls"])
    note = NOTE if version == 2 else REDERIVED
    raw.update(
        schema_version=SUMMARY_SCHEMA_VERSION,
        primary=[e.to_dict() for e in primary_family(levels, judged=judged_then(preset))],
        calibration=calibration(levels.comparisons, data=levels if with_controls else None, pairs=pairs).to_dict(),
        controls=[c.to_dict() for c in controls(levels, registered=False)] if with_controls else [],
        edge_of_stability=[e.to_dict() for e in stability(levels)] if with_controls else [],
        paired_parts={k: t.to_dict() for k, t in paired_parts(levels).items()},
        notes=[*(n for n in raw["notes"] if n not in (REDERIVED, DESCRIPTIVE_HERE)), note, DESCRIPTIVE_HERE],
    )
    for e in raw["primary"]:  # (its rule was registered after this run was read)
        e["rule_set"] = "after" if e["name"] == AFTER_THE_RUN else e["rule_set"]
    summary = Summary.from_dict(raw)
    schema.save(results / "summary.json", summary)
    return summary


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        upgrade(Path(arg))
