"""How sure a comparison is: bootstrap intervals over seeds and levels, and verdicts against a claim.

A measurement here is a set of *groups* (one per run population, e.g. "AdamW and Muon at matched
loss", or "Muon at s = 0"); a group holds one array per seed, whose rows are that seed's *units*
(matched levels, or checkpoints of a trajectory) and whose columns are the numbers a statistic needs.
The statistic maps ``{group: all rows, stacked}`` to one float, e.g. a ratio of means
``sum(rows[:, 0]) / sum(rows[:, 1])``.

The interval is the percentile interval of the two-stage (hierarchical) bootstrap: each replicate
draws, independently for every group, its seeds with replacement and then, inside each drawn seed,
its units with replacement, and evaluates the statistic on the result. Seeds are the independent
replications; units inside a seed are correlated (neighbouring levels of one run), which is why seeds
are drawn first. With fewer than two seeds in any group there is no interval (``ci95`` is ``None``):
one run says nothing about run-to-run variation, and the verdict is then inconclusive.

Verdicts set an interval beside a claim (see :mod:`curvlab.paper`):

* direction ``"greater"`` (or ``"less"``) than the no-effect value ``null``: *supported* when the whole
  interval lies on the claimed side, *contradicted* when it lies wholly on the other side, else
  *inconclusive at this scale*;
* direction ``"about"`` with a band [a, b] (what counts as "about equal"): *supported* when the
  interval lies inside the band, *contradicted* when it lies wholly outside it, else inconclusive.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from curvlab.errors import CurvlabError

N_BOOT = 2000
BOOTSTRAP_SEED = 0  # fixed: a summary re-derived from the same per-level data gives the same interval
SUPPORTED, CONTRADICTED, INCONCLUSIVE, NO_CLAIM = "supported", "contradicted", "inconclusive at this scale", "no claim"
DIRECTIONS = ("greater", "less", "about")

DENOMINATOR_NOTE = "the denominator's interval contains 0, so the ratio's interval means little"

Groups = Mapping[str, Sequence[np.ndarray]]
Statistic = Callable[[Mapping[str, np.ndarray]], float]


@dataclass(frozen=True)
class Estimate:
    """A statistic with its 95% bootstrap interval (``None`` with fewer than two seeds in a group),
    the number of seeds (the smallest over groups) and of units (levels or checkpoints, summed)."""

    value: float
    ci95: tuple[float, float] | None
    n_seeds: int
    n_units: int
    n_boot: int
    failed_replicates: int = 0  # replicates whose statistic was not finite (e.g. an empty third)
    # the statistic is a ratio whose denominator's own interval contains 0: resamples near a zero
    # denominator make the ratio's percentiles meaningless (they may even exclude its value)
    denominator_spans_zero: bool = False

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ci95"] = None if self.ci95 is None else list(self.ci95)
        return d


def _stack(rows: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.atleast_2d(np.asarray(r, dtype=float)) for r in rows if len(r)], axis=0)


def _check(groups: Groups) -> None:
    if not groups:
        raise CurvlabError("no data to estimate from")
    for name, seeds in groups.items():
        if not seeds or not any(len(r) for r in seeds):
            raise CurvlabError(f"group {name!r} has no data (no seed with a level or checkpoint)")


def estimate(
    groups: Groups,
    statistic: Statistic,
    n_boot: int = N_BOOT,
    seed: int = BOOTSTRAP_SEED,
    confidence: float = 0.95,
    denominator: Statistic | None = None,
) -> Estimate:
    """The statistic on all the data, and its two-stage bootstrap interval (module docstring).

    Args:
        groups: ``{group: [rows of seed 0, rows of seed 1, ...]}``, each an array ``(units, columns)``.
            Seeds without rows are dropped.
        statistic: ``{group: stacked rows} -> float``.
        n_boot: bootstrap replicates.
        seed: the generator's seed (fixed, so the interval is reproducible from the same data).
        denominator: for a ratio, its denominator on the same data; its interval, from the same
            replicates, is checked for 0 (``Estimate.denominator_spans_zero``).

    Raises:
        CurvlabError: a group with no data at all.
    """
    _check(groups)
    data = {k: [np.atleast_2d(np.asarray(r, dtype=float)) for r in v if len(r)] for k, v in groups.items()}
    value = float(statistic({k: _stack(v) for k, v in data.items()}))
    n_seeds = min(len(v) for v in data.values())
    n_units = sum(len(r) for v in data.values() for r in v)
    if n_seeds < 2:
        return Estimate(value, None, n_seeds, n_units, 0)
    rng = np.random.default_rng(seed)
    stacked = {k: _stack(v) for k, v in data.items()}
    sizes = {k: np.array([len(r) for r in v]) for k, v in data.items()}
    offsets = {k: np.concatenate([[0], np.cumsum(n)[:-1]]) for k, n in sizes.items()}
    reps, den_reps = np.empty(n_boot), np.empty(n_boot)
    for b in range(n_boot):
        drawn = {}
        for k, n in sizes.items():
            picks = rng.integers(0, len(n), len(n))  # seeds, with replacement
            counts = n[picks]
            within = np.floor(rng.random(counts.sum()) * np.repeat(counts, counts)).astype(int)  # units in each
            drawn[k] = stacked[k][np.repeat(offsets[k][picks], counts) + within]
        reps[b] = statistic(drawn)
        den_reps[b] = denominator(drawn) if denominator is not None else 1.0
    tail = 100 * (1 - confidence) / 2
    den_lo, den_hi = np.percentile(den_reps, [tail, 100 - tail])
    spans_zero = denominator is not None and bool(den_lo <= 0 <= den_hi)
    finite = reps[np.isfinite(reps)]
    if finite.size < n_boot // 2:
        return Estimate(value, None, n_seeds, n_units, n_boot, n_boot - finite.size, spans_zero)
    lo, hi = np.percentile(finite, [tail, 100 - tail])
    return Estimate(value, (float(lo), float(hi)), n_seeds, n_units, n_boot, n_boot - finite.size, spans_zero)


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


def ratio_estimates(seeds: Sequence[np.ndarray], n_boot: int = N_BOOT) -> dict[str, Estimate]:
    """Both estimates of one ratio from the same (numerator, denominator) rows, one array per seed:
    ``""`` the ratio of means (the paper's kind of average; its denominator checked for 0) and
    ``"_median"`` the median of the per-unit ratios, which one unit outside the quadratic regime (a
    loss spike, NDS of either sign and hundreds of times the usual size) cannot swing. No unit is
    dropped from either."""
    groups = {"units": seeds}
    return {
        "": estimate(
            groups,
            lambda g: ratio_of_means(g["units"]),
            n_boot,
            denominator=lambda g: denominator_of_means(g["units"]),
        ),
        "_median": estimate(groups, lambda g: median_ratio(g["units"]), n_boot),
    }


def mean(rows: np.ndarray) -> float:
    return float(rows[:, 0].mean())


def median(rows: np.ndarray) -> float:
    return float(np.median(rows[:, 0]))


def verdict(direction: str | None, ci95: Sequence[float] | None, null: float = 0.0, band=None) -> str:
    """The verdict of an interval on a claim (module docstring); ``NO_CLAIM`` when ``direction`` is None.

    Raises:
        CurvlabError: an unknown direction, or ``"about"`` without a band.
    """
    if direction is None:
        return NO_CLAIM
    if direction not in DIRECTIONS:
        raise CurvlabError(f"unknown claim direction {direction!r}; choose one of {', '.join(DIRECTIONS)}")
    if ci95 is None:
        return INCONCLUSIVE
    lo, hi = ci95
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return INCONCLUSIVE
    if direction == "about":
        if band is None:
            raise CurvlabError("an 'about' claim needs a band [a, b]")
        a, b = band
        if a <= lo and hi <= b:
            return SUPPORTED
        return CONTRADICTED if hi < a or lo > b else INCONCLUSIVE
    above, below = lo > null, hi < null
    if direction == "greater":
        return SUPPORTED if above else CONTRADICTED if below else INCONCLUSIVE
    return SUPPORTED if below else CONTRADICTED if above else INCONCLUSIVE


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean, ``std(ddof=1) / sqrt(n)`` (NaN for fewer than two values)."""
    x = np.asarray(values, dtype=float)
    return float(x.std(ddof=1) / np.sqrt(x.size)) if x.size >= 2 else float("nan")
