"""The per-seed values each primary claim (:data:`curvlab.studies.paper.PRIMARY`) is judged on: for every seed,
the aggregate of its units (the mean over its matched levels, the median of its paired points' ratios, or its
trajectory), numerator and denominator apart for a ratio, with the notes on what was left out
(:func:`claim_inputs`; :mod:`curvlab.studies.primary` infers across the seeds)."""

from __future__ import annotations

from dataclasses import dataclass, field
from math import nan

import numpy as np

from curvlab.curvature.scalars import scope_key
from curvlab.errors import CurvlabError
from curvlab.studies.paper import PrimaryClaim
from curvlab.studies.records import ComparisonRecord, LevelData, TrackRecord, analysed_points, with_levels_off_plateau


@dataclass(frozen=True)
class SeedValues:
    """What one claim infers from: per-seed aggregates (numerator and denominator for a ratio or a
    normalized difference, values alone for a difference), with per-seed details and notes."""

    seeds: list[int]
    numerator: list[float]
    denominator: list[float] | None
    units: list[int]
    notes: list[str] = field(default_factory=list)


def _sign_note(values: list[float], what: str, kept: str = "the per-seed means") -> str:
    bad = sum(1 for v in values if not v > 0)
    return f"{bad} of {len(values)} {what} <= 0 (kept in {kept})" if bad else ""


def _between(records: list[ComparisonRecord], key_of) -> SeedValues | str:
    """Per seed (record), the mean over its levels off the plateau of the numerator side's and the
    denominator side's window means of ``key_of(arm)`` (the arms as the record's name gives them,
    numerator first: ``"adamw/muon"``, or ``"adamw/adamw"`` for an A/A record); a string says what is
    missing."""
    usable = with_levels_off_plateau(records)
    if not usable:
        return "no matched comparison with a level off the unigram plateau"
    seeds, num, den, units, raw, skipped = [], [], [], [], [], []
    for r in usable:
        xs, ys = [], []
        ka, kb = (key_of(arm) for arm in r.name.split("/"))
        for lv in r.comparison.headline_levels:
            a, b = r.comparison.sides(lv)
            ma, mb = a.mean, b.mean  # (a property that averages every key)
            if ka not in ma or kb not in mb:
                return f"no {ka if ka not in ma else kb} in the matched windows (older runs)"
            if not (np.isfinite(ma[ka]) and np.isfinite(mb[kb])):  # (a scalar an older file lacks reads as NaN)
                skipped.append(f"seed {r.seed} at {lv.target:.4g}")
                continue
            xs.append(ma[ka])
            ys.append(mb[kb])
        if xs:
            seeds.append(r.seed)
            num.append(float(np.mean(xs)))
            den.append(float(np.mean(ys)))
            units.append(len(xs))
            raw += xs + ys
    if not seeds:
        return f"no finite {ka} / {kb} in the matched windows (older runs lack it)"
    notes = [n for n in [_sign_note(raw, "window means")] if n]
    if skipped:
        notes.append(f"{len(skipped)} level(s) with a value that is not finite left out ({'; '.join(skipped[:3])})")
    return SeedValues(seeds, num, den, units, notes)


def _point_rows(
    records: list[ComparisonRecord], data: LevelData, keys: tuple[str, ...], optional: tuple[str, ...] = ()
) -> list[tuple[int, list[tuple[float, ...]]]] | str:
    """Per usable seed (a matched comparison with a level off the plateau), the paired scalars ``keys`` at
    every distinct analysed point that holds them all (:func:`~curvlab.studies.records.analysed_points`: the
    matched windows' members and the trajectory's stable checkpoints off the plateau, both arms at the first
    s), in the points' order, then ``optional`` ones (NaN where a point lacks one); a string says what is
    missing (a matched window without ``keys``: older runs)."""
    usable = with_levels_off_plateau(records)
    if not usable:
        return "no matched comparison with a level off the unigram plateau"
    out = []
    for r in usable:
        points = analysed_points(r, data)
        sides = [side for lv in r.comparison.headline_levels for side in (lv.a, lv.b)]
        windows = {(side.optimizer, m.step) for side in sides for m in side.members}
        if any(k not in points[w].paired for w in windows for k in keys):
            return f"no {' / '.join(keys)} in the matched windows (older runs)"
        # a trajectory analysed without shadows adds nothing
        held = [p.paired for p in points.values() if all(k in p.paired for k in keys)]
        out.append((r.seed, [tuple(x[k] for k in keys) + tuple(x.get(k, nan) for k in optional) for x in held]))
    return out


@dataclass(frozen=True)
class _Medians:
    """Per seed, the median of its points' ratios (seeds with no ratio left out, in ``dropped``; ``kept``: the
    others' places in the rows), and how many points had no ratio (``undefined``)."""

    seeds: list[int]
    medians: list[float]
    units: list[int]
    dropped: list[int]
    undefined: int
    kept: list[int]


def _point_medians(rows: list[tuple[int, list[tuple[float, ...]]]], ratio) -> _Medians:
    """Each seed's median of ``ratio(*row)`` over its rows, where that is defined (``ratio`` gives ``None``
    where it is not: counted in ``undefined``)."""
    seeds, medians, units, dropped, undefined, kept = [], [], [], [], 0, []
    for i, (seed, points) in enumerate(rows):
        ratios = [x for x in (ratio(*p) for p in points) if x is not None]
        undefined += len(points) - len(ratios)
        if not ratios:
            dropped.append(seed)
            continue
        seeds.append(seed)
        medians.append(float(np.median(ratios)))
        units.append(len(ratios))
        kept.append(i)
    return _Medians(seeds, medians, units, dropped, undefined, kept)


def _paired(records: list[ComparisonRecord], data: LevelData, scope: str) -> SeedValues | str:
    """Per seed, the median over every distinct analysed checkpoint of both arms at the first s, in the
    stable phase and off the plateau (the members of the matched windows and the tracked trajectory),
    of the ratio NDS(AdamW's next-step direction) / NDS(Muon's) at that checkpoint. Both directions are
    at the same W and batch, so any analysed point counts; pooling the trajectory with the windows gives
    each seed a dozen points or more instead of the few the matched levels hold.

    A median of the per-point ratios, not a ratio of means over points: NDS spans two orders of
    magnitude along a run, and one checkpoint where the curvature spikes (×700 its neighbours) set a
    seed's ratio of means, and moved with float noise between a 1- and a 2-thread rerun
    (docs/science.md section 12). The median weighs every point alike and is defined for either sign;
    a point where Muon's NDS is exactly 0 has no ratio and is counted in a note, as are points where
    both NDS are negative (a positive ratio there does not say AdamW's direction is the sharper).

    Each seed's value is its median (``denominator`` 1): inferred across seeds as a log-t interval when
    every median is positive; otherwise Fieller's interval with unit denominators, which is the t
    interval on the arithmetic mean of the medians."""
    ka, km = f"paired_nds_adamw_{scope}", f"paired_nds_muon_{scope}"
    rows = _point_rows(records, data, (ka, km))
    if isinstance(rows, str):
        return rows
    m = _point_medians(rows, lambda x, y: x / y if y != 0 else None)
    if not m.seeds:
        return f"no point with a nonzero {km}"
    kept = [p for i in m.kept for p in rows[i][1]]
    xs_all, ys_all = [x for x, _ in kept], [y for _, y in kept]
    agree = sum((x > 0) == (y > 0) for x, y in kept)
    both_negative = sum(x < 0 and y < 0 for x, y in kept)
    unsigned = "where a positive ratio does not mean AdamW's direction is the sharper"
    notes = [
        _sign_note(xs_all, "points along AdamW's direction have NDS", "the per-seed medians of the ratios"),
        _sign_note(ys_all, "along Muon's", "the medians"),
        f"both directions take the same sign at {agree} of {len(xs_all)} points",
        f"{both_negative} of them with both NDS < 0, {unsigned}" if both_negative else "",
        f"{m.undefined} points with Muon's NDS exactly 0 have no ratio" if m.undefined else "",
        f"seeds {m.dropped}: Muon's NDS is 0 at every point, left out" if m.dropped else "",
    ]
    return SeedValues(m.seeds, m.medians, [1.0] * len(m.medians), m.units, [n for n in notes if n])


def _finite_ratio(x: float, y: float) -> float | None:
    """x / y where both are finite and y is not 0 (``None``: no ratio)."""
    return x / y if np.isfinite(x) and np.isfinite(y) and y != 0 else None


def efficiency_values(
    records: list[ComparisonRecord], data: LevelData, scope: str, every_point: bool = False
) -> SeedValues | str:
    """The direction efficiency (docs/science.md section 12, registered before the runs that judge it): per
    seed, the median over the paired claim's points (:func:`_paired`'s: both directions at the same W and
    batch) of q(Muon's direction) / q(AdamW's), q = cos² / NDS (Muon over AdamW, the other way round from the
    NDS ratios). A point where either direction has NDS <= 0 (⟨Z, HZ⟩ <= 0: the quadratic model has no optimum
    along it) is left out of the estimate and counted per arm in a note; ``every_point`` keeps those points
    (their q negative) for the descriptive row beside the claim. A point where AdamW's q is 0 or either q is not
    finite has no ratio and is counted. Each seed's value is its median (``denominator`` 1), inferred as
    :func:`_paired`'s: log-t when every median is positive, else Fieller's interval with unit denominators."""
    keys = tuple(f"paired_{k}_{arm}_{scope}" for k in ("q", "nds") for arm in ("adamw", "muon"))
    rows = _point_rows(records, data, keys)
    if isinstance(rows, str):
        return rows
    points = [p for _, ps in rows for p in ps]
    no_optimum = {arm: sum(not p[2 + k] > 0 for p in points) for k, arm in enumerate(("AdamW", "Muon"))}
    either = sum(not (p[2] > 0 and p[3] > 0) for p in points)
    if not every_point:
        rows = [(seed, [p for p in ps if p[2] > 0 and p[3] > 0]) for seed, ps in rows]
    m = _point_medians(rows, lambda qa, qm, na, nm: _finite_ratio(qm, qa))
    counted = f"{no_optimum['AdamW']} along AdamW's, {no_optimum['Muon']} along Muon's"
    what = f"of {len(points)} points, {either} had NDS <= 0 (no quadratic optimum) along a direction: {counted}"
    kept = [p for i in m.kept for p in rows[i][1]]
    negative = sum(1 for p in kept if (r := _finite_ratio(p[1], p[0])) is not None and r < 0)
    notes = [
        (f"{what}; kept, their q negative" if every_point else f"{what}; left out of the estimate") if either else "",
        f"{negative} of the ratios kept are negative (the medians take them as they are)" if negative else "",
        f"{m.undefined} points with AdamW's q 0 or a q not finite have no ratio" if m.undefined else "",
        f"seeds {m.dropped}: no point with a ratio, left out" if m.dropped else "",
    ]
    if not m.seeds:
        return "; ".join(["no point with a ratio of q", *(n for n in notes if n)])
    return SeedValues(m.seeds, m.medians, [1.0] * len(m.medians), m.units, [n for n in notes if n])


OPTIMAL_STEP_ROWS = ("realized_over_predicted_adamw", "realized_over_predicted_muon", "realized_ratio")


def optimal_step_values(records: list[ComparisonRecord], data: LevelData) -> dict[str, SeedValues | str]:
    """The quadratic model's optimal step beside the direction efficiency (descriptive; the hidden scope's
    ``paired_optpred_*`` and ``paired_optreal_*``, :class:`curvlab.analysis.directions.PairedCurvature`), at the
    paired claim's points (:data:`OPTIMAL_STEP_ROWS`): per arm (``realized_over_predicted_adamw``, ``..._muon``),
    each seed's median of the realized decrease at η* over the predicted one (``denominator`` None: a mean over
    seeds), and
    (``realized_ratio``) each seed's median of Muon's realized decrease at its η* over AdamW's, Muon over AdamW
    (``denominator`` 1). A point without an optimum (NDS <= 0: the scalars are absent there) has no value: it is
    left out, and counted; runs from before the optimal step was measured have it at no point."""
    arms = ("adamw", "muon")
    keys = tuple(f"paired_nds_{arm}_hidden" for arm in arms)
    optional = tuple(f"paired_{k}_{arm}_hidden" for arm in arms for k in ("optpred", "optreal"))
    rows = _point_rows(records, data, keys, optional)
    if isinstance(rows, str):
        return dict.fromkeys(OPTIMAL_STEP_ROWS, rows)
    if not any(np.isfinite(p[2:]).any() for _, ps in rows for p in ps):
        why = f"no {' / '.join(optional)} at any point (older runs, from before the optimal step was measured; or no "
        return dict.fromkeys(OPTIMAL_STEP_ROWS, why + "point with a quadratic optimum)")
    out: dict[str, SeedValues | str] = {}
    for k, arm in enumerate(arms):
        share = [(seed, [(p[2 + 2 * k], p[3 + 2 * k]) for p in ps]) for seed, ps in rows]
        out[f"realized_over_predicted_{arm}"] = _descriptive_medians(
            share, lambda pred, real: real / pred if np.isfinite(real) and pred > 0 else None, None
        )
    realized = [(seed, [(p[3], p[5]) for p in ps]) for seed, ps in rows]
    out["realized_ratio"] = _descriptive_medians(realized, lambda a, m: _finite_ratio(m, a), 1.0)
    return out


def _descriptive_medians(rows, ratio, denominator: float | None) -> SeedValues | str:
    """Per seed the median of ``ratio`` over its points, with a note on the points without one."""
    m = _point_medians(rows, ratio)
    n = sum(len(ps) for _, ps in rows)
    why = "no optimum: NDS <= 0, or a loss not finite at η*"
    note = f"{m.undefined} of {n} points without a value ({why}), left out" if m.undefined else ""
    if not m.seeds:
        return f"no point with a value: {note}" if note else "no analysed point"
    den = None if denominator is None else [denominator] * len(m.seeds)
    dropped = f"seeds {m.dropped}: no point with a value, left out" if m.dropped else ""
    return SeedValues(m.seeds, m.medians, den, m.units, [x for x in (note, dropped) if x])


def _trajectory_mean(t: TrackRecord, key: str) -> float:
    rows = t.after_warmup()
    return float(np.mean([r.value(key) for r in rows])) if rows and all(r.has(key) for r in rows) else float("nan")


def _zipf_gap(data: LevelData, scope: str) -> SeedValues | str:
    """Per seed (present in all four runs), the change of the AdamW − Muon trajectory-mean NDS gap from
    the first s to the last, (a1 − m1 − a0 + m0) / m0, normalized by that seed's Muon at the first s.
    A seed whose baseline m0 is not positive cannot be normalized: it is left out, and the note says so."""
    if len(data.s_values) < 2:
        return "one value of s only"
    s0, s1 = data.s_values[0], data.s_values[-1]
    key = scope_key("nds", scope)
    runs = {(arm, s): {t.seed: t for t in data.track(arm, s)} for arm in ("adamw", "muon") for s in (s0, s1)}
    common = sorted(set.intersection(*(set(v) for v in runs.values())))
    if not common:
        return f"no seed with trajectories of both arms at s = {s0:g} and s = {s1:g}"
    seeds, values, units, notes = [], [], [], []
    for seed in common:
        m = {k: _trajectory_mean(v[seed], key) for k, v in runs.items()}
        if not all(np.isfinite(x) for x in m.values()):
            notes.append(f"seed {seed}: a trajectory without a checkpoint after warmup off the plateau, left out")
            continue
        if not m[("muon", s0)] > 0:
            notes.append(
                f"seed {seed}: Muon's trajectory-mean NDS at s = {s0:g} is {m[('muon', s0)]:.3g} (<= 0), left out"
            )
            continue
        seeds.append(seed)
        change = m[("adamw", s1)] - m[("muon", s1)] - m[("adamw", s0)] + m[("muon", s0)]
        values.append(change / m[("muon", s0)])
        units.append(sum(len(v[seed].after_warmup()) for v in runs.values()))
    if not seeds:
        return "; ".join(notes)
    return SeedValues(seeds, values, None, units, notes)


def _rho_gap(data: LevelData, scope: str) -> SeedValues | str:
    """Per seed (present in both arms at the first s), the rise of rho_within from early to late
    (:meth:`~curvlab.studies.records.TrackRecord.early_and_late`: the first and the last third of the
    stable phase off the plateau), Muon's minus AdamW's (rho over a third = sum within / sum NDS there)."""
    s0 = data.s_values[0]
    within, total = ("within", "nds") if scope == "all" else ("within_layers", "nds_layers")
    runs = {arm: {t.seed: t for t in data.track(arm, s0)} for arm in ("muon", "adamw")}
    common = sorted(set(runs["muon"]) & set(runs["adamw"]))
    if not common:
        return f"no seed with trajectories of both arms at s = {s0:g}"

    def rise(t: TrackRecord) -> tuple[float, int, str]:
        """(late minus early, the checkpoints read, why there is no value: "" when there is one)."""
        early, late = t.early_and_late()
        if not early:
            return float("nan"), 0, f"{t.arm}: fewer than two stable checkpoints off the plateau"
        thirds = []
        for chosen in (early, late):
            den = sum(r.value(total) for r in chosen)
            thirds.append(sum(r.value(within) for r in chosen) / den if den else float("nan"))
        change = thirds[1] - thirds[0]
        why = "" if np.isfinite(change) else f"{t.arm}: a third whose NDS sums to 0 or is not finite"
        return change, len(early) + len(late), why

    seeds, values, units, notes = [], [], [], []
    for seed in common:
        (m, nm, wm), (a, na, wa) = rise(runs["muon"][seed]), rise(runs["adamw"][seed])
        if wm or wa:
            notes.append(f"seed {seed}: {'; '.join(w for w in (wm, wa) if w)}, left out")
            continue
        seeds.append(seed)
        values.append(m - a)
        units.append(nm + na)
    if not seeds:
        return "; ".join(notes)
    return SeedValues(seeds, values, None, units, notes)


def claim_inputs(claim: PrimaryClaim, data: LevelData, records: list[ComparisonRecord]) -> SeedValues | str:
    if claim.name == "paired_direction_ratio":
        return _paired(records, data, claim.scope)
    if claim.name == "direction_efficiency_ratio":
        return efficiency_values(records, data, claim.scope)
    if claim.name == "between_nds_ratio":
        return _between(records, lambda arm: scope_key("nds", claim.scope))
    if claim.name == "alignment_ratio":
        return _between(records, lambda arm: scope_key("cosine", claim.scope))
    if claim.name == "zipf_gap_change":
        return _zipf_gap(data, claim.scope)
    if claim.name == "rho_within_change_gap":
        return _rho_gap(data, claim.scope)
    raise CurvlabError(f"no data rule for primary claim {claim.name!r}")
