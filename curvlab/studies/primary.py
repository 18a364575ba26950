"""The pre-registered **primary family** (:func:`primary_family`, a list of :class:`PrimaryEntry`, one per
:data:`curvlab.studies.paper.PRIMARY` claim), derived from a :class:`curvlab.studies.records.LevelData`.

Per seed, each claim aggregates that seed's units (the mean over its matched levels, the median of its
paired points' ratios, or its trajectory), then infers across seeds
(:func:`curvlab.inference.statistics.ratio_inference` or :func:`curvlab.inference.statistics.mean_inference`);
Holm's correction runs over the claims that got a test (3 seeds or more, and judged by the design); beside
the t model, each claim's exact sign-flip test (:mod:`curvlab.inference.exact_tests`), Holm-adjusted alike. And
the **A/A calibration** (:func:`calibration`, a :class:`Calibration`) from same-arm comparisons
(``"adamw/adamw"``, ``"muon/muon"``: two disjoint seeds of one arm per record), put through the same pipeline
for the claims that compare the two sides of a comparison (docs/science.md section 12).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from curvlab.inference import exact_tests as exact
from curvlab.inference import statistics
from curvlab.inference.exact_tests import floor_text
from curvlab.studies.controls import exchangeable_medians
from curvlab.studies.paper import POST_HOC_RULES, PRIMARY, PrimaryClaim, judged_claims
from curvlab.studies.records import PRIMARY_COMPARISON, ComparisonRecord, LevelData
from curvlab.studies.seed_values import SeedValues, claim_inputs
from curvlab.util.codec import Record


@dataclass(frozen=True)
class PrimaryEntry(Record):
    """One claim of the primary family, judged (module docstring; :mod:`curvlab.inference.statistics`).

    ``direction``: supported / contradicted / inconclusive, ``"descriptive: fewer than 3 seeds"`` or
    ``"not measured"``; ``magnitude``: consistent / larger / smaller / uninformative against ``paper``
    (``None`` without a paper number); ``p`` the unadjusted two-sided p-value, ``p_holm`` Holm's over
    the family (``None`` when not tested); ``kind`` what was judged (``"ratio"``, or ``"difference"``,
    also when a ratio's denominator had no settled sign: then ``note`` says so); ``rule_set`` the claim's
    (:attr:`curvlab.studies.paper.PrimaryClaim.rule_set`: ``"before"`` or ``"after"`` seeing data; ``""`` in a
    summary written before entries kept it, where :data:`curvlab.studies.paper.POST_HOC_RULES` tells)."""

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
    rule_set: str = ""  # "before" / "after" seeing data; "" read from an older summary (POST_HOC_RULES tells)

    @property
    def post_hoc(self) -> bool:
        """Whether the claim's rule was set after seeing data (an older summary's entry: by
        :data:`curvlab.studies.paper.POST_HOC_RULES`)."""
        return self.rule_set == "after" if self.rule_set else self.name in POST_HOC_RULES

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
# the within-run claims whose A/A is each arm's exchangeable twin, and the quantity of its ratio
AA_TWIN_CLAIMS = {"paired_direction_ratio": "nds", "direction_efficiency_ratio": "q"}
# the trajectory claims, whose A/A puts two seeds of one arm in the places of AdamW and Muon
AA_TRACK_CLAIMS = ("zipf_gap_change", "rho_within_change_gap")
AA_TEST_FIELDS = ("n_seeds", "value", "ci95", "p", "p_holm", "p_exact", "p_exact_verdict", "direction")
POWER_LABELS = tuple(f"x{f:g}" for f in exact.AA_FACTORS)  # "x1.5", "x2"


def _claimed(claim: PrimaryClaim) -> str:
    if claim.direction == "about":
        lo, hi = claim.band
        return f"about {claim.null:g} (within [{lo:g}, {hi:g}])"
    return f"{claim.direction} than {claim.null:g}"


def _infer(claim: PrimaryClaim, values: SeedValues, confidence: float) -> statistics.SeedInference:
    if values.denominator is None:
        return statistics.mean_inference(values.numerator, claim.null, confidence)
    return statistics.ratio_inference(values.numerator, values.denominator, claim.null, confidence)


@dataclass(frozen=True)
class _Exact:
    """A claim's exact seed-level test: its p, the p backing the verdict (:attr:`PrimaryEntry.p_exact_verdict`),
    the design's floor."""

    p: float
    p_for_verdict: float | None
    floor: float
    test: str


def _exact_values(claim: PrimaryClaim, values: SeedValues, inf: statistics.SeedInference) -> tuple[np.ndarray, float]:
    """The per-seed values the exact test flips, and their null: log ratios against log null (log-t), the
    linear contrast a - null b against 0 (Fieller, or a fallen-back difference), or the values themselves."""
    if inf.method == statistics.LOG_T:
        return np.log(np.asarray(inf.per_seed)), float(np.log(claim.null))
    if values.denominator is not None:
        # a - null b has the sign of a/b - null times that of b: negative denominators flip the side
        b = np.asarray(values.denominator)
        sign = -1.0 if np.all(b < 0) else 1.0
        return sign * (np.asarray(values.numerator) - claim.null * b), 0.0
    return np.asarray(values.numerator), claim.null


def _exact(claim: PrimaryClaim, values: SeedValues, inf: statistics.SeedInference, direction: str) -> _Exact | None:
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
        if direction == statistics.SUPPORTED:  # equivalence: two one-sided tests against the band's edges
            if claim.band is None or inf.method != statistics.LOG_T:
                backing = None  # (a Fieller interval inside the band has no exact counterpart here)
            else:
                lo, hi = np.log(claim.band)
                backing = max(exact.sign_flip_p(x, lo, "greater"), exact.sign_flip_p(x, hi, "less"))
        return _Exact(p, backing, exact.sign_flip_floor(n, "two-sided"), test)
    side = claim.direction
    p = exact.sign_flip_p(x, null, side)
    backing = (
        exact.sign_flip_p(x, null, "less" if side == "greater" else "greater")
        if direction == statistics.CONTRADICTED
        else p
    )
    return _Exact(p, backing, exact.sign_flip_floor(n, side), test)


def _claim_fields(claim: PrimaryClaim) -> dict[str, Any]:
    """The fields of a claim's entry that restate the claim itself, measured or not."""
    restated = ("name", "scope", "quantity", "statement", "paper", "paper_text", "rule_set")
    return {k: getattr(claim, k) for k in restated} | {"claimed": _claimed(claim)}


# the fields of a claim without data: no estimate, never a verdict
UNMEASURED = dict(
    method="", value=None, ci95=None, n_seeds=0, n_units=0, direction=statistics.NOT_MEASURED, magnitude=None
)
UNMEASURED |= dict(p=None, p_holm=None)


def _unmeasured_entry(claim: PrimaryClaim, why: str) -> PrimaryEntry:
    """The entry of a claim whose data are missing: marked not measured, never a verdict."""
    return PrimaryEntry(
        **_claim_fields(claim), **UNMEASURED, kind=claim.kind, note=f"not measured: {why}; needs {claim.data}"
    )


def _exact_backing(
    claim: PrimaryClaim, direction: str, ex: _Exact | None, exact_p_holm: float | None, confidence: float
) -> bool | None:
    """Whether the exact test backs a verdict (``None``: no verdict, or no exact test under Holm): a supported
    "about" claim by its two one-sided tests at (1 - confidence) / 2 each, any other by its Holm-adjusted p."""
    if ex is None or direction not in (statistics.SUPPORTED, statistics.CONTRADICTED) or exact_p_holm is None:
        return None
    if claim.direction == "about" and direction == statistics.SUPPORTED:
        return None if ex.p_for_verdict is None else ex.p_for_verdict < (1 - confidence) / 2
    return exact_p_holm < statistics.ALPHA


def _magnitude(claim: PrimaryClaim, inf: statistics.SeedInference, ci: list[float] | None, judged: bool) -> str | None:
    """The magnitude verdict against the paper's number (``None``: no number, or a claim not judged here)."""
    if claim.paper is None or not judged:
        return None
    # the paper's number is on the claim's scale: a quantity that fell back to a difference (its
    # denominator's sign not settled) cannot be set beside it
    if inf.method == statistics.DIFFERENCE_T:
        return statistics.FEW_SEEDS if inf.n_seeds < statistics.MIN_SEEDS else statistics.UNINFORMATIVE
    return statistics.magnitude_verdict(ci, claim.paper, inf.n_seeds)


def _measured_entry(
    claim: PrimaryClaim,
    values: SeedValues,
    inf: statistics.SeedInference,
    judged: bool,
    direction: str,
    p_holm: float | None,
    ex: _Exact | None,
    backed: bool | None,
) -> PrimaryEntry:
    """The entry of a measured claim: its estimate, interval and per-seed values, the verdicts, and the exact
    test beside the t model's."""
    kind = "difference" if inf.method == statistics.DIFFERENCE_T else claim.kind
    ci = None if inf.ci95 is None else list(inf.ci95)
    notes = ([inf.note] if inf.note else []) + values.notes
    if not judged:
        notes.append(f"descriptive in this design: {DESCRIPTIVE_NOTE}")
    if inf.n_seeds < 2:
        notes.append(f"{inf.n_seeds} seed: no interval")
    per_seed = [
        {"seed": seed, "numerator": x, "units": u}
        | ({} if values.denominator is None else {"denominator": values.denominator[k]})
        | {"value": inf.per_seed[k]}
        for k, (seed, x, u) in enumerate(zip(values.seeds, values.numerator, values.units))
    ]
    return PrimaryEntry(
        **_claim_fields(claim),
        kind=kind,
        method=inf.method,
        value=inf.value,
        ci95=ci,
        n_seeds=inf.n_seeds,
        n_units=sum(values.units),
        direction=direction,
        magnitude=_magnitude(claim, inf, ci, judged),
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


def _judge(
    claims: tuple[PrimaryClaim, ...],
    data: LevelData,
    records: list[ComparisonRecord],
    confidence: float,
    judged: frozenset[str] | None = None,
) -> list[PrimaryEntry]:
    """Every claim's entry: per-seed inference, Holm over the claims tested (3 seeds or more, and named
    in ``judged`` when given: the others are estimated but descriptive, outside the correction), verdicts."""
    inputs = [claim_inputs(c, data, records) for c in claims]
    inferences = [None if isinstance(v, str) else _infer(c, v, confidence) for c, v in zip(claims, inputs)]
    is_judged = [judged is None or c.name in judged for c in claims]
    tested = [
        i
        for i, inf in enumerate(inferences)
        if is_judged[i] and inf is not None and inf.p is not None and inf.n_seeds >= statistics.MIN_SEEDS
    ]
    adjusted = dict(zip(tested, statistics.holm([inferences[i].p for i in tested])))
    directions, exacts = {}, {}
    for i, (c, v, inf) in enumerate(zip(claims, inputs, inferences)):
        if inf is not None and is_judged[i]:
            band = None if inf.method == statistics.DIFFERENCE_T else c.band
            directions[i] = statistics.direction_verdict(c.direction, inf, adjusted.get(i), band)
        if (
            inf is not None
            and inf.n_seeds >= 2
            and (ex := _exact(c, v, inf, directions.get(i, statistics.DESCRIPTIVE)))
        ):
            exacts[i] = ex
    # Holm over the exact tests of the same claims, as over the t model's: an "about" claim enters with its
    # two-sided p, and its equivalence stands on its own two one-sided tests at (1 - confidence) / 2 each, as
    # its t-model verdict stands on its interval (outside Holm)
    holm_p = {i: (ex.p if claims[i].direction == "about" else ex.p_for_verdict) for i, ex in exacts.items()}
    exact_holm = dict(
        zip(tested, statistics.holm([holm_p[i] for i in tested]) if all(i in exacts for i in tested) else [])
    )
    entries = []
    for i, (claim, values, inf) in enumerate(zip(claims, inputs, inferences)):
        if inf is None:
            entries.append(_unmeasured_entry(claim, values))
            continue
        direction = directions.get(i, statistics.DESCRIPTIVE)  # (a fallen-back difference has no band)
        ex = exacts.get(i)
        backed = _exact_backing(claim, direction, ex, exact_holm.get(i), confidence)
        entries.append(_measured_entry(claim, values, inf, is_judged[i], direction, adjusted.get(i), ex, backed))
    return entries


DESCRIPTIVE_NOTE = "the preset judges only its own primary claims (docs/science.md section 12): no verdict, no Holm"


def primary_family(
    data: LevelData, confidence: float = statistics.CONFIDENCE, judged: tuple[str, ...] | None = None
) -> list[PrimaryEntry]:
    """The primary family (:data:`curvlab.studies.paper.PRIMARY`), judged from the per-level data alone: the
    matched comparisons of AdamW and Muon (``"adamw/muon"``) and the trajectories. A claim whose data
    are missing (e.g. older runs without paired-direction scalars, or one value of s) is an entry marked
    not measured, never a verdict. ``judged`` names the claims a design has the power to judge (a
    preset's ``primary``; None: all): the others keep their estimate and interval, as descriptive
    entries outside Holm's correction."""
    return _judge(PRIMARY, data, data.matched(PRIMARY_COMPARISON), confidence, judged_claims(judged))


def estimated(
    data: LevelData, claims: tuple[PrimaryClaim, ...], confidence: float = statistics.CONFIDENCE
) -> list[PrimaryEntry]:
    """``claims`` (primary claims, or variants of them in another scope) estimated per seed from ``data`` as the
    primary family is, none judged: descriptive entries, outside any Holm correction (a design that judges
    something else from them, as the scaling design judges its fits across sizes)."""
    return _judge(claims, data, data.matched(PRIMARY_COMPARISON), confidence, frozenset())


def _false(direction: str, claim: PrimaryClaim) -> bool:
    """Whether an A/A verdict asserts a difference between two runs of one arm: any verdict on a
    greater/less claim, and "contradicted" on an about-equal claim ("supported" is right there)."""
    if direction in (statistics.SUPPORTED, statistics.CONTRADICTED):
        return not (claim.direction == "about" and direction == statistics.SUPPORTED)
    return False


def asserts_difference(direction: str, claim: str) -> bool:
    """Whether an A/A verdict ``direction`` on the primary claim named ``claim`` asserts a difference between
    two runs of one arm (as :func:`calibration` counts it, before a hyperparameter twin's null band).

    Args:
        direction: the verdict (supported, contradicted, inconclusive, ...).
        claim: a :data:`curvlab.studies.paper.PRIMARY` name.

    Returns:
        True for any verdict on a greater/less claim and "contradicted" on an about-equal one.
    """
    return _false(direction, next(c for c in PRIMARY if c.name == claim))


def _aa_test(
    comparison: str, claim: PrimaryClaim, e: PrimaryEntry, values, n_family: int, sims: int, false: bool
) -> dict:
    """One A/A test's row: its verdict, estimate, interval and p-values, whether the verdict is false, and
    its power to flag a same-arm bias of x1.5 and x2 on its own spread (the SD of its per-unit log values;
    Bonferroni over its family)."""
    logs = np.log(values) if e.method == statistics.LOG_T else None
    if logs is None or logs.size < statistics.MIN_SEEDS:
        power = dict.fromkeys(POWER_LABELS)
    else:
        power = exact.aa_power_table(float(logs.std(ddof=1)), logs.size, statistics.ALPHA, n_family, sims)
    row = {"comparison": comparison, "claim": claim.name} | {k: getattr(e, k) for k in AA_TEST_FIELDS}
    return row | {"false": false, "power": power}


def _single_aa(label: str, claim: PrimaryClaim, values: SeedValues, confidence: float, sims: int) -> dict:
    """One A/A test of a within-run claim on same-arm values, through the claim's estimator and test at level
    0.05 on its own; an exact null, so any verdict asserting a difference is false."""
    inf = _infer(claim, values, confidence)
    verdict = statistics.direction_verdict(claim.direction, inf, inf.p)
    ex = _exact(claim, values, inf, verdict)
    e = _measured_entry(claim, values, inf, True, verdict, inf.p, ex, None)  # (its p_holm is its own p)
    return _aa_test(label, claim, e, np.asarray(values.numerator, dtype=float), 1, sims, _false(verdict, claim))


def _twin_aa_tests(data: LevelData, confidence: float, sims: int) -> list[dict[str, Any]]:
    """The paired claims' A/A (:data:`AA_TWIN_CLAIMS`): each arm's exchangeable twin, per seed."""
    out = []
    for name, quantity in AA_TWIN_CLAIMS.items():
        claim = next((c for c in PRIMARY if c.name == name), None)
        for arm in ("adamw", "muon") if claim is not None else ():
            m = exchangeable_medians(data, arm, quantity)
            if len(m.seeds) < statistics.MIN_SEEDS:
                continue
            values = SeedValues(m.seeds, m.medians, [1.0] * len(m.seeds), [1] * len(m.seeds))
            label = f"{arm} exchangeable twin" + ("" if quantity == "nds" else f" ({quantity})")
            out.append(_single_aa(label, claim, values, confidence, sims))
    return out


def same_arm_tracks(data: LevelData, arm: str, pairs: list[tuple[int, int]]) -> LevelData:
    """``arm``'s trajectories as two arms, for the trajectory claims' A/A: of pair k = (a, b), seed a's as AdamW's
    and seed b's as Muon's, both as seed k."""
    tracks = []
    for k, (a, b) in enumerate(pairs):
        tracks += [replace(t, arm="adamw", seed=k) for t in data.tracks if t.arm == arm and t.seed == a]
        tracks += [replace(t, arm="muon", seed=k) for t in data.tracks if t.arm == arm and t.seed == b]
    return LevelData([], tracks, data.plateau_ceiling, list(data.s_values))


def _track_aa_tests(
    data: LevelData, pairs: list[tuple[int, int]], confidence: float, sims: int
) -> list[dict[str, Any]]:
    """The trajectory claims' A/A (:data:`AA_TRACK_CLAIMS`): per arm, two seeds of it in the places of AdamW and
    Muon (:func:`same_arm_tracks`), one per A/A pair, through the claim's own data rule and test."""
    out = []
    for arm in ("adamw", "muon"):
        relabelled = same_arm_tracks(data, arm, pairs)
        for claim in (c for c in PRIMARY if c.name in AA_TRACK_CLAIMS):
            values = claim_inputs(claim, relabelled, [])
            if isinstance(values, str) or len(values.seeds) < statistics.MIN_SEEDS:
                continue
            out.append(_single_aa(f"{arm}/{arm} trajectories", claim, values, confidence, sims))
    return out


def calibration(
    records: list[ComparisonRecord],
    confidence: float = statistics.CONFIDENCE,
    *,
    data: LevelData | None = None,
    pairs: list[tuple[int, int]] | None = None,
    sims: int = 4000,
) -> Calibration:
    """The A/A calibration from same-arm comparisons (records named ``"x/x"``, e.g. ``"adamw/adamw"``;
    each record two seeds of one arm, ``pairs``: default each record's seed and the one before, as the reproduction's
    neighbouring pairs). Each same-arm family goes through the primary pipeline for the claims comparing the two sides
    of a comparison (``between_runs``), with Holm over those claims. With ``data``, the within-run claims' A/A too
    (:data:`AA_TWIN_CLAIMS`): each arm's exchangeable twin (its direction over the same state's with the last
    gradient from an independent batch, both under a held-out H: :func:`curvlab.studies.controls.exchangeable_medians`),
    per seed, through the claim's estimator and test, at level 0.05 on its own (the primary family tests it with
    Holm over the preset's judged claims: the A/A is the stricter, by that factor). An exact null: any verdict
    asserting a difference is false. And the trajectory claims' (:data:`AA_TRACK_CLAIMS`), with the A/A pairs'
    two seeds of one arm in the places of AdamW and Muon. A test is a claim with 3 or more seeds or pairs; the
    false-verdict rate is the share of tests whose direction verdict asserted a difference (:func:`_false`), NaN
    when there is no test.

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
        twins = _twin_aa_tests(data, confidence, sims)
        tracks = _track_aa_tests(data, sorted(used_pairs) or sorted(map(tuple, pairs or [])), confidence, sims)
        per_test += twins + tracks
        covered |= {t["claim"] for t in twins + tracks}
    n = len(per_test)
    rate = sum(t["false"] for t in per_test) / n if n else float("nan")
    ordered = sorted(used_pairs)
    seeds = [s for pair in ordered for s in pair]
    shared = len(seeds) != len(set(seeds))
    kind = "smoke test" if shared or n < MIN_CALIBRATION_TESTS else "calibration"
    got = {label: [t["power"][label] for t in per_test if t["power"][label] is not None] for label in POWER_LABELS}
    power = {label: float(np.mean(v)) if v else None for label, v in got.items()}
    return Calibration(
        rate, n, per_test, [list(p) for p in ordered], [c.name for c in PRIMARY if c.name in covered], power, kind
    )
