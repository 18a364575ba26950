"""The cells of the results tables: how one number, one interval or one entry is written in ``report.md``, the
README's results and the study pages (3 significant figures, ``value [lo, hi]``, "—" where nothing was measured)."""

from __future__ import annotations

import math

from curvlab.inference import statistics
from curvlab.studies.headline import HeadlineEntry
from curvlab.studies.primary import PrimaryEntry
from curvlab.studies.rerun import RerunComparison

PERCENT = ("rho_within", "embed_head_share")


def fmt(x: float | None, name: str = "") -> str:
    """A number to 3 significant figures (a percentage for shares and rho_within)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if any(name.startswith(p) for p in PERCENT):
        return f"{x:.0%}"
    return f"{x:.3g}"


def value_cell(e: HeadlineEntry) -> str:
    """``value [lo, hi]`` (or why there is no interval)."""
    if e.value is None:
        return f"— ({e.note})" if e.note else "—"
    if e.ci95 is None:
        why = "denominator's sign not settled: " if statistics.DENOMINATOR_NOTE in e.note else ""
        return f"{fmt(e.value, e.name)} ({why}no interval)"
    return f"{fmt(e.value, e.name)} [{fmt(e.ci95[0], e.name)}, {fmt(e.ci95[1], e.name)}]"


def seeds_and_levels_cell(e: HeadlineEntry) -> str:
    """``seeds, levels`` an entry was estimated from ("—" when none)."""
    return f"{e.n_seeds}, {e.n_levels}" if e.n_seeds else "—"


def primary_cell(e: PrimaryEntry) -> str:
    """``value [lo, hi]`` of a primary entry, with what was judged when a ratio fell back to a difference."""
    if e.value is None:
        return "not measured"
    shown = fmt(e.value) + interval_text(e.ci95)
    if e.method == statistics.DIFFERENCE_T:
        shown += " (as a difference: the denominator's sign is not settled)"
    return shown


def interval_text(ci: list[float] | None) -> str:
    """`` [lo, hi]`` after a value (nothing when there is no interval)."""
    return "" if ci is None else f" [{fmt(ci[0])}, {fmt(ci[1])}]"


def yes_no_cell(inside: bool | None) -> str:
    """Whether an estimate lies inside the other run's interval ("—": no interval to lie in)."""
    return "—" if inside is None else "yes" if inside else "no"


def shift_cell(row: RerunComparison) -> str:
    """The paired shift between the runs: a factor on the log scale, a difference otherwise."""
    if row.shift is None or row.shift.ci95 is None:
        return "—"
    m, (lo, hi) = row.shift.value, row.shift.ci95
    if row.log_scale:
        return f"×{math.exp(m):.3g} [{math.exp(lo):.3g}, {math.exp(hi):.3g}], p {row.shift.p:.2g}"
    return f"{m:+.3g} [{lo:+.3g}, {hi:+.3g}], p {row.shift.p:.2g}"
