r"""The controls of a reproduction (docs/science.md section 14, which says why each can fail the mechanism):
checks with a known answer, on the points of the paired claim, derived from a
:class:`curvlab.studies.records.LevelData` like the primary family.

Each control is reported per arm (the runs whose checkpoints it reads) with its value, a 95% interval
across seeds, what it must come out as, and whether it did (:class:`ControlEntry`). Per seed, a control
reduces that seed's points (:func:`curvlab.studies.records.analysed_points`) to one number, as the paired
claim does (the median of per-point ratios), and infers across seeds with the primary family's log-t
interval (:func:`curvlab.inference.statistics.ratio_inference`).

Negative controls, which must come out null:

* ``twin_shadow``: NDS(own step) / NDS(twin's step) on the hidden matrices, the twin a shadow of the run's
  own optimizer (:func:`curvlab.steps.shadow.build_controls`): 1 to float rounding at *every* point
  (:data:`TWIN_TOLERANCE`).
* ``exchangeable_twin``: NDS(own direction) / NDS(its exchangeable twin's), both under the held-out H
  (:func:`curvlab.analysis.controls.exchangeable_twins`: the same state, the last gradient from an
  independent batch): an exact null, judged by an equivalence test (TOST at 5%,
  :func:`curvlab.inference.statistics.equivalence_test`) against :data:`EXCHANGEABLE_BAND`, stated before
  the runs; also the paired claim's A/A (:func:`curvlab.studies.primary.calibration`).
* ``held_out_batch``: NDS of the arm's direction under its own batch's H over under the held-out H, at every
  analysed point, judged by the same equivalence test against :data:`COUPLING_BAND`; the entry of arm
  ``adamw/muon`` is the paired ratio under the held-out H (must stay above 1), and ``coupling`` the paired
  ratio under the held-out H over the one under the own batch's H (equivalence against the band).

Descriptive (no pass or fail):

* ``hyperparameter_twin``: NDS(own) / NDS(a twin with one hyperparameter nudged), with the nudge's change of
  alignment cos(G, Z) beside it, which moves NDS (about as cos²): its nudge is real, so it measures the
  nudge, not a bias (docs/science.md section 14).

Positive controls, with a known answer:

* ``injected_sharp_<r>``: :math:`Z' = Z_\text{muon} + c\,v_1` with c set in closed form
  (:func:`curvlab.steps.stability.injection_coefficient`) so that NDS(Z') / NDS(Z_muon) is r = 1.2, 1.5 or
  2: passes when the estimate recovers r to rounding (:data:`INJECTION_TOLERANCE`) and the t test against 1
  detects it (coverage is reported beside: the spread is float rounding, so this checks arithmetic and
  signs, not coverage under seed spread).
* ``sgd_direction``: NDS(momentum SGD's direction) / NDS(Muon's) on the hidden matrices: its interval must
  lie above 1 (a pilot: x20-24).

With them, the edge-of-stability context at the same points (:class:`StabilityEntry`): lambda_max(H), the
arm's preconditioned sharpness against its own threshold, 2/eta, and NDS / lambda_max of each direction.
A quantity that reads a Lanczos eigenvalue leaves out the points where that eigenvalue did not converge
(:data:`READS`), and its entry counts them (``n_unconverged``); the residual's own entry keeps them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from curvlab.analysis.controls import (
    EXCHANGEABLE,
    INJECTED_RATIOS,
    LAMBDA_MIN,
    LANCZOS_TOL,
    STABILITY_QUANTITIES,
    heldout_key,
    injected_key,
)
from curvlab.curvature.scalars import CheckpointScalars
from curvlab.inference import statistics
from curvlab.studies.records import PRIMARY_COMPARISON, LevelData, analysed_points, with_levels_off_plateau
from curvlab.util.codec import Record

CONTROL_NAMES = ("twin_shadow", "exchangeable_twin", "hyperparameter_twin", "held_out_batch")
CONTROL_NAMES += (*(f"injected_sharp_{r:g}" for r in INJECTED_RATIOS), "sgd_direction")
TWIN_TOLERANCE = 1e-4  # |NDS(own) / NDS(twin) - 1| at every point: the float32 rounding of W - W_next and the
# HVPs gave at most 1.3e-5 over quick's 265 points (two runs), a twin one step late 1e-2 and more
# the injected ratio recovered: |log(estimate / r)| at most this. The truth is r at every point, so the
# spread is float rounding, and a 95% interval on it covers r 95% of the time, no more: coverage is
# reported, but the pass is recovery to rounding and detection
INJECTION_TOLERANCE = 1e-4
NULL_BAND = (1 / 1.1, 1.1)  # an approximate null's interval must lie inside: a tenth of the paper's effect
# Stated before the runs that judge them (issue 50; docs/science.md section 14): an exact null's ratio must be
# shown, by TOST at 5%, to lie within 10% of 1; so must the coupling of a direction to its own batch's H
EXCHANGEABLE_BAND = (0.9, 1 / 0.9)
COUPLING_BAND = (0.9, 1 / 0.9)
ARMS = ("adamw", "muon")


@dataclass(frozen=True)
class ControlEntry(Record):
    """One control, for one arm's points (module docstring). ``value`` and ``ci95`` are across seeds
    (``None`` when not measured); ``passed`` is ``None`` when not measured or descriptive; ``detail`` holds
    what the control checks besides (the largest deviation of a twin; coverage and detection of an
    injection; a hyperparameter twin's alignment change)."""

    name: str
    arm: str
    scope: str
    value: float | None
    ci95: list[float] | None
    expected: str
    passed: bool | None
    n_seeds: int = 0
    n_points: int = 0
    detail: dict[str, Any] | None = None
    note: str = ""
    band: list[float] | None = None  # an equivalence-tested control's band, stated before the run
    p_equivalence: float | None = None  # its TOST p (the larger one-sided p)
    descriptive: bool = False  # shown with its interval, never passed or failed


@dataclass(frozen=True)
class StabilityEntry(Record):
    """One edge-of-stability quantity for one arm's points: the geometric mean across seeds of the
    per-seed medians, with its log-t interval (``None`` when not measured). ``n_unconverged``: the points
    whose Lanczos eigenvalue (:data:`READS`) did not converge, left out of ``value`` and ``n_points``
    (kept, and counted, in the residual's own entry); ``note`` says so, and counts the points written
    before the flags whose convergence can't be told (kept)."""

    arm: str
    quantity: str
    value: float | None
    ci95: list[float] | None
    n_seeds: int
    n_points: int
    note: str = ""
    n_unconverged: int = 0
    # for a quantity that reads a Lanczos eigenvalue: the median over its points of that eigenvalue's
    # relative residual |Av - theta v| / |theta|, and whether every point's converged (None: none is read, or
    # some points' convergence can't be told)
    residual: float | None = None
    converged: bool | None = None


# -- per-seed reductions -----------------------------------------------------------------------------


def arm_points(data: LevelData, arm: str | None) -> dict[int, list[CheckpointScalars]]:
    """Per seed, the paired claim's points in ``arm``'s runs (``None``: both arms')."""
    out = {}
    for r in with_levels_off_plateau(data.matched(PRIMARY_COMPARISON)):
        points = analysed_points(r, data)
        out[r.seed] = [p for (optimizer, _), p in sorted(points.items()) if arm is None or optimizer == arm]
    return out


@dataclass(frozen=True)
class SeedMedians:
    """Per seed, the median of a per-point value over the points that have it (and where it is finite)."""

    seeds: list[int]
    medians: list[float]
    values: list[float]  # every point's, pooled
    n_points: int
    missing: int  # points without the scalars, or where the value is undefined


def seed_medians(points: dict[int, list[CheckpointScalars]], value: Callable[[CheckpointScalars], float | None]):
    """:class:`SeedMedians` of ``value`` (``None`` or non-finite: the point has no value)."""
    seeds, medians, pooled, missing = [], [], [], 0
    for seed, rows in sorted(points.items()):
        xs = []
        for row in rows:
            x = value(row)
            if x is None or not np.isfinite(x):
                missing += 1
            else:
                xs.append(float(x))
        if xs:
            seeds.append(seed)
            medians.append(float(np.median(xs)))
            pooled += xs
    return SeedMedians(seeds, medians, pooled, len(pooled), missing)


def ratio_of(num: str, den: str, positive: bool = False) -> Callable[[CheckpointScalars], float | None]:
    """A point's ``num / den`` (``None`` where either is missing, the denominator is 0, or, with
    ``positive``, either is not positive: a log ratio needs both)."""

    def value(row: CheckpointScalars) -> float | None:
        if num not in row.paired or den not in row.paired:
            return None
        a, b = row.paired[num], row.paired[den]
        if b == 0 or (positive and not (a > 0 and b > 0)):
            return None
        return a / b

    return value


def _infer(m: SeedMedians) -> statistics.SeedInference | None:
    return statistics.ratio_inference(m.medians, [1.0] * len(m.medians)) if m.seeds else None


def _ci(inf: statistics.SeedInference | None) -> list[float] | None:
    return None if inf is None or inf.ci95 is None else [float(x) for x in inf.ci95]


# -- the controls ------------------------------------------------------------------------------------


def _entry(
    name: str, arm: str, scope: str, expected: str, m: SeedMedians, passed: Callable[[list[float]], bool], **extra
) -> ControlEntry:
    """A control's entry from its per-seed medians; ``passed`` judges the interval (none: not judged)."""
    inf = _infer(m)
    if inf is None:
        return ControlEntry(name, arm, scope, None, None, expected, None, note=extra.get("note") or "not measured")
    ci = _ci(inf)
    missing = f"{m.missing} points without the scalars" if m.missing else ""
    notes = [extra.get("note", ""), missing, "" if ci else "fewer than 2 seeds: no interval"]
    ok = None if ci is None else bool(passed(ci))
    note = "; ".join(n for n in notes if n)
    return ControlEntry(
        name, arm, scope, inf.value, ci, expected, ok, len(m.seeds), m.n_points, extra.get("detail"), note
    )


def _above_one(ci: list[float]) -> bool:
    return ci[0] > 1


def twin_control(data: LevelData, arm: str) -> ControlEntry:
    """The twin shadow of ``arm``: passed when every point's ratio is 1 within :data:`TWIN_TOLERANCE`."""
    m = seed_medians(arm_points(data, arm), ratio_of(f"paired_nds_{arm}_hidden", "paired_nds_twin_hidden"))
    worst = max((abs(x - 1) for x in m.values), default=float("nan"))
    expected = f"1 at every point (within {TWIN_TOLERANCE:g})"
    scope = "hidden: NDS(own step) / NDS(twin's step)"
    detail = {"max_abs_deviation": worst}
    return _entry("twin_shadow", arm, scope, expected, m, lambda ci: worst <= TWIN_TOLERANCE, detail=detail)


def q_ratio_of(nds_a: str, cos_a: str, nds_b: str, cos_b: str) -> Callable[[CheckpointScalars], float | None]:
    """A point's q(a) / q(b), q = cos²/NDS, from its scalars (``None`` where one is missing, either NDS is not
    positive, or b's cosine is 0)."""

    def value(row: CheckpointScalars) -> float | None:
        if any(k not in row.paired for k in (nds_a, cos_a, nds_b, cos_b)):
            return None
        n_a, c_a, n_b, c_b = (row.paired[k] for k in (nds_a, cos_a, nds_b, cos_b))
        if not (n_a > 0 and n_b > 0 and c_b != 0):
            return None
        return (c_a**2 / n_a) / (c_b**2 / n_b)

    return value


def exchangeable_medians(data: LevelData, arm: str, quantity: str = "nds") -> SeedMedians:
    """Per seed, the median of ``quantity`` (``nds``, or ``q`` = cos²/NDS) of the arm's own direction over its
    exchangeable twin's, both under the held-out H, on the hidden matrices (points where either NDS <= 0 have
    no log ratio)."""
    twin = arm + EXCHANGEABLE
    if quantity == "nds":
        return seed_medians(arm_points(data, arm), ratio_of(heldout_key(arm), heldout_key(twin), positive=True))
    keys = (heldout_key(arm), heldout_key(arm, "cos"), heldout_key(twin), heldout_key(twin, "cos"))
    return seed_medians(arm_points(data, arm), q_ratio_of(*keys))


AFTER_THE_RUN = "descriptive: its band was registered after this run's data were read (issue 50)"


def _equivalent(
    name: str, arm: str, scope: str, m: SeedMedians, band: tuple[float, float], registered: bool = True
) -> ControlEntry:
    """A control judged by TOST against ``band`` (:func:`curvlab.inference.statistics.equivalence_test`), over
    every analysed point of its arm (``n_points``; those with an NDS <= 0 have no log ratio and are counted);
    ``registered`` False: a run made before the band was registered, where the entry is descriptive."""
    test = statistics.equivalence_test(m.medians, band)
    lo, hi = band
    expected = f"within [{lo:.3g}, {hi:.3g}] (equivalence, TOST at 5%)"
    e = _entry(name, arm, scope, expected, m, lambda ci: bool(test.passed))
    notes = [f"{m.missing} of them with no log ratio (an NDS <= 0, or not measured)" if m.missing else ""]
    notes += [e.note if e.value is not None else "", "" if registered else AFTER_THE_RUN]
    passed = None if e.value is None or test.passed is None or not registered else test.passed
    analysed = m.n_points + m.missing
    note = "; ".join(n for n in notes if n) if e.value is not None else e.note
    return replace(
        e, passed=passed, band=[lo, hi], p_equivalence=test.p, n_points=analysed, note=note, descriptive=not registered
    )


def exchangeable_control(data: LevelData, arm: str, registered: bool = True) -> ControlEntry:
    scope = "hidden: NDS(own) / NDS(exchangeable twin: last gradient from an independent batch), held-out H"
    return _equivalent("exchangeable_twin", arm, scope, exchangeable_medians(data, arm), EXCHANGEABLE_BAND, registered)


def hp_twin_control(data: LevelData, arm: str) -> ControlEntry:
    """Descriptive: the hyperparameter twin's NDS ratio, with its alignment ratio cos(own) / cos(twin)."""
    nudge = "momentum 0.95 vs 0.94" if arm == "muon" else "beta2 0.95 vs 0.951"
    scope = f"hidden: NDS(own) / NDS(twin with {nudge})"
    m = seed_medians(arm_points(data, arm), ratio_of(f"paired_nds_{arm}_hidden", "paired_nds_hp_twin_hidden"))
    cos = _infer(seed_medians(arm_points(data, arm), ratio_of(f"paired_cos_{arm}_hidden", "paired_cos_hp_twin_hidden")))
    detail = {"cos_ratio": None if cos is None else cos.value, "cos_ci95": _ci(cos)}
    e = _entry("hyperparameter_twin", arm, scope, "descriptive: the nudge's effect", m, lambda ci: True, detail=detail)
    return replace(e, passed=None, descriptive=True)


def held_out_controls(data: LevelData, registered: bool = True) -> list[ControlEntry]:
    """The coupling of a direction to its own batch's H, both ways, per arm (equivalence against
    :data:`COUPLING_BAND`): its own direction under its batch's H over under the held-out H, and under its
    batch's H its own direction over its exchangeable twin's (made from another batch); then the paired
    ratio under the held-out H, and that over the paired ratio under the own batch's H."""
    out = []
    for arm in ARMS:
        own = f"paired_nds_{arm}_hidden"
        m = seed_medians(arm_points(data, arm), ratio_of(own, heldout_key(arm), positive=True))
        scope = "hidden: NDS(own direction) under its own batch's H / under a held-out H"
        out.append(_equivalent("held_out_batch", arm, scope, m, COUPLING_BAND, registered))
        m = seed_medians(arm_points(data, arm), ratio_of(own, f"paired_nds_{arm}{EXCHANGEABLE}_hidden", positive=True))
        scope = "hidden: under the own batch's H, NDS(own direction) / NDS(exchangeable twin, made from another batch)"
        out.append(_equivalent("held_out_batch", f"{arm} (twin)", scope, m, COUPLING_BAND, registered))
    m = seed_medians(arm_points(data, None), ratio_of(heldout_key("adamw"), heldout_key("muon")))
    scope = "hidden: NDS(AdamW's direction) / NDS(Muon's), both under a held-out H"
    out.append(_entry("held_out_batch", "adamw/muon", scope, "greater than 1 (as the paired claim)", m, _above_one))

    def coupling(row: CheckpointScalars) -> float | None:
        held, own = ratio_of(heldout_key("adamw"), heldout_key("muon"))(row), _paired_ratio(row)
        return None if held is None or own is None or held <= 0 or own <= 0 else held / own

    scope = "hidden: the paired ratio under a held-out H / under the own batch's H"
    m = seed_medians(arm_points(data, None), coupling)
    out.append(_equivalent("held_out_batch", "coupling", scope, m, COUPLING_BAND, registered))
    return out


def _paired_ratio(row: CheckpointScalars) -> float | None:
    return ratio_of("paired_nds_adamw_hidden", "paired_nds_muon_hidden")(row)


def _scalar(key: str) -> Callable[[CheckpointScalars], float | None]:
    return lambda row: row.paired.get(key)


def injected_controls(data: LevelData, arm: str) -> list[ControlEntry]:
    """Per known ratio, the paired estimator on the injected directions: covered and detected."""
    out = []
    scope = "all: NDS(Z_muon + c v1) / NDS(Z_muon), c set for the ratio"
    unreachable = "a point where the ratio can't be reached (NDS(Z_muon) <= 0, or lambda_max too small) has none"
    for ratio in INJECTED_RATIOS:
        m = seed_medians(arm_points(data, arm), _scalar(injected_key(ratio)))
        inf = _infer(m)
        ci, p = _ci(inf), None if inf is None else inf.p
        covered = ci is not None and ci[0] <= ratio <= ci[1]
        detected = p is not None and p < statistics.ALPHA and inf.value > 1
        recovered = inf is not None and abs(math.log(inf.value / ratio)) <= INJECTION_TOLERANCE
        detail = {"true_ratio": ratio, "recovered": recovered, "covered": covered, "detected": detected, "p": p}
        ok, note = recovered and detected, unreachable if m.missing else ""
        expected = f"{ratio:g} (to rounding, and detected)"
        out.append(
            _entry(f"injected_sharp_{ratio:g}", arm, scope, expected, m, lambda ci, ok=ok: ok, detail=detail, note=note)
        )
    return out


def sgd_control(data: LevelData, arm: str) -> ControlEntry:
    m = seed_medians(arm_points(data, arm), ratio_of("paired_nds_sgd_hidden", "paired_nds_muon_hidden"))
    scope = "hidden: NDS(momentum SGD's direction) / NDS(Muon's)"
    return _entry("sgd_direction", arm, scope, "greater than 1 (a pilot: x20-24)", m, _above_one)


def controls(data: LevelData, registered: bool = True) -> list[ControlEntry]:
    """Every control (:data:`CONTROL_NAMES`) for each arm, in that order (the held-out batch's paired
    ratio after its per-arm entries). A control whose scalars no point carries is an entry with no
    value and ``passed`` ``None``: not measured, never a pass. ``registered`` False: a run made before the
    equivalence bands were registered (issue 50), whose equivalence-judged entries are descriptive."""
    out = [twin_control(data, arm) for arm in ARMS]
    out += [exchangeable_control(data, arm, registered) for arm in ARMS]
    out += [hp_twin_control(data, arm) for arm in ARMS]
    out += held_out_controls(data, registered)
    out += [e for arm in ARMS for e in injected_controls(data, arm)]
    out += [sgd_control(data, arm) for arm in ARMS]
    return out


# -- the edge of stability ---------------------------------------------------------------------------


# which Lanczos eigenvalue each context quantity reads: "lambda" (of H) or "preconditioned" (the arm's)
READS = {"lambda_max": "lambda", "preconditioned_sharpness": "preconditioned", "sharpness_over_edge": "preconditioned"}
READS |= {f"nds_{d}_over_lambda_max": "lambda" for d in ARMS} | {"lambda_residual_over_lambda_max": "lambda"}
READS |= {"lambda_min_over_lambda_max": "lambda_min"}  # (its own flag: converged to the spectrum's scale)
# what each eigenvalue's residual is relative to: its own value, but lambda_min's the spectrum's scale
# (lambda_max), to which it is converged
EIGENVALUES = {"lambda": STABILITY_QUANTITIES["lambda_max"], "lambda_min": STABILITY_QUANTITIES["lambda_max"]}
EIGENVALUES |= {"preconditioned": STABILITY_QUANTITIES["preconditioned_sharpness"]}
CONVERGED_SLACK = 10  # lanczos' converged flag: a true residual within 10 tolerances


def converged(row: CheckpointScalars, eigenvalue: str) -> bool | None:
    """Whether a point's ``eigenvalue`` ("lambda" or "preconditioned") converged: its stored flag, else (a
    point written before the flags) lambda_max's from its residual, within lanczos' slack of
    :data:`~curvlab.analysis.controls.LANCZOS_TOL` relative to the value; ``None``: it can't be told."""
    flag = row.paired.get(f"control_{eigenvalue}_converged")
    if flag is not None:
        return bool(flag)
    value, residual = row.paired.get(STABILITY_QUANTITIES["lambda_max"]), row.paired.get("control_lambda_residual")
    if eigenvalue != "lambda" or value is None or residual is None:
        return None
    return bool(residual <= CONVERGED_SLACK * LANCZOS_TOL * abs(value))


def _stability_entry(points, arm: str, quantity: str, value) -> StabilityEntry:
    reads, kept, dropped, untold = READS.get(quantity), {}, 0, 0
    for seed, rows in points.items():
        kept[seed] = []
        for row in rows:
            ok = None if reads is None or value(row) is None else converged(row, reads)
            dropped += ok is False
            untold += reads is not None and value(row) is not None and ok is None
            if ok is not False or quantity == "lambda_residual_over_lambda_max":
                kept[seed].append(row)
    notes = []
    if dropped:
        left = "kept: this is how far they got" if quantity == "lambda_residual_over_lambda_max" else "left out"
        notes.append(f"{dropped} points with an unconverged {reads} eigenvalue ({left})")
    if untold:
        notes.append(f"{untold} points without a converged flag (written before it): kept")
    m = seed_medians(kept, value)
    lanczos = _residual(points, reads), None if reads is None or untold or not m.seeds else not dropped
    if m.seeds and all(x > 0 for x in m.medians):
        inf = _infer(m)
        note = "; ".join(notes)
        return StabilityEntry(arm, quantity, inf.value, _ci(inf), len(m.seeds), m.n_points, note, dropped, *lanczos)
    if m.seeds and all(x < 0 for x in m.medians):  # (lambda_min / lambda_max: the log-t interval of -x, negated)
        inf = _infer(replace(m, medians=[-x for x in m.medians]))
        ci = None if inf.ci95 is None else [-float(inf.ci95[1]), -float(inf.ci95[0])]
        return StabilityEntry(
            arm, quantity, -inf.value, ci, len(m.seeds), m.n_points, "; ".join(notes), dropped, *lanczos
        )
    notes.insert(0, "not measured" if not m.seeds else "a per-seed median <= 0: the mean, no log interval")
    value = float(np.mean(m.medians)) if m.seeds else None
    return StabilityEntry(arm, quantity, value, None, len(m.seeds), m.n_points, "; ".join(notes), dropped, *lanczos)


def _residual(points: dict[int, list[CheckpointScalars]], reads: str | None) -> float | None:
    """The median over every point of the eigenvalue's relative residual (``None``: none read or stored)."""
    if reads is None:
        return None
    relative = ratio_of(f"control_{reads}_residual", EIGENVALUES[reads])
    values = [abs(x) for rows in points.values() for x in map(relative, rows) if x is not None and np.isfinite(x)]
    return float(np.median(values)) if values else None


def stability(data: LevelData) -> list[StabilityEntry]:
    """Per arm, each edge-of-stability quantity (:data:`STABILITY_QUANTITIES`), Lanczos's residual over
    lambda_max (how far the bounded budget converged), the preconditioned sharpness over its threshold,
    and NDS / lambda_max of both directions over all parameters; each quantity that reads an eigenvalue
    over the points where it converged (:class:`StabilityEntry`)."""
    out = []
    for arm in ARMS:
        points = arm_points(data, arm)
        out += [_stability_entry(points, arm, q, _scalar(key)) for q, key in STABILITY_QUANTITIES.items()]
        residual = ratio_of("control_lambda_residual", STABILITY_QUANTITIES["lambda_max"])
        out.append(_stability_entry(points, arm, "lambda_residual_over_lambda_max", residual))
        edge = ratio_of(STABILITY_QUANTITIES["preconditioned_sharpness"], STABILITY_QUANTITIES["edge_of_stability"])
        out.append(_stability_entry(points, arm, "sharpness_over_edge", edge))
        for d in ARMS:
            over = ratio_of(f"paired_nds_{d}_all", STABILITY_QUANTITIES["lambda_max"])
            out.append(_stability_entry(points, arm, f"nds_{d}_over_lambda_max", over))
        if any(LAMBDA_MIN in row.paired for rows in points.values() for row in rows):  # (measured since issue 52)
            bottom = ratio_of(LAMBDA_MIN, STABILITY_QUANTITIES["lambda_max"])
            out.append(_stability_entry(points, arm, "lambda_min_over_lambda_max", bottom))
    return out
