r"""The paper's observations 3 and 4 **by thirds of training at matched loss** (issue 51, the ``long`` design):
each value of the grammar's imbalance s measured as its own reproduction (a
:class:`~curvlab.studies.records.LevelData`), each seed's matched levels off the unigram plateau split into
an early, a middle and a late third.

**Thirds** (:func:`thirds`, :func:`levels_in_third`). A comparison's levels off the plateau
(:attr:`~curvlab.studies.compare.Comparison.headline_levels`), ordered by training progress, i.e. by target
loss descending, are split as ``numpy.array_split`` into 3 (6 levels: 2, 2, 2; 4: 2, 1, 1; 2: 1, 1, 0). A
third keeps only its levels in the comparison's ``levels`` (the plateau's are in none), so everything that
reads ``headline_levels`` downstream (:mod:`curvlab.studies.seed_values`, :func:`curvlab.studies.primary.estimated`)
sees that third alone.

**Primary claims by third** (:data:`QUANTITIES`): the paired NDS ratio, the direction-efficiency ratio q and the
between-run NDS ratio (hidden matrices and all parameters), each estimated per seed on the third by
:func:`~curvlab.studies.primary.estimated`, descriptive.

**Observation 3** (the AdamW − Muon NDS gap widens x1.8 from s = 0 to s = 1). Per seed i, third T and scope,
the between-run gap at s is

.. math::
    g_i(s) = \frac{1}{|T_i|} \sum_{\ell \in T_i}
    \big(\mathrm{NDS}^{\text{AdamW}}_\ell - \mathrm{NDS}^{\text{Muon}}_\ell\big),

window means at each matched level :math:`\ell`; its change is :math:`E\,g(s_1) / E\,g(s_0)`, seeds paired by
id, by :func:`~curvlab.inference.statistics.ratio_inference` (log-t when every :math:`g_i(s_0)` has one sign and
every :math:`g_i(s_1)/g_i(s_0) > 0`, else Fieller, else the difference :math:`g(s_1) - g(s_0)`, which it says).
Likewise the paired NDS ratio's and q's change: per seed its value at :math:`s_1` over its value at :math:`s_0`.
:math:`s_0` and :math:`s_1` are the smallest and the largest s given.

**Observation 4** (within-layer curvature increasingly dominant in Muon's advantage). Per seed, arm and third

.. math:: \rho_{\text{within}} = \sum_{\ell \in T} \mathrm{within}_\ell \Big/ \sum_{\ell \in T} \mathrm{NDS}_\ell

(:data:`RHO_KEYS`: ``within`` / ``nds`` over all parameters, ``within_layers`` / ``nds_layers`` on the hidden
scope), then per seed Muon's rise minus AdamW's, :math:`(\rho^M_k - \rho^M_0) - (\rho^A_k - \rho^A_0)` from the
early third (0) to the middle (k = 1) and to the late (k = 2), a t interval across seeds
(:func:`~curvlab.inference.statistics.mean_inference`). Judged, registered before the ``long`` runs: the two rises
at s = 0 over all parameters (:data:`JUDGED`), greater than 0, Holm over those two; everything else descriptive.

Nothing is dropped silently: each estimate's ``note`` counts the seeds left out and why, the levels in its third,
and the seeds whose third has no level.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from curvlab.curvature.scalars import scope_key
from curvlab.errors import CurvlabError
from curvlab.inference import statistics
from curvlab.studies.compare import Level
from curvlab.studies.paper import PRIMARY
from curvlab.studies.primary import PrimaryEntry, estimated
from curvlab.studies.records import PRIMARY_COMPARISON, ComparisonRecord, LevelData
from curvlab.util.codec import Record

THIRDS = ("early", "middle", "late")
RISES = ("early->middle", "early->late")  # the rises of rho_within, from the early third to thirds 1 and 2
SCOPES = ("hidden", "all")
_CLAIM = {c.name: c for c in PRIMARY}
# the primary claims estimated per third (q is Muon over AdamW, the others AdamW over Muon)
QUANTITIES = {
    "paired_direction_ratio": _CLAIM["paired_direction_ratio"],
    "direction_efficiency_ratio": _CLAIM["direction_efficiency_ratio"],
    "between_nds_ratio": _CLAIM["between_nds_ratio"],
    "between_nds_ratio_all": replace(_CLAIM["between_nds_ratio"], scope="all"),
}
CHANGES = ("paired_direction_ratio", "direction_efficiency_ratio")  # their change from s0 to s1, per third
RHO_KEYS = {"all": ("within", "nds"), "hidden": ("within_layers", "nds_layers")}  # as _rho_gap reads them
# registered before the long design's runs (issue 51): the rises judged, at which s and in which scope
JUDGED = {
    "quantity": "rho_within_rise_gap",
    "s": 0.0,
    "scope": "all",
    "direction": "greater",
    "null": 0.0,
    "registered": "before",
}
DESCRIPTIVE_NOTE = "descriptive: no verdict, outside Holm"


@dataclass(frozen=True)
class ThirdEstimate(Record):
    """One quantity in one third (module docstring): at one ``s``, or its change between two (``s`` None).

    ``third``: ``"early"``, ``"middle"``, ``"late"``, or a rise ``"early->middle"`` / ``"early->late"``;
    ``value`` None: not measured (``note`` says why); ``method``: ``"log-t"``, ``"fieller"``,
    ``"difference-t"`` (a ratio whose denominator's sign is not settled, judged as a difference: ``note``
    says so) or ``"t"``; ``per_seed``: each seed's inputs and value; ``judged``: registered in :data:`JUDGED`,
    with its ``verdict`` (:func:`~curvlab.inference.statistics.direction_verdict`) and ``p_holm`` (Holm over the
    judged rises); ``p`` the unadjusted two-sided p (None where no test is meant); ``n_units`` the matched levels
    (or, for the paired claims, the points) read."""

    quantity: str
    scope: str
    s: float | None
    third: str
    value: float | None
    ci95: list[float] | None
    n_seeds: int
    method: str
    per_seed: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""
    judged: bool = False
    verdict: str | None = None
    p: float | None = None
    p_holm: float | None = None
    n_units: int = 0


def split_levels(levels: list[Level]) -> list[list[Level]]:
    """The levels off the unigram plateau, by target loss descending (training progress), split as
    ``numpy.array_split`` into the early, middle and late third.

    Args:
        levels: a comparison's matched levels (any order; those on the plateau are left out).

    Returns:
        Three lists of levels, the first the earliest (highest loss); a third may be empty.
    """
    off = sorted((lv for lv in levels if not lv.on_plateau), key=lambda lv: -lv.target)
    return [[off[i] for i in part] for part in np.array_split(np.arange(len(off)), len(THIRDS))]


def thirds(record: ComparisonRecord) -> list[ComparisonRecord]:
    """Three copies of ``record``, each whose comparison keeps only the matched levels of one third
    (:func:`split_levels`; levels on the plateau are in none).

    Args:
        record: one seed's matched comparison (with or without a comparison).

    Returns:
        The early, middle and late copies (a record without a comparison: three copies of it).
    """
    if record.comparison is None:
        return [replace(record) for _ in THIRDS]
    parts = split_levels(record.comparison.levels)
    return [replace(record, comparison=replace(record.comparison, levels=part)) for part in parts]


def _third_index(k: int) -> int:
    if not (isinstance(k, int) and 0 <= k < len(THIRDS)):
        raise CurvlabError(f"a third is 0 (early), 1 (middle) or 2 (late), got {k!r}")
    return k


def levels_in_third(data: LevelData, k: int) -> LevelData:
    """``data`` with every matched comparison restricted to third ``k`` (:func:`thirds`), the trajectories dropped:
    the paired claims pool a seed's tracked checkpoints with its matched windows
    (:func:`~curvlab.studies.records.analysed_points`), and a trajectory spans all of training.

    Args:
        data: one reproduction's levels.
        k: 0 (early), 1 (middle) or 2 (late).

    Returns:
        A :class:`LevelData` with the same comparisons (each with the third's levels only) and no tracks.

    Raises:
        CurvlabError: ``k`` not 0, 1 or 2.
    """
    k = _third_index(k)
    return LevelData([thirds(r)[k] for r in data.comparisons], [], data.plateau_ceiling, list(data.s_values))


def _at_s(data: LevelData, s: float) -> tuple[LevelData, list[str]]:
    """``data``'s comparisons at ``s`` (the reproduction of that s), and a note on those at another s, left out."""
    other = [r for r in data.comparisons if not np.isclose(r.s, s)]
    notes = [f"{len(other)} comparison(s) at another s than {s:g} left out"] if other else []
    kept = [r for r in data.comparisons if np.isclose(r.s, s)]
    return LevelData(kept, list(data.tracks), data.plateau_ceiling, list(data.s_values)), notes


def _coverage(data: LevelData, k: int) -> list[str]:
    """What third ``k`` of ``data``'s AdamW/Muon comparisons holds: levels per seed, the seeds with no comparison
    or no level in it, and the plateau's levels (in no third)."""
    records = data.matched(PRIMARY_COMPARISON)
    missing = [r.seed for r in records if r.comparison is None]
    sizes = {r.seed: len(split_levels(r.comparison.levels)[k]) for r in records if r.comparison is not None}
    plateau = sum(lv.on_plateau for r in records if r.comparison is not None for lv in r.comparison.levels)
    notes = [f"{THIRDS[k]} third: {sum(sizes.values())} level(s) over {len(sizes)} seed(s)"]
    if missing:
        notes.append(f"seeds {missing}: no matched comparison, left out")
    if empty := [seed for seed, n in sizes.items() if n == 0]:
        notes.append(f"seeds {empty}: no level in the {THIRDS[k]} third, left out")
    if plateau:
        notes.append(f"{plateau} level(s) on the unigram plateau in no third")
    return notes


def _unmeasured(quantity: str, scope: str, s: float | None, third: str, why: str, judged=False) -> ThirdEstimate:
    verdict = statistics.NOT_MEASURED if judged else None
    return ThirdEstimate(quantity, scope, s, third, None, None, 0, "", [], f"not measured: {why}", judged, verdict)


def _from_inference(
    quantity: str, scope: str, s: float | None, third: str, inf: statistics.SeedInference, per_seed, notes, **kw
) -> ThirdEstimate:
    """An estimate from an inference across seeds: per-seed rows get the inference's per-seed value."""
    rows = [row | {"value": v} for row, v in zip(per_seed, inf.per_seed)]
    ci = None if inf.ci95 is None else list(inf.ci95)
    note = "; ".join(n for n in [inf.note, *notes] if n)
    units = sum(int(r.get("units", 0)) for r in per_seed)
    kw.setdefault("p", inf.p)  # (None where no test is meant: a share's mean)
    return ThirdEstimate(
        quantity, scope, s, third, inf.value, ci, inf.n_seeds, inf.method, rows, note, **kw, n_units=units
    )


def _from_entry(quantity: str, e: PrimaryEntry, s: float, third: str, notes: list[str]) -> ThirdEstimate:
    note = "; ".join(n for n in [e.note, *notes] if n)
    fields = dict(value=e.value, ci95=e.ci95, n_seeds=e.n_seeds, method=e.method, per_seed=list(e.per_seed))
    return ThirdEstimate(quantity, e.scope, s, third, **fields, note=note, p=e.p, n_units=e.n_units)


def primary_by_third(data: LevelData, s: float) -> dict[tuple[str, int], PrimaryEntry]:
    """The :data:`QUANTITIES` estimated per seed on each third of ``data`` (descriptive
    :class:`~curvlab.studies.primary.PrimaryEntry`, by :func:`~curvlab.studies.primary.estimated`).

    Args:
        data: the reproduction at ``s`` (its comparisons at another s are left out).
        s: its imbalance.

    Returns:
        ``{(quantity, third index): entry}``.
    """
    at, _ = _at_s(data, s)
    out = {}
    for k in range(len(THIRDS)):
        entries = estimated(levels_in_third(at, k), tuple(QUANTITIES.values()))
        out |= {(name, k): e for name, e in zip(QUANTITIES, entries)}
    return out


def _per_seed_levels(
    data: LevelData, k: int, value: Callable[[dict, dict], Any]
) -> tuple[dict[int, list[Any]], list[str]]:
    """Per seed, ``value(AdamW's window means, Muon's)`` at each of its levels in third ``k``; the levels where it
    is not finite (a scalar an older file lacks reads as NaN) are left out and counted."""
    out, skipped = {}, []
    for r in data.matched(PRIMARY_COMPARISON):
        if r.comparison is None:
            continue
        values = []
        for lv in split_levels(r.comparison.levels)[k]:
            a, m = r.comparison.sides(lv)
            x = value(a.mean, m.mean)  # (each mean a property that averages every key: read once)
            if np.all(np.isfinite(x)):
                values.append(x)
            else:
                skipped.append(f"seed {r.seed} at {lv.target:.4g}")
        if values:
            out[r.seed] = values
    notes = [f"{len(skipped)} level(s) with a value not finite left out ({'; '.join(skipped[:3])})"] if skipped else []
    return out, notes


def _gaps(data: LevelData, k: int, scope: str) -> tuple[dict[int, tuple[float, int]], list[str]]:
    """Per seed, the mean over its levels in third ``k`` of AdamW's NDS minus Muon's, and its number of levels."""
    key = scope_key("nds", scope)
    levels, notes = _per_seed_levels(data, k, lambda a, m: a[key] - m[key])
    return {seed: (float(np.mean(v)), len(v)) for seed, v in levels.items()}, notes


def _paired_by_seed(lo: dict[int, Any], hi: dict[int, Any], s0: float, s1: float) -> tuple[list[int], list[str]]:
    """The seeds at both s, and a note on those at one only (left out)."""
    common = sorted(set(lo) & set(hi))
    notes = [f"seeds {sorted(set(x) - set(common))}: only at s = {s:g}, left out" for x, s in ((lo, s0), (hi, s1))]
    return common, [n for n, x in zip(notes, (lo, hi)) if set(x) - set(common)]


def _gap_estimates(at: dict[float, LevelData], notes: dict[tuple[float, int], list[str]], k: int, scope: str):
    """Observation 3 in third ``k`` and ``scope``: the gap at each s (descriptive means) and its change s0 -> s1."""
    s_values = sorted(at)
    gaps = {}
    out = []
    for s in s_values:
        gaps[s], extra = _gaps(at[s], k, scope)
        if not gaps[s]:
            out.append(_unmeasured("nds_gap", scope, s, THIRDS[k], "no seed with a level in this third"))
            continue
        seeds = sorted(gaps[s])
        inf = statistics.mean_inference([gaps[s][i][0] for i in seeds], 0.0)
        rows = [{"seed": i, "units": gaps[s][i][1]} for i in seeds]
        what = [*extra, *notes[(s, k)], DESCRIPTIVE_NOTE]
        out.append(_from_inference("nds_gap", scope, s, THIRDS[k], inf, rows, what))
    if len(s_values) < 2:
        return [*out, _unmeasured("nds_gap_ratio", scope, None, THIRDS[k], "one value of s only")]
    s0, s1 = s_values[0], s_values[-1]
    common, left = _paired_by_seed(gaps[s0], gaps[s1], s0, s1)
    if not common:
        why = f"no seed at both s = {s0:g} and {s1:g}"
        return [*out, _unmeasured("nds_gap_ratio", scope, None, THIRDS[k], why)]
    num, den = [gaps[s1][i][0] for i in common], [gaps[s0][i][0] for i in common]
    inf = statistics.ratio_inference(numerator=num, denominator=den)
    rows = [
        {"seed": i, "numerator": a, "denominator": b, "units": gaps[s0][i][1] + gaps[s1][i][1]}
        for i, a, b in zip(common, num, den)
    ]
    what = f"gap at s = {s1:g} over gap at s = {s0:g}, seeds paired by id"
    out.append(_from_inference("nds_gap_ratio", scope, None, THIRDS[k], inf, rows, [what, *left, DESCRIPTIVE_NOTE]))
    return out


def _ratio_of(e: PrimaryEntry) -> dict[int, float]:
    """Per seed, a primary entry's ratio numerator / denominator (its per-seed median for the paired claims)."""
    out = {}
    for row in e.per_seed:
        den = row.get("denominator", 1.0)
        out[row["seed"]] = row["numerator"] / den if den else float("nan")
    return out


def _change_estimates(entries: dict[float, dict], k: int) -> list[ThirdEstimate]:
    """The paired NDS ratio's and q's change from s0 to s1 in third ``k``: per seed its value at s1 over at s0."""
    s_values = sorted(entries)
    out = []
    for name in CHANGES:
        scope, quantity = QUANTITIES[name].scope, f"{name}_change"
        if len(s_values) < 2:
            out.append(_unmeasured(quantity, scope, None, THIRDS[k], "one value of s only"))
            continue
        s0, s1 = s_values[0], s_values[-1]
        lo, hi = (entries[s][(name, k)] for s in (s0, s1))
        if lo.value is None or hi.value is None:
            why = f"{name} not measured at s = {s0 if lo.value is None else s1:g}"
            out.append(_unmeasured(quantity, scope, None, THIRDS[k], why))
            continue
        a, b = _ratio_of(hi), _ratio_of(lo)
        common, left = _paired_by_seed(b, a, s0, s1)
        finite = [i for i in common if np.isfinite(a[i]) and np.isfinite(b[i])]
        if len(finite) < len(common):
            left.append(f"seeds {sorted(set(common) - set(finite))}: a ratio not finite, left out")
        if not finite:
            out.append(_unmeasured(quantity, scope, None, THIRDS[k], "; ".join(left) or "no seed at both s"))
            continue
        inf = statistics.ratio_inference(numerator=[a[i] for i in finite], denominator=[b[i] for i in finite])
        units = {s: {row["seed"]: row.get("units", 0) for row in e.per_seed} for s, e in ((s0, lo), (s1, hi))}
        rows = [
            {"seed": i, "numerator": a[i], "denominator": b[i], "units": units[s0][i] + units[s1][i]} for i in finite
        ]
        what = f"per seed its value at s = {s1:g} over at s = {s0:g}, seeds paired by id"
        out.append(_from_inference(quantity, scope, None, THIRDS[k], inf, rows, [what, *left, DESCRIPTIVE_NOTE]))
    return out


def rho_within(data: LevelData, k: int, scope: str) -> tuple[dict[int, dict[str, float]], list[str]]:
    """Per seed, each arm's rho_within over third ``k``: the sum over the third's levels of the within-layer part
    of its window means over the sum of its NDS (:data:`RHO_KEYS`).

    Args:
        data: one reproduction's levels (its ``"adamw/muon"`` comparisons are read).
        k: 0 (early), 1 (middle) or 2 (late).
        scope: ``"all"`` or ``"hidden"``.

    Returns:
        ``{seed: {"adamw": rho, "muon": rho, "units": levels}}`` for the seeds with a level in the third and both
        rhos finite, and notes on the others (a level with a value not finite is left out, counted).

    Raises:
        CurvlabError: ``k`` not 0, 1 or 2.
    """
    within, total = RHO_KEYS[scope]
    parts, notes = _per_seed_levels(
        data, _third_index(k), lambda a, m: np.array([[a[within], a[total]], [m[within], m[total]]])
    )
    out, bad = {}, []
    for seed, levels in parts.items():
        sums = np.sum(levels, axis=0)  # rows: AdamW, Muon; columns: within, NDS
        if not np.all(sums[:, 1] != 0):
            bad.append(seed)
            continue
        out[seed] = {
            "adamw": float(sums[0, 0] / sums[0, 1]),
            "muon": float(sums[1, 0] / sums[1, 1]),
            "units": len(levels),
        }
    if bad:
        notes.append(f"seeds {bad}: an arm's NDS sums to 0 over the third, left out")
    return out, notes


def _rho_estimates(data: LevelData, s: float, scope: str, notes: dict[tuple[float, int], list[str]]):
    """Observation 4 at ``s`` in ``scope``: each arm's rho_within per third (descriptive), and the two rises of
    Muon's minus AdamW's (judged where :data:`JUDGED` says; Holm comes after, in :func:`_judge`)."""
    rhos = [rho_within(data, k, scope) for k in range(len(THIRDS))]
    out = []
    for k, (rho, extra) in enumerate(rhos):
        for arm in ("adamw", "muon"):
            if not rho:
                out.append(_unmeasured(f"rho_within_{arm}", scope, s, THIRDS[k], "no seed with a level in this third"))
                continue
            inf = statistics.mean_inference([rho[i][arm] for i in sorted(rho)])
            rows = [{"seed": i, "units": rho[i]["units"]} for i in sorted(rho)]
            what = [*extra, *notes[(s, k)], DESCRIPTIVE_NOTE]
            out.append(_from_inference(f"rho_within_{arm}", scope, s, THIRDS[k], inf, rows, what, p=None))
    judged = bool(np.isclose(s, JUDGED["s"])) and scope == JUDGED["scope"]
    for k, label in zip((1, 2), RISES):
        (early, _), (later, _) = rhos[0], rhos[k]
        seeds = sorted(set(early) & set(later))
        left = sorted((set(early) | set(later)) - set(seeds))
        why = [f"seeds {left}: no rho in one of the two thirds, left out"] if left else []
        why += [*rhos[0][1], *rhos[k][1], *notes[(s, 0)], *notes[(s, k)]]
        if not seeds:
            out.append(_unmeasured(JUDGED["quantity"], scope, s, label, "; ".join(why) or "no seed", judged))
            continue
        rise = {arm: [later[i][arm] - early[i][arm] for i in seeds] for arm in ("adamw", "muon")}
        values = [m - a for m, a in zip(rise["muon"], rise["adamw"])]
        inf = statistics.mean_inference(values, JUDGED["null"])
        rows = [
            {"seed": i, "muon_rise": mu, "adamw_rise": ad, "units": early[i]["units"] + later[i]["units"]}
            for i, mu, ad in zip(seeds, rise["muon"], rise["adamw"])
        ]
        why.append("pre-registered: greater than 0, Holm over the two rises" if judged else DESCRIPTIVE_NOTE)
        out.append(_from_inference(JUDGED["quantity"], scope, s, label, inf, rows, why, judged=judged))
    return out


def _judge(estimates: list[ThirdEstimate]) -> list[ThirdEstimate]:
    """Holm over the judged estimates with a test (3 seeds or more), then each judged one's direction verdict."""
    judged = [i for i, e in enumerate(estimates) if e.judged and e.value is not None]
    tested = [i for i in judged if estimates[i].p is not None and estimates[i].n_seeds >= statistics.MIN_SEEDS]
    adjusted = dict(zip(tested, statistics.holm([estimates[i].p for i in tested])))
    out = list(estimates)
    for i in judged:
        e = estimates[i]
        ci = None if e.ci95 is None else tuple(e.ci95)
        inf = statistics.SeedInference("difference", e.method, e.value, ci, e.p, JUDGED["null"], e.n_seeds, ())
        verdict = statistics.direction_verdict(JUDGED["direction"], inf, adjusted.get(i))
        out[i] = replace(e, p_holm=adjusted.get(i), verdict=verdict)
    return out


def by_thirds(levels: dict[float, LevelData]) -> list[ThirdEstimate]:
    """Observations 3 and 4 by thirds of training at matched loss (module docstring), from one reproduction per s.

    Args:
        levels: ``{s: that reproduction's levels}`` (in each, the comparisons at another s are left out, counted).

    Returns:
        In order: per s and third the :data:`QUANTITIES` (``quantity`` the claim's name, ``between_nds_ratio_all``
        for the all-parameter between-run ratio); per third and scope the gap ``nds_gap`` at each s and its change
        ``nds_gap_ratio`` (``s`` None); per third the ``*_change`` of :data:`CHANGES`; per s and scope each arm's
        ``rho_within_adamw`` / ``rho_within_muon`` per third and ``rho_within_rise_gap`` per rise, the
        :data:`JUDGED` ones with their verdicts.

    Raises:
        CurvlabError: no s.
    """
    if not levels:
        raise CurvlabError("no reproduction to read thirds from")
    at, notes = {}, {}
    for s in sorted(levels):
        at[s], other = _at_s(levels[s], s)
        for k in range(len(THIRDS)):
            notes[(s, k)] = [*other, *_coverage(at[s], k)]
    entries = {s: primary_by_third(at[s], s) for s in at}
    out = [
        _from_entry(name, entries[s][(name, k)], s, THIRDS[k], notes[(s, k)])
        for s in at
        for k in range(len(THIRDS))
        for name in QUANTITIES
    ]
    for k in range(len(THIRDS)):
        for scope in SCOPES:
            out += _gap_estimates(at, notes, k, scope)
        out += _change_estimates(entries, k)
    for s in at:
        for scope in SCOPES:
            out += _rho_estimates(at[s], s, scope, notes)
    return _judge(out)
