"""The per-seed values each primary claim (:data:`curvlab.studies.paper.PRIMARY`) is judged on: for every seed,
the aggregate of its units (the mean over its matched levels, the median of its paired points' ratios, or its
trajectory), numerator and denominator apart for a ratio, with the notes on what was left out
(:func:`claim_inputs`; :mod:`curvlab.studies.primary` infers across the seeds)."""

from __future__ import annotations

from dataclasses import dataclass, field

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


def _own(arm: str, quantity: str, scope: str) -> str:
    """The paired-direction key of an arm's own step (``paired_cos_adamw_hidden`` on AdamW's side)."""
    return f"paired_{quantity}_{arm}_{scope}"


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
    seeds, num, den, units, raw = [], [], [], [], []
    for r in usable:
        xs, ys = [], []
        ka, kb = (key_of(arm) for arm in r.name.split("/"))
        for lv in r.comparison.headline_levels:
            a, b = r.comparison.sides(lv)
            ma, mb = a.mean, b.mean  # (a property that averages every key)
            if ka not in ma or kb not in mb:
                return f"no {ka if ka not in ma else kb} in the matched windows (older runs)"
            xs.append(ma[ka])
            ys.append(mb[kb])
        seeds.append(r.seed)
        num.append(float(np.mean(xs)))
        den.append(float(np.mean(ys)))
        units.append(len(xs))
        raw += xs + ys
    notes = [n for n in [_sign_note(raw, "window means")] if n]
    return SeedValues(seeds, num, den, units, notes)


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
    usable = with_levels_off_plateau(records)
    if not usable:
        return "no matched comparison with a level off the unigram plateau"
    ka, km = f"paired_nds_adamw_{scope}", f"paired_nds_muon_{scope}"
    seeds, num, units, xs_all, ys_all, dropped = [], [], [], [], [], []
    agree = undefined = 0
    for r in usable:
        points = analysed_points(r, data)
        sides = [side for lv in r.comparison.headline_levels for side in (lv.a, lv.b)]
        windows = {(side.optimizer, m.step) for side in sides for m in side.members}
        if any(ka not in points[k].paired or km not in points[k].paired for k in windows):
            return f"no {ka} / {km} in the matched windows (older runs)"
        # a trajectory analysed without shadows adds nothing
        points = {k: p for k, p in points.items() if ka in p.paired and km in p.paired}
        xs = [p.paired[ka] for p in points.values()]
        ys = [p.paired[km] for p in points.values()]
        ratios = [x / y for x, y in zip(xs, ys) if y != 0]
        undefined += len(xs) - len(ratios)
        if not ratios:
            dropped.append(r.seed)
            continue
        agree += sum((x > 0) == (y > 0) for x, y in zip(xs, ys))
        seeds.append(r.seed)
        num.append(float(np.median(ratios)))
        units.append(len(ratios))
        xs_all += xs
        ys_all += ys
    if not seeds:
        return f"no point with a nonzero {km}"
    both_negative = sum(x < 0 and y < 0 for x, y in zip(xs_all, ys_all))
    unsigned = "where a positive ratio does not mean AdamW's direction is the sharper"
    notes = [
        _sign_note(xs_all, "points along AdamW's direction have NDS", "the per-seed medians of the ratios"),
        _sign_note(ys_all, "along Muon's", "the medians"),
        f"both directions take the same sign at {agree} of {len(xs_all)} points",
        f"{both_negative} of them with both NDS < 0, {unsigned}" if both_negative else "",
        f"{undefined} points with Muon's NDS exactly 0 have no ratio" if undefined else "",
        f"seeds {dropped}: Muon's NDS is 0 at every point, left out" if dropped else "",
    ]
    return SeedValues(seeds, num, [1.0] * len(num), units, [n for n in notes if n])


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
    if claim.name == "between_nds_ratio":
        return _between(records, lambda arm: scope_key("nds", claim.scope))
    if claim.name == "alignment_ratio":
        return _between(records, lambda arm: _own(arm, "cos", claim.scope))
    if claim.name == "zipf_gap_change":
        return _zipf_gap(data, claim.scope)
    if claim.name == "rho_within_change_gap":
        return _rho_gap(data, claim.scope)
    raise CurvlabError(f"no data rule for primary claim {claim.name!r}")
