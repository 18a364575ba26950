"""The pre-registered **primary family** (:func:`primary_family`, a list of :class:`PrimaryEntry`, one per
:data:`curvlab.studies.paper.PRIMARY` claim), derived from a :class:`curvlab.studies.records.LevelData`::

    name, scope, quantity, statement, claimed, kind, method, value, ci95, n_seeds, n_units, paper,
    paper_text, direction, magnitude, p, p_holm, per_seed [{seed, ...}], note, p_exact, p_exact_min,
    exact_test, exact_backed

Per seed, each claim aggregates that seed's units (the mean over its matched levels, the median of its
paired points' ratios, or its trajectory), then infers across seeds
(:func:`curvlab.inference.statistics.ratio_inference` or :func:`curvlab.inference.statistics.mean_inference`);
Holm's correction runs over the claims that got a test (3 seeds or more, and judged by the design); beside
the t model, each claim's exact sign-flip test (:mod:`curvlab.inference.exact_tests`), Holm-adjusted alike. And
the **A/A calibration** (:func:`calibration`, a :class:`Calibration`)::

    false_verdict_rate, n_tests, per_test [{comparison, claim, n_seeds, value, ci95, p, p_holm, p_exact,
    direction, false, power}], pairs, claims, power {x1.5, x2}, kind

from same-arm comparisons (``"adamw/adamw"``, ``"muon/muon"``: two disjoint seeds of one arm per
record), put through the same pipeline for the claims that compare the two sides of a comparison
(docs/science.md section 12).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from curvlab.curvature.scalars import scope_key
from curvlab.errors import CurvlabError
from curvlab.inference import exact_tests as exact
from curvlab.inference import statistics as st
from curvlab.inference.exact_tests import floor_text
from curvlab.studies.controls import NULL_BAND, hp_twin_medians
from curvlab.studies.paper import PRIMARY, PrimaryClaim, judged_claims
from curvlab.studies.records import (
    PRIMARY_COMPARISON,
    ComparisonRecord,
    LevelData,
    TrackRecord,
    analysed_points,
    with_levels_off_plateau,
)
from curvlab.util.codec import Record


@dataclass(frozen=True)
class PrimaryEntry(Record):
    """One claim of the primary family, judged (module docstring; :mod:`curvlab.inference.statistics`).

    ``direction``: supported / contradicted / inconclusive, ``"descriptive: fewer than 3 seeds"`` or
    ``"not measured"``; ``magnitude``: consistent / larger / smaller / uninformative against ``paper``
    (``None`` without a paper number); ``p`` the unadjusted two-sided p-value, ``p_holm`` Holm's over
    the family (``None`` when not tested); ``kind`` what was judged (``"ratio"``, or ``"difference"``,
    also when a ratio's denominator had no settled sign: then ``note`` says so)."""

    name: str
    scope: str
    quantity: str
    statement: str
    claimed: str  # e.g. "greater than 1"
    kind: str
    method: str
    value: float | None
    ci95: list[float] | None
    n_seeds: int
    n_units: int
    paper: float | None
    paper_text: str
    direction: str
    magnitude: str | None
    p: float | None
    p_holm: float | None
    per_seed: list[dict[str, Any]] = field(default_factory=list)
    note: str = ""
    # the exact seed-level test beside the t model (curvlab.inference.exact_tests): its p (one-sided for a
    # greater/less claim), the smallest p this many seeds can give, and whether the exact test, Holm-adjusted
    # over the same family, backs the verdict (None: no verdict to back)
    p_exact: float | None = None
    p_exact_min: float | None = None
    exact_test: str = ""
    exact_backed: bool | None = None
    # the exact p that backs the verdict: the opposite side for a contradicted greater/less claim, the
    # larger of two one-sided tests against the band for a supported "about" claim, else p_exact
    p_exact_verdict: float | None = None

    @property
    def verdict_text(self) -> str:
        """The direction verdict, with what the exact test says where it cannot back it: e.g.
        ``"supported (t model; the exact floor is 1/32)"``."""
        if self.exact_backed is not False:
            return self.direction
        p = self.p_exact_verdict
        if self.p_exact_min is not None and p is not None and p <= self.p_exact_min:
            return f"{self.direction} (t model; the exact floor is {floor_text(self.p_exact_min)})"
        return f"{self.direction} (t model; exact p = {p:.3g})"


@dataclass(frozen=True)
class Calibration(Record):
    """The A/A calibration (:func:`calibration`): the share of same-arm tests whose direction verdict
    asserted a difference (NaN when there were no tests), over ``n_tests`` tests with 3 seeds or more;
    each test with its estimate, interval and p-values (``per_test``); the seed ``pairs`` of the
    between-run tests, the ``claims`` covered, the ``power`` to flag a same-arm bias of x1.5 and x2 (by
    simulation on the run's own spreads: :func:`curvlab.inference.exact_tests.aa_power`, the mean over the
    tests), and what it is (``kind``: a smoke test when its pairs share seeds or it has fewer than
    :data:`MIN_CALIBRATION_TESTS` tests, too few to estimate a 5% rate)."""

    false_verdict_rate: float = float("nan")
    n_tests: int = 0
    per_test: list[dict[str, Any]] = field(default_factory=list)
    pairs: list[list[int]] = field(default_factory=list)
    claims: list[str] = field(default_factory=list)
    power: dict[str, float | None] = field(default_factory=lambda: dict.fromkeys(POWER_LABELS))
    kind: str = "smoke test"


MIN_CALIBRATION_TESTS = 10
POWER_LABELS = tuple(f"x{f:g}" for f in exact.AA_FACTORS)  # "x1.5", "x2"


# -- the primary family -------------------------------------------------------------------------


@dataclass(frozen=True)
class _SeedValues:
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


def _between(records: list[ComparisonRecord], key_of) -> _SeedValues | str:
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
    return _SeedValues(seeds, num, den, units, notes)


def _paired(records: list[ComparisonRecord], data: LevelData, scope: str) -> _SeedValues | str:
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
        windows = {(side.optimizer, m.step) for lv in r.comparison.headline_levels for side in (lv.a, lv.b)
                   for m in side.members}  # fmt: skip
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
    notes = [
        n
        for n in (
            _sign_note(xs_all, "points along AdamW's direction have NDS", "the per-seed medians of the ratios"),
            _sign_note(ys_all, "along Muon's", "the medians"),
            f"both directions take the same sign at {agree} of {len(xs_all)} points",
            f"{both_negative} of them with both NDS < 0, where a positive ratio does not mean AdamW's direction "
            "is the sharper"
            if both_negative
            else "",
            f"{undefined} points with Muon's NDS exactly 0 have no ratio" if undefined else "",
            f"seeds {dropped}: Muon's NDS is 0 at every point, left out" if dropped else "",
        )
        if n
    ]
    return _SeedValues(seeds, num, [1.0] * len(num), units, notes)


def _trajectory_mean(t: TrackRecord, key: str) -> float:
    rows = t.after_warmup()
    return float(np.mean([r.value(key) for r in rows])) if rows and all(r.has(key) for r in rows) else float("nan")


def _zipf_gap(data: LevelData, scope: str) -> _SeedValues | str:
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
    return _SeedValues(seeds, values, None, units, notes)


def _rho_gap(data: LevelData, scope: str) -> _SeedValues | str:
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
    return _SeedValues(seeds, values, None, units, notes)


def _claim_inputs(claim: PrimaryClaim, data: LevelData, records: list[ComparisonRecord]) -> _SeedValues | str:
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


def _claimed(claim: PrimaryClaim) -> str:
    if claim.direction == "about":
        lo, hi = claim.band
        return f"about {claim.null:g} (within [{lo:g}, {hi:g}])"
    return f"{claim.direction} than {claim.null:g}"


def _infer(claim: PrimaryClaim, values: _SeedValues, confidence: float) -> st.SeedInference:
    if values.denominator is None:
        return st.mean_inference(values.numerator, claim.null, confidence)
    return st.ratio_inference(values.numerator, values.denominator, claim.null, confidence)


@dataclass(frozen=True)
class _Exact:
    """A claim's exact seed-level test (:mod:`curvlab.inference.exact_tests`): the p in the claimed direction, the
    p that would back the verdict (the opposite side for a contradicted greater/less claim; two one-sided
    tests against the band for a supported "about" claim), and the design's floor."""

    p: float
    p_for_verdict: float | None
    floor: float
    test: str


def _exact_values(claim: PrimaryClaim, values: _SeedValues, inf: st.SeedInference) -> tuple[np.ndarray, float]:
    """The per-seed values the exact test flips, and their null: log ratios against log null (log-t), the
    linear contrast a - null b against 0 (Fieller, or a fallen-back difference), or the values themselves."""
    if inf.method == st.LOG_T:
        return np.log(np.asarray(inf.per_seed)), float(np.log(claim.null))
    if values.denominator is not None:
        # a - null b has the sign of a/b - null times that of b: negative denominators flip the side
        b = np.asarray(values.denominator)
        sign = -1.0 if np.all(b < 0) else 1.0
        return sign * (np.asarray(values.numerator) - claim.null * b), 0.0
    return np.asarray(values.numerator), claim.null


def _exact(claim: PrimaryClaim, values: _SeedValues, inf: st.SeedInference, direction: str) -> _Exact | None:
    """The claim's exact test, or ``None`` with more seeds than it enumerates."""
    x, null = _exact_values(claim, values, inf)
    if x.size > exact.MAX_SIGN_FLIP_N:
        return None
    n = x.size
    test = "sign flips of the per-seed values" + (
        " (AdamW's and Muon's labels swapped within each seed's pair)" if claim.between_runs else ""
    )
    if claim.direction == "about":
        p = exact.sign_flip_p(x, null, "two-sided")
        backing = p
        if direction == st.SUPPORTED:  # equivalence: two one-sided tests against the band's edges
            if claim.band is None or inf.method != st.LOG_T:
                backing = None  # (a Fieller interval inside the band has no exact counterpart here)
            else:
                lo, hi = np.log(claim.band)
                backing = max(exact.sign_flip_p(x, lo, "greater"), exact.sign_flip_p(x, hi, "less"))
        return _Exact(p, backing, exact.sign_flip_floor(n, "two-sided"), test)
    side = claim.direction
    p = exact.sign_flip_p(x, null, side)
    backing = (
        exact.sign_flip_p(x, null, "less" if side == "greater" else "greater") if direction == st.CONTRADICTED else p
    )
    return _Exact(p, backing, exact.sign_flip_floor(n, side), test)


def _judge(
    claims: tuple[PrimaryClaim, ...],
    data: LevelData,
    records: list[ComparisonRecord],
    confidence: float,
    judged: frozenset[str] | None = None,
) -> list[PrimaryEntry]:
    """Every claim's entry: per-seed inference, Holm over the claims tested (3 seeds or more, and named
    in ``judged`` when given: the others are estimated but descriptive, outside the correction), verdicts."""
    inputs = [_claim_inputs(c, data, records) for c in claims]
    inferences = [None if isinstance(v, str) else _infer(c, v, confidence) for c, v in zip(claims, inputs)]
    is_judged = [judged is None or c.name in judged for c in claims]
    tested = [
        i
        for i, inf in enumerate(inferences)
        if is_judged[i] and inf is not None and inf.p is not None and inf.n_seeds >= st.MIN_SEEDS
    ]
    adjusted = dict(zip(tested, st.holm([inferences[i].p for i in tested])))
    directions = {
        i: st.direction_verdict(c.direction, inf, adjusted.get(i), None if inf.method == st.DIFFERENCE_T else c.band)
        for i, (c, inf) in enumerate(zip(claims, inferences)) if inf is not None and is_judged[i]
    }  # fmt: skip
    exacts = {}
    for i, (c, v, inf) in enumerate(zip(claims, inputs, inferences)):
        if inf is not None and inf.n_seeds >= 2 and (ex := _exact(c, v, inf, directions.get(i, st.DESCRIPTIVE))):
            exacts[i] = ex
    # Holm over the exact tests of the same claims, as over the t model's: an "about" claim enters with its
    # two-sided p, and its equivalence stands on its own two one-sided tests at (1 - confidence) / 2 each, as
    # its t-model verdict stands on its interval (outside Holm)
    holm_p = {i: (ex.p if claims[i].direction == "about" else ex.p_for_verdict) for i, ex in exacts.items()}
    exact_holm = dict(zip(tested, st.holm([holm_p[i] for i in tested]) if all(i in exacts for i in tested) else []))
    entries = []
    for i, (claim, values, inf) in enumerate(zip(claims, inputs, inferences)):
        common = dict(
            name=claim.name, scope=claim.scope, quantity=claim.quantity, statement=claim.statement,
            claimed=_claimed(claim), paper=claim.paper, paper_text=claim.paper_text,
        )  # fmt: skip
        if inf is None:
            entries.append(
                PrimaryEntry(
                    **common,
                    kind=claim.kind,
                    method="",
                    value=None,
                    ci95=None,
                    n_seeds=0,
                    n_units=0,
                    direction=st.NOT_MEASURED,
                    magnitude=None,
                    p=None,
                    p_holm=None,
                    note=f"not measured: {values}; needs {claim.data}",
                )
            )
            continue
        p_holm = adjusted.get(i)
        direction = directions.get(i, st.DESCRIPTIVE)  # (a fallen-back difference has no band)
        ex = exacts.get(i)
        backed = None
        if ex is not None and direction in (st.SUPPORTED, st.CONTRADICTED) and i in exact_holm:
            if claim.direction == "about" and direction == st.SUPPORTED:
                backed = None if ex.p_for_verdict is None else ex.p_for_verdict < (1 - confidence) / 2
            else:
                backed = exact_holm[i] < st.ALPHA
        # the paper's number is on the claim's scale: a quantity that fell back to a difference (its
        # denominator's sign not settled) cannot be set beside it
        fell_back = inf.method == st.DIFFERENCE_T
        kind = "difference" if fell_back else claim.kind
        ci = None if inf.ci95 is None else list(inf.ci95)
        if claim.paper is None or not is_judged[i]:
            magnitude = None
        elif fell_back:
            magnitude = st.FEW_SEEDS if inf.n_seeds < st.MIN_SEEDS else st.UNINFORMATIVE
        else:
            magnitude = st.magnitude_verdict(ci, claim.paper, inf.n_seeds)
        notes = ([inf.note] if inf.note else []) + values.notes
        if not is_judged[i]:
            notes.append(f"descriptive in this design: {DESCRIPTIVE_NOTE}")
        if inf.n_seeds < 2:
            notes.append(f"{inf.n_seeds} seed: no interval")
        per_seed = [
            {"seed": seed, "numerator": x, "units": u}
            | ({} if values.denominator is None else {"denominator": values.denominator[k]})
            | {"value": inf.per_seed[k]}
            for k, (seed, x, u) in enumerate(zip(values.seeds, values.numerator, values.units))
        ]
        entries.append(
            PrimaryEntry(
                **common,
                kind=kind,
                method=inf.method,
                value=inf.value,
                ci95=ci,
                n_seeds=inf.n_seeds,
                n_units=sum(values.units),
                direction=direction,
                magnitude=magnitude,
                p=inf.p,
                p_holm=p_holm,
                per_seed=per_seed,
                note="; ".join(notes),
                p_exact=None if ex is None else ex.p,
                p_exact_min=None if ex is None else ex.floor,
                exact_test="" if ex is None else ex.test,
                exact_backed=backed,
                p_exact_verdict=None if ex is None else ex.p_for_verdict,
            )
        )
    return entries


DESCRIPTIVE_NOTE = "the preset judges only its own primary claims (docs/science.md section 12): no verdict, no Holm"


def primary_family(
    data: LevelData, confidence: float = st.CONFIDENCE, judged: tuple[str, ...] | None = None
) -> list[PrimaryEntry]:
    """The primary family (:data:`curvlab.studies.paper.PRIMARY`), judged from the per-level data alone: the
    matched comparisons of AdamW and Muon (``"adamw/muon"``) and the trajectories. A claim whose data
    are missing (e.g. older runs without paired-direction scalars, or one value of s) is an entry marked
    not measured, never a verdict. ``judged`` names the claims a design has the power to judge (a
    preset's ``primary``; None: all): the others keep their estimate and interval, as descriptive
    entries outside Holm's correction."""
    return _judge(PRIMARY, data, data.matched(PRIMARY_COMPARISON), confidence, judged_claims(judged))


def _false(direction: str, claim: PrimaryClaim) -> bool:
    """Whether an A/A verdict asserts a difference between two runs of one arm: any verdict on a
    greater/less claim, and "contradicted" on an about-equal claim ("supported" is right there)."""
    if direction in (st.SUPPORTED, st.CONTRADICTED):
        return not (claim.direction == "about" and direction == st.SUPPORTED)
    return False


def _aa_test(
    comparison: str, claim: PrimaryClaim, e: PrimaryEntry, values, n_family: int, sims: int, false: bool
) -> dict:
    """One A/A test's row: its verdict, estimate, interval and p-values, whether the verdict is false, and
    its power to flag a same-arm bias of x1.5 and x2 on its own spread (the SD of its per-unit log values;
    Bonferroni over its family)."""
    logs = np.log(values) if e.method == st.LOG_T else None
    if logs is None or logs.size < st.MIN_SEEDS:
        power = dict.fromkeys(POWER_LABELS)
    else:
        power = exact.aa_power_table(float(logs.std(ddof=1)), logs.size, st.ALPHA, n_family, sims)
    return {
        "comparison": comparison, "claim": claim.name, "n_seeds": e.n_seeds, "value": e.value, "ci95": e.ci95,
        "p": e.p, "p_holm": e.p_holm, "p_exact": e.p_exact, "p_exact_verdict": e.p_exact_verdict,
        "direction": e.direction,
        "false": false, "power": power,
    }  # fmt: skip


def calibration(
    records: list[ComparisonRecord],
    confidence: float = st.CONFIDENCE,
    *,
    data: LevelData | None = None,
    pairs: list[tuple[int, int]] | None = None,
    sims: int = 4000,
) -> Calibration:
    """The A/A calibration from same-arm comparisons (records named ``"x/x"``, e.g. ``"adamw/adamw"``;
    each record two seeds of one arm, ``pairs``: default each record's seed and the one before, as the
    reproduction's neighbouring pairs). Each same-arm family goes through the primary pipeline for the
    claims comparing the two sides of a comparison (``between_runs``), with Holm over those claims. With
    ``data``, the paired claim's A/A too: each arm's hyperparameter twin (its direction over a twin's with
    one nudged hyperparameter, :func:`curvlab.studies.controls.hp_twin_medians`), per seed, through the
    paired claim's estimator and test, at level 0.05 on its own (the primary family tests it with Holm over
    the preset's judged claims: the A/A is the stricter, by that factor). A test is a claim with 3 or more
    seeds or pairs; the false-verdict
    rate is the share of tests whose direction verdict asserted a difference (:func:`_false`), NaN when
    there is no test. The hyperparameter twin is an approximate null (its nudge is real, if tiny): its
    verdict is false when it asserts a difference and its estimate lies outside the null band
    (:data:`curvlab.studies.controls.NULL_BAND`, ±10%).

    Neighbouring pairs (k - 1, k) share a seed: their log ratios correlate by -0.5, so the t interval over
    records is about 2.2x too wide and a correct pipeline flags far fewer than 5% (docs/science.md section
    12). Disjoint pairs (``aa_pairs="disjoint"``) are independent."""
    names = sorted({r.name for r in records if r.name.split("/")[0] == r.name.split("/")[-1] and "/" in r.name})
    claims = tuple(c for c in PRIMARY if c.between_runs)
    empty = LevelData([], [], None, [0.0])
    per_test = []
    used_pairs: set[tuple[int, int]] = set()
    known = {b: (a, b) for a, b in pairs or []}
    for name in names:
        group = sorted((r for r in records if r.name == name), key=lambda r: r.seed)
        used_pairs |= {known.get(r.seed, (r.seed - 1, r.seed)) for r in group}
        for claim, e in zip(claims, _judge(claims, empty, group, confidence)):
            if e.p_holm is None:
                continue
            values = np.asarray([x["value"] for x in e.per_seed], dtype=float)
            per_test.append(_aa_test(name, claim, e, values, len(claims), sims, _false(e.direction, claim)))
    covered = {c.name for c in claims}
    if data is not None:
        paired = next(c for c in PRIMARY if c.name == "paired_direction_ratio")
        for arm in ("adamw", "muon"):
            m = hp_twin_medians(data, arm)
            if len(m.seeds) < st.MIN_SEEDS:
                continue
            inf = st.ratio_inference(m.medians, [1.0] * len(m.medians), paired.null, confidence)
            verdict = st.direction_verdict(paired.direction, inf, inf.p)
            ex = _exact(paired, _SeedValues(m.seeds, m.medians, [1.0] * len(m.seeds), [1] * len(m.seeds)), inf, verdict)
            e = PrimaryEntry(
                paired.name, paired.scope, paired.quantity, paired.statement, _claimed(paired), "ratio", inf.method,
                inf.value, None if inf.ci95 is None else list(inf.ci95), inf.n_seeds, m.n_points, paired.paper,
                paper_text=paired.paper_text, direction=verdict, magnitude=None, p=inf.p, p_holm=inf.p,
                per_seed=[{"seed": s, "value": x} for s, x in zip(m.seeds, m.medians)],
                p_exact=None if ex is None else ex.p, p_exact_min=None if ex is None else ex.floor,
                p_exact_verdict=None if ex is None else ex.p_for_verdict,
            )  # fmt: skip
            # an approximate null: a verdict is false when it asserts more than the null band's difference
            lo, hi = NULL_BAND
            false = _false(verdict, paired) and not lo <= inf.value <= hi
            per_test.append(_aa_test(f"{arm} hyperparameter twin", paired, e, np.asarray(m.medians), 1, sims, false))
            covered.add(paired.name)
    n = len(per_test)
    rate = sum(t["false"] for t in per_test) / n if n else float("nan")
    ordered = sorted(used_pairs)
    seeds = [s for pair in ordered for s in pair]
    shared = len(seeds) != len(set(seeds))
    kind = "smoke test" if shared or n < MIN_CALIBRATION_TESTS else "calibration"
    power = {}
    for label in POWER_LABELS:
        got = [t["power"][label] for t in per_test if t["power"][label] is not None]
        power[label] = float(np.mean(got)) if got else None
    return Calibration(
        rate, n, per_test, [list(p) for p in ordered], [c.name for c in PRIMARY if c.name in covered], power, kind
    )
