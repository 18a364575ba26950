"""Two runs of one design side by side (for example on 1 and on 2 threads: floats change trajectories),
claim by claim (docs/science.md section 12, reruns):

* whether each run's estimate lies inside the other run's 95% interval (mutual inclusion). For two
  independent replicates with exact intervals at 5 seeds this holds with probability 0.81 only;
* the shift between the runs, paired by seed: the mean over their common seeds of the difference of
  the two runs' per-seed values (of their logs, for a claim judged on the log scale), with its t
  interval and p-value (:func:`curvlab.inference.statistics.mean_inference`), where both runs judged the
  claim by the same t method. A rerun keeps each seed's initialization and data order, so the pairing
  removes the seed-to-seed spread, and what is left is what the change of floats did. Under "the
  rerun changes nothing systematic" p is uniform.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from curvlab.inference import statistics
from curvlab.studies.primary import PrimaryEntry
from curvlab.studies.summary import Summary


@dataclass(frozen=True)
class RerunComparison:
    """One primary claim in two runs: both entries, mutual inclusion (``None`` where a run has no
    estimate or interval) and the shift between them paired by seed (``None`` below 2 common seeds)."""

    this: PrimaryEntry
    other: PrimaryEntry
    this_in_other: bool | None
    other_in_this: bool | None
    shift: statistics.SeedInference | None
    log_scale: bool


def _inside(value: float | None, ci: list[float] | None) -> bool | None:
    return None if value is None or ci is None else bool(ci[0] <= value <= ci[1])


def _per_seed(entry: PrimaryEntry, log_scale: bool) -> dict[int, float]:
    values = [(row["seed"], row.get("value")) for row in entry.per_seed]
    kept = [(s, v) for s, v in values if v is not None and math.isfinite(v) and (v > 0 or not log_scale)]
    return {s: math.log(v) if log_scale else v for s, v in kept}


def compare_reruns(summary: Summary, rerun: Summary) -> list[RerunComparison]:
    """Every primary claim that either run measured, in ``summary``'s order."""
    others = {(e.name, e.scope): e for e in rerun.primary}
    rows = []
    for e in summary.primary:
        o = others.get((e.name, e.scope))
        if o is None or (e.value is None and o.value is None):
            continue
        # the scale both were judged on: per-seed values that are comparable (a Fieller entry's per-seed
        # ratios are not its estimate, a ratio of means, and blow up where a denominator nears 0)
        log_scale = e.method == o.method == statistics.LOG_T
        comparable = e.method == o.method and e.method in (statistics.LOG_T, statistics.MEAN_T)
        a, b = _per_seed(e, log_scale), _per_seed(o, log_scale)
        common = sorted(set(a) & set(b))
        shift = statistics.mean_inference([b[s] - a[s] for s in common]) if comparable and len(common) >= 2 else None
        rows.append(RerunComparison(e, o, _inside(e.value, o.ci95), _inside(o.value, e.ci95), shift, log_scale))
    return rows
