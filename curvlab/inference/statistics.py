"""How sure a comparison is: seed-level intervals, two-sided tests, Holm's correction, and verdicts.

Seeds are the independent replications; the units inside a seed (matched levels of one run, or
checkpoints of a trajectory) are correlated (neighbouring levels of one run), so every interval and
test here is computed *across seeds* from one number per seed, with Student's t on n - 1 degrees of
freedom. (A two-stage bootstrap over seeds and units covered the mean 59% of the time at 2 seeds and
70% at 3 with AR(1)-correlated levels; the t interval over seeds covers 93-96%.)

Per-seed values x_1..x_n, mean x̄, standard error se = sd(x) / sqrt(n):

* **mean or difference** (:func:`mean_inference`): x̄ ± t_{n-1} se; the p-value of H0: E x = null is
  two-sided, 2 P(T_{n-1} > |x̄ - null| / se).
* **ratio** of per-seed aggregates (numerator a_i, denominator b_i; :func:`ratio_inference`):

  - every per-seed ratio r_i = a_i / b_i positive and every b_i of one sign: t interval on log r_i,
    exponentiated; the value is the geometric mean exp(mean log r_i) and H0 is log r = log null;
  - otherwise Fieller's interval with t_{n-1} on the per-seed means: the set of ρ with
    (ā - ρ b̄)² <= t² (v_aa - 2ρ v_ab + ρ² v_bb) (v: covariances of the means); the value is ā / b̄ and
    H0: ρ = null is the t test of a_i - null·b_i (the interval excludes ``null`` exactly when it rejects);
  - when Fieller's set is unbounded (the denominator's own t interval contains 0: its sign is not
    settled), no ratio is judged: the entry becomes the difference a_i - null·b_i (a_i - b_i against
    null 1) with a t interval, and says so.

  Values <= 0 are never dropped and never logged: per-unit values enter the per-seed sums as they are,
  the log is taken only of per-seed ratios that are all positive, and the others go to Fieller.

Verdicts (:func:`direction_verdict`, :func:`magnitude_verdict`):

* direction, from the Holm-adjusted p-value at ``ALPHA``: ``"greater"``/``"less"`` claims are *supported*
  when p_holm < ALPHA and the estimate lies on the claimed side of ``null``, *contradicted* when it lies
  on the other side, else *inconclusive*; an ``"about"`` claim (no effect beyond a band) is *supported*
  when its interval lies inside the band, *contradicted* when p_holm < ALPHA (it differs from ``null``)
  and its interval leaves the band, else *inconclusive*. Below ``MIN_SEEDS`` seeds there is no verdict:
  the entry is *descriptive*.
* magnitude, against the paper's number p: *larger* / *smaller* when the interval lies wholly above /
  below p (however wide: excluding p is informative); when it contains p, *consistent* unless its span
  exceeds ``MAGNITUDE_SPAN`` (x4), then *uninformative*. The span of [lo, hi] is max(|lo|, |hi|) /
  min(|lo|, |hi|) when lo and hi have the same strict sign (hi / lo for a positive ratio interval; for a
  difference, how many-fold its magnitude is pinned down), and infinite when the interval touches or
  contains 0 (it cannot tell the paper's effect from none) or is unbounded.

:func:`estimate` keeps its older interface for the descriptive tables.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import special

from curvlab.errors import CurvlabError
from curvlab.util.codec import Record

CONFIDENCE = 0.95
ALPHA = 0.05  # two-sided level of the primary family's tests, after Holm's correction
MIN_SEEDS = 3  # fewer seeds: no direction verdict (the entry is descriptive)
MAGNITUDE_SPAN = 4.0  # an interval spanning more than x4 that contains the paper's number says little
SUPPORTED, CONTRADICTED, INCONCLUSIVE, NO_CLAIM = "supported", "contradicted", "inconclusive", "no claim"
DESCRIPTIVE = "descriptive"
FEW_SEEDS = f"descriptive: fewer than {MIN_SEEDS} seeds"
NOT_MEASURED = "not measured"
CONSISTENT, LARGER, SMALLER, UNINFORMATIVE = "consistent", "larger", "smaller", "uninformative"
DIRECTIONS = ("greater", "less", "about")
LOG_T, FIELLER, DIFFERENCE_T, MEAN_T = "log-t", "fieller", "difference-t", "t"

DENOMINATOR_NOTE = "the denominator's interval contains 0 (its sign is not settled), so no ratio interval"
DIFFERENCE_NOTE = (
    "the denominator's sign is not settled (its t interval contains 0): judged as the difference "
    "numerator − denominator, not the ratio"
)

# a group's rows per seed: {seed: rows}, or a list (its positions are the seeds)
SeedRows = Mapping[int, np.ndarray] | Sequence[np.ndarray]
Groups = Mapping[str, SeedRows]
Statistic = Callable[[Mapping[str, np.ndarray]], float]


@dataclass(frozen=True)
class SeedInference:
    """One quantity inferred across seeds (module docstring): its value, 95% interval (``None`` with
    fewer than two seeds or no finite interval), two-sided p-value against ``null`` (``None`` likewise),
    the method (``"log-t"``, ``"fieller"``, ``"difference-t"``, ``"t"``), the kind of quantity it judges
    (``"ratio"``, or ``"difference"`` also when a ratio fell back to one) and the per-seed values."""

    kind: str
    method: str
    value: float
    ci95: tuple[float, float] | None
    p: float | None
    null: float
    n_seeds: int
    per_seed: tuple[float, ...]
    note: str = ""


def _t_crit(n: int, confidence: float) -> float:
    """The two-sided ``confidence`` quantile of Student's t on n - 1 degrees of freedom."""
    return float(special.stdtrit(n - 1, 0.5 + confidence / 2))  # the ufunc: scipy.stats.t.ppf costs 50x more


def _t_test(x: np.ndarray, null: float) -> tuple[float, float, float]:
    """(mean, standard error, two-sided p of H0: mean = null) of ``x`` (n >= 2)."""
    m, se = float(x.mean()), float(x.std(ddof=1) / np.sqrt(x.size))
    if se == 0.0:
        p = 1.0 if m == null else 0.0  # no spread: the data say exactly what the mean is
    else:
        p = float(2 * special.stdtr(x.size - 1, -abs(m - null) / se))
    return m, se, p


def _finite(values: Sequence[float], what: str) -> np.ndarray:
    x = np.asarray(values, dtype=float).ravel()
    if x.size == 0:
        raise CurvlabError(f"no seed to infer {what} from")
    if not np.all(np.isfinite(x)):
        raise CurvlabError(f"{what}: {int((~np.isfinite(x)).sum())} of {x.size} per-seed values are not finite")
    return x


def mean_inference(values: Sequence[float], null: float = 0.0, confidence: float = CONFIDENCE) -> SeedInference:
    """The mean of per-seed values with its t interval and the p-value of H0: E x = ``null`` (module docstring).
    One seed: the value alone.

    Raises:
        CurvlabError: no seed, or a non-finite per-seed value.
    """
    x = _finite(values, "a mean")
    if x.size < 2:
        return SeedInference("difference", MEAN_T, float(x[0]), None, None, null, 1, tuple(x.tolist()))
    m, se, p = _t_test(x, null)
    h = _t_crit(x.size, confidence) * se
    return SeedInference("difference", MEAN_T, m, (m - h, m + h), p, null, x.size, tuple(x.tolist()))


def fieller_interval(
    a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE
) -> tuple[float, float] | None:
    """Fieller's interval for E a / E b from paired per-seed values (n >= 2), with t_{n-1}:
    {ρ : (ā - ρ b̄)² <= t² (v_aa - 2ρ v_ab + ρ² v_bb)}, v the covariance matrix of the means.
    ``None`` when that set is unbounded, i.e. when b̄² <= t² v_bb (the denominator's own t interval
    contains 0)."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    n = a.size
    cov = np.cov(np.vstack([a, b]), ddof=1) / n
    t2 = _t_crit(n, confidence) ** 2
    ma, mb = a.mean(), b.mean()
    qa = mb**2 - t2 * cov[1, 1]
    if qa <= 0:
        return None
    qb = -2 * (ma * mb - t2 * cov[0, 1])
    qc = ma**2 - t2 * cov[0, 0]
    disc = max(qb**2 - 4 * qa * qc, 0.0)  # >= 0 when qa > 0 (ā / b̄ is inside); clipped for rounding
    root = np.sqrt(disc)
    return float((-qb - root) / (2 * qa)), float((-qb + root) / (2 * qa))


def ratio_inference(
    numerator: Sequence[float], denominator: Sequence[float], null: float = 1.0, confidence: float = CONFIDENCE
) -> SeedInference:
    """E a / E b from per-seed aggregates a_i, b_i: log-t, Fieller, or the difference a - null·b (module
    docstring; ``null`` > 0 for log-t, the numerator alone against 0). One seed: the ratio alone.

    Raises:
        CurvlabError: no seed, unequal lengths, or a non-finite per-seed value.
    """
    a, b = _finite(numerator, "a ratio's numerator"), _finite(denominator, "a ratio's denominator")
    if a.size != b.size:
        raise CurvlabError(f"a ratio needs one numerator per denominator, got {a.size} and {b.size}")
    n = a.size
    with np.errstate(divide="ignore", invalid="ignore"):
        r = a / b
    if n < 2:
        value = float(r[0]) if b[0] else float("nan")
        return SeedInference("ratio", LOG_T if value > 0 else FIELLER, value, None, None, null, 1, (value,))
    one_sign = bool(np.all(b > 0) or np.all(b < 0))
    if null > 0 and one_sign and np.all(r > 0):
        logs = np.log(r)
        m, se, p = _t_test(logs, float(np.log(null)))
        h = _t_crit(n, confidence) * se
        ci = (float(np.exp(m - h)), float(np.exp(m + h)))
        return SeedInference("ratio", LOG_T, float(np.exp(m)), ci, p, null, n, tuple(r.tolist()))
    ci = fieller_interval(a, b, confidence)
    if ci is not None:
        _, _, p = _t_test(a - null * b, 0.0)  # rho = null  <=>  E(a - null b) = 0
        per_seed = tuple(float(x) if np.isfinite(x) else float("nan") for x in r)
        return SeedInference("ratio", FIELLER, float(a.mean() / b.mean()), ci, p, null, n, per_seed)
    d = mean_inference(a - null * b, 0.0, confidence)
    note = DIFFERENCE_NOTE if null == 1 else f"{DIFFERENCE_NOTE} (here numerator − {null:g} × denominator)"
    if null == 0:
        note = DIFFERENCE_NOTE.replace("the difference numerator − denominator", "the numerator alone")
    return SeedInference("difference", DIFFERENCE_T, d.value, d.ci95, d.p, 0.0, n, d.per_seed, note)


@dataclass(frozen=True)
class Equivalence:
    r"""Two one-sided t tests (TOST) that per-seed ratios lie inside a band [lo, hi] around 1
    (:func:`equivalence_test`): ``p`` is the larger one-sided p, ``passed`` whether it is below ``alpha``
    (equivalently, the two-sided 1 - 2 alpha interval of the geometric mean lies inside the band)."""

    band: tuple[float, float]
    p: float | None
    passed: bool | None
    n: int
    alpha: float = ALPHA


def equivalence_test(ratios: Sequence[float], band: tuple[float, float], alpha: float = ALPHA) -> Equivalence:
    r"""TOST on the log of per-seed ratios r_i > 0, with Student's t on n - 1 degrees of freedom: with
    x_i = log r_i, mean x̄ and standard error se,

    .. math::
        p = \max\big(P(T_{n-1} > (\bar x - \log lo) / se),\ P(T_{n-1} > (\log hi - \bar x) / se)\big),

    and equivalence is shown when p < ``alpha``. Fewer than 2 seeds, or a ratio <= 0: no test (``p`` and
    ``passed`` None). A control judged this way can fail: it must *show* the ratio is near 1, which a
    wide interval does not.

    Raises:
        CurvlabError: a band that does not hold 1 inside (lo < 1 < hi), or a non-finite ratio.
    """
    lo, hi = (float(x) for x in band)
    if not 0 < lo < 1 < hi:
        raise CurvlabError(f"an equivalence band needs 0 < lo < 1 < hi, got [{lo:g}, {hi:g}]")
    r = _finite(ratios, "an equivalence test") if len(ratios) else np.asarray([], dtype=float)
    if r.size < 2 or np.any(r <= 0):
        return Equivalence((lo, hi), None, None, int(r.size), alpha)
    x = np.log(r)
    m, se = float(x.mean()), float(x.std(ddof=1) / np.sqrt(x.size))
    if se == 0.0:
        p = 0.0 if np.log(lo) < m < np.log(hi) else 1.0
    else:
        upper = float(special.stdtr(x.size - 1, -(m - np.log(lo)) / se))  # H0: mean <= log lo
        lower = float(special.stdtr(x.size - 1, -(np.log(hi) - m) / se))  # H0: mean >= log hi
        p = max(upper, lower)
    return Equivalence((lo, hi), p, bool(p < alpha), int(x.size), alpha)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values: with p_(1) <= ... <= p_(m),
    p~_(i) = max_{j <= i} min(1, (m - j + 1) p_(j)); returned in the input order. Rejecting
    p~ < alpha controls the family-wise error rate at alpha under any dependence."""
    p = np.asarray(p_values, dtype=float)
    if p.size == 0:
        return []
    if np.any(~np.isfinite(p)) or np.any((p < 0) | (p > 1)):
        raise CurvlabError(f"Holm's correction needs p-values in [0, 1], got {p.tolist()}")
    order = np.argsort(p, kind="stable")
    m = p.size
    adjusted = np.minimum(1.0, np.maximum.accumulate((m - np.arange(m)) * p[order]))
    out = np.empty(m)
    out[order] = adjusted
    return out.tolist()


def direction_verdict(
    direction: str,
    inference: SeedInference,
    p_holm: float | None,
    band: tuple[float, float] | None = None,
    alpha: float = ALPHA,
) -> str:
    """The direction verdict of a claim ``direction`` (module docstring). ``band`` (for ``"about"``)
    is on the scale of the quantity judged; an "about" claim judged as a difference (a ratio whose
    denominator's sign is not settled) has no band and can only be contradicted.

    Raises:
        CurvlabError: an unknown direction.
    """
    if direction not in DIRECTIONS:
        raise CurvlabError(f"unknown claim direction {direction!r}; choose one of {', '.join(DIRECTIONS)}")
    if inference.n_seeds < MIN_SEEDS:
        return FEW_SEEDS
    if p_holm is None or inference.ci95 is None or not np.isfinite(inference.value):
        return INCONCLUSIVE
    significant = p_holm < alpha
    if direction == "about":
        lo, hi = inference.ci95
        if band is not None and band[0] <= lo and hi <= band[1]:
            return SUPPORTED  # equivalence: a real but small difference does not contradict "about equal"
        return CONTRADICTED if significant else INCONCLUSIVE
    if not significant:
        return INCONCLUSIVE
    above = inference.value > inference.null
    return SUPPORTED if above == (direction == "greater") else CONTRADICTED


def span(ci: Sequence[float] | None) -> float:
    """How many-fold an interval is: max(|lo|, |hi|) / min(|lo|, |hi|) when lo and hi share a strict
    sign, else infinite (module docstring)."""
    if ci is None:
        return float("inf")
    lo, hi = ci
    if not (np.isfinite(lo) and np.isfinite(hi)) or lo * hi <= 0:
        return float("inf")
    return float(max(abs(lo), abs(hi)) / min(abs(lo), abs(hi)))


def magnitude_verdict(ci: Sequence[float] | None, paper: float | None, n_seeds: int | None = None) -> str | None:
    """The magnitude verdict of an interval against the paper's number (module docstring): ``None``
    without a paper number; descriptive below ``MIN_SEEDS`` seeds (when ``n_seeds`` is given);
    uninformative without a finite interval."""
    if paper is None:
        return None
    if n_seeds is not None and n_seeds < MIN_SEEDS:
        return FEW_SEEDS
    if ci is None or not (np.isfinite(ci[0]) and np.isfinite(ci[1])):
        return UNINFORMATIVE
    lo, hi = ci
    if lo > paper:
        return LARGER
    if hi < paper:
        return SMALLER
    return UNINFORMATIVE if span(ci) > MAGNITUDE_SPAN else CONSISTENT


# -- the older interface: descriptive statistics with seed-level intervals ----------------------


@dataclass(frozen=True)
class Estimate(Record):
    """A statistic on the shared seeds' data (see :func:`estimate`), with its seed-level 95% interval (``None`` with
    fewer than two seeds, a non-finite per-seed value, or a ratio whose denominator's sign is not
    settled), the number of seeds (those every group has) and of units (levels or checkpoints, summed)."""

    value: float
    ci95: tuple[float, float] | None
    n_seeds: int
    n_units: int
    failed_replicates: int = 0  # seeds whose own statistic is not finite (then there is no interval)
    # the statistic is a ratio whose denominator's own t interval over seeds contains 0
    denominator_spans_zero: bool = False
    method: str = ""  # how the interval was made (LOG_T, FIELLER, MEAN_T), "" without one
    seeds: tuple[int, ...] = ()  # the seeds it was computed from (those every group has rows for)


def by_seed(rows: SeedRows) -> dict[int, np.ndarray]:
    """One group's rows keyed by seed (a list's positions are its seeds), seeds without rows left out."""
    items = rows.items() if isinstance(rows, Mapping) else enumerate(rows)
    return {k: np.atleast_2d(np.asarray(r, dtype=float)) for k, r in items if len(r)}


def shared_seeds(groups: Groups) -> list[int]:
    """The seeds (sorted) that every group has rows for: the only ones a paired statistic can use."""
    keyed = [set(by_seed(v)) for v in groups.values()]
    return sorted(set.intersection(*keyed)) if keyed else []


def _check(groups: Groups) -> dict[str, dict[int, np.ndarray]]:
    if not groups:
        raise CurvlabError("no data to estimate from")
    keyed = {name: by_seed(seeds) for name, seeds in groups.items()}
    for name, seeds in keyed.items():
        if not seeds:
            raise CurvlabError(f"group {name!r} has no data (no seed with a level or checkpoint)")
    return keyed


def _stack(rows: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.atleast_2d(np.asarray(r, dtype=float)) for r in rows if len(r)], axis=0)


def estimate(
    groups: Groups,
    statistic: Statistic,
    *,
    confidence: float = CONFIDENCE,
    denominator: Statistic | None = None,
) -> Estimate:
    """The statistic and a seed-level interval for it: the statistic on the shared seeds' data pooled (a
    ratio's: the ratio of means), except where the interval is the t interval of per-seed values, whose mean
    is then the value (with no interval, as with one seed or a non-finite per-seed value, the pooled one).

    Only the seeds every group has rows for enter (:func:`shared_seeds`: seeds are paired by id, so a
    seed missing from one group, or without rows there, is left out of every group, never replaced by
    the next one). The statistic is also evaluated on each shared seed alone (that seed of every group).
    Without ``denominator`` the interval is the t interval of those per-seed values
    (:func:`mean_inference`); with it (the statistic is a ratio, ``denominator`` its denominator) it is
    :func:`ratio_inference` of (per-seed statistic x per-seed denominator, per-seed denominator), and
    no interval when the denominator's sign is not settled (``denominator_spans_zero``).

    Args:
        groups: ``{group: {seed: rows}}`` (or ``{group: [rows of seed 0, rows of seed 1, ...]}``), each
            rows an array ``(units, columns)``. Seeds without rows are dropped.
        statistic: ``{group: stacked rows} -> float``.
        confidence: the interval's coverage.
        denominator: for a ratio, its denominator on the same data.

    Raises:
        CurvlabError: a group with no data at all.

    No shared seed: the value is NaN (nothing is paired), with no interval.
    """
    keyed = _check(groups)
    seeds = shared_seeds(keyed)
    if not seeds:
        return Estimate(float("nan"), None, 0, 0)
    data = {k: [v[s] for s in seeds] for k, v in keyed.items()}
    with np.errstate(divide="ignore", invalid="ignore"):
        value = float(statistic({k: _stack(v) for k, v in data.items()}))
    n_seeds, ids = len(seeds), tuple(seeds)
    n_units = sum(len(r) for v in data.values() for r in v)
    if n_seeds < 2:
        return Estimate(value, None, n_seeds, n_units, seeds=ids)
    per_seed = [{k: v[i] for k, v in data.items()} for i in range(n_seeds)]
    with np.errstate(divide="ignore", invalid="ignore"):
        values = np.array([statistic(g) for g in per_seed], dtype=float)
        dens = np.array([denominator(g) for g in per_seed], dtype=float) if denominator is not None else None
    failed = int((~np.isfinite(values)).sum() + (0 if dens is None else (~np.isfinite(dens)).sum()))
    if failed:
        return Estimate(value, None, n_seeds, n_units, failed_replicates=failed, seeds=ids)
    if dens is None:
        # the value is the interval's centre, the mean of the per-seed values: for a statistic that isn't
        # linear in the rows (a ratio of sums, as rho_within) the pooled value can lie outside the interval
        inf = mean_inference(values, 0.0, confidence)
        return Estimate(inf.value, inf.ci95, n_seeds, n_units, method=MEAN_T, seeds=ids)
    inf = ratio_inference(values * dens, dens, 1.0, confidence)
    if inf.method == DIFFERENCE_T:
        return Estimate(value, None, n_seeds, n_units, denominator_spans_zero=True, seeds=ids)
    return Estimate(value, inf.ci95, n_seeds, n_units, method=inf.method, seeds=ids)


def ratio_of_means(rows: np.ndarray) -> float:
    """``sum(rows[:, 0]) / sum(rows[:, 1])``: robust to units where the denominator is near zero."""
    den = rows[:, 1].sum()
    return float(rows[:, 0].sum() / den) if den else float("nan")


def denominator_of_means(rows: np.ndarray) -> float:
    """``sum(rows[:, 1])``: the denominator of :func:`ratio_of_means`."""
    return float(rows[:, 1].sum())


def median_ratio(rows: np.ndarray) -> float:
    """The median over units of ``rows[:, 0] / rows[:, 1]``: robust to a few units of extreme size."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.nanmedian(rows[:, 0] / rows[:, 1]))


def ratio_estimates(seeds: SeedRows) -> dict[str, Estimate]:
    """Both estimates of one ratio from the same (numerator, denominator) rows, one array per seed
    (``{seed: rows}``, or a list whose positions are the seeds): ``""`` the ratio of means (the paper's kind
    of average; its denominator checked for 0) and ``"_median"`` each seed's median of its per-unit ratios,
    averaged over seeds, which one unit outside the quadratic regime (a loss spike, NDS of either sign and
    hundreds of times the usual size) cannot swing. No unit is dropped from either."""
    groups = {"units": seeds}
    of_means = estimate(
        groups, lambda g: ratio_of_means(g["units"]), denominator=lambda g: denominator_of_means(g["units"])
    )
    return {"": of_means, "_median": estimate(groups, lambda g: median_ratio(g["units"]))}


def mean(rows: np.ndarray) -> float:
    return float(rows[:, 0].mean())


def median(rows: np.ndarray) -> float:
    return float(np.median(rows[:, 0]))


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean, ``std(ddof=1) / sqrt(n)`` (NaN for fewer than two values)."""
    x = np.asarray(values, dtype=float)
    return float(x.std(ddof=1) / np.sqrt(x.size)) if x.size >= 2 else float("nan")
