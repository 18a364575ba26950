"""Exact randomization tests over seeds, the smallest p-value a design can reach, and A/A power.

Beside the Student-t model of :mod:`curvlab.inference.statistics` (one value per seed), two tests that
assume only exchangeability, computed by full enumeration (no Monte Carlo):

* **sign flip** (:func:`sign_flip_p`), one sample of per-seed values x_1..x_n against ``null``: with
  d_i = x_i - null and H0 "each d_i is symmetric about 0", every sign vector s in {-1, +1}^n is as likely
  as the observed one. The statistic is T(s) = sum_i s_i d_i (the mean, times n: the same order), and

      p_greater = #{s : T(s) >= T(1)} / 2^n,   p_less = #{s : T(s) <= T(1)} / 2^n,
      p_two-sided = #{s : |T(s)| >= |T(1)|} / 2^n.

  The identity s = 1 is counted, so p >= 2^-n. A d_i equal to 0 is kept (flipping it ties: conservative).
* **label permutation** (:func:`permutation_p`), two unpaired samples a (n_a values) and b (n_b): under
  H0 "the labels are exchangeable" each of the C(n_a + n_b, n_a) ways to choose which pooled values are
  called a is as likely; the statistic is D = mean(a) - mean(b), counted as above ("greater": a tends
  larger than b).

Ties are judged with a relative tolerance: T(s) >= T(1) is read as T(s) >= T(1) - 1e-12 * scale (scale:
sum |d_i| for the sign flip, max |pooled value| for the permutation), so that sums equal in exact
arithmetic but rounded differently (0.1 + 0.2 against 0.3) count as the ties they are.

Alternatives are ``"greater"``, ``"less"`` and ``"two-sided"``: a claim of direction ``"greater"`` or
``"less"`` (statistics' conventions) is tested one-sided in its own direction; the t model's p-values are
two-sided. With few seeds the exact tests cannot reach small p at all (:func:`sign_flip_floor`,
:func:`permutation_floor`; :func:`floor_text` writes the floor as "1/32" for tables).

A/A power (:func:`aa_power`): per-unit log values y_1..y_n ~ Normal(log factor, sd²) for n independent
units (disjoint seed pairs, or seeds), judged by the two-sided one-sample t test of H0: E y = 0 at level
alpha / n_tests, the share of simulations flagged; :func:`aa_power_closed_form` is the same from the
noncentral t: T = ȳ / (s / sqrt n) ~ t_{n-1}(δ) with δ = sqrt(n) log(factor) / sd, and

    power = P(|T| > c) = 1 - F_{n-1,δ}(c) + F_{n-1,δ}(-c),   c = t_{n-1}^{-1}(1 - alpha / (2 n_tests)).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
from scipy import special, stats

from curvlab.errors import CurvlabError

ALTERNATIVES = ("greater", "less", "two-sided")
MAX_SIGN_FLIP_N = 20  # 2^20 sign vectors: we never run more seeds than that
MAX_RELABELINGS = 10**6  # C(20, 10) = 184756 fits; C(24, 12) = 2704156 does not
RTOL = 1e-12  # ties: rounding of a sum of n <= 20 terms is ~n eps ≈ 4e-15 of its scale, far below this
_BLOCK = 1 << 15  # relabelings per vectorised block (bounds memory at ~1e6 relabelings)
AA_FACTORS = (1.5, 2.0)


def _values(values: Sequence[float], what: str) -> np.ndarray:
    x = np.asarray(values, dtype=float).ravel()
    if x.size == 0:
        raise CurvlabError(f"{what} needs at least one value, got none")
    if not np.all(np.isfinite(x)):
        raise CurvlabError(f"{what}: {int((~np.isfinite(x)).sum())} of {x.size} values are not finite")
    return x


def _alternative(alternative: str) -> str:
    if alternative not in ALTERNATIVES:
        raise CurvlabError(f"unknown alternative {alternative!r}; choose one of {', '.join(ALTERNATIVES)}")
    return alternative


def _share(stat: np.ndarray, observed: float, tol: float, alternative: str) -> int:
    """How many of ``stat`` are at least as extreme as ``observed`` in the ``alternative``'s direction."""
    if alternative == "greater":
        return int(np.count_nonzero(stat >= observed - tol))
    if alternative == "less":
        return int(np.count_nonzero(stat <= observed + tol))
    return int(np.count_nonzero(np.abs(stat) >= abs(observed) - tol))


# -- exact tests ----------------------------------------------------------------------------------


def sign_flip_p(values: Sequence[float], null: float = 0.0, alternative: str = "greater") -> float:
    """The exact sign-flip p-value of H0: the per-seed d_i = values_i - null are symmetric about 0 (module
    docstring). The 2^n sums are built by doubling: after k values, the 2^k partial sums over the first k
    signs, [S + d_k, S - d_k] next; 2^20 sums take 8 MB.

    Raises:
        CurvlabError: no value, a non-finite value or ``null``, more than ``MAX_SIGN_FLIP_N`` values,
        or an unknown alternative.
    """
    alternative = _alternative(alternative)
    x = _values(values, "a sign-flip test")
    if not math.isfinite(null):
        raise CurvlabError(f"a sign-flip test needs a finite null, got {null}")
    if x.size > MAX_SIGN_FLIP_N:
        raise CurvlabError(
            f"a sign-flip test enumerates 2^n sign vectors: at most {MAX_SIGN_FLIP_N} values, got {x.size}"
        )
    d = x - null
    sums = np.zeros(1)
    for di in d:
        sums = np.concatenate([sums + di, sums - di])  # sums[0] keeps every sign +: the observed sum
    tol = RTOL * float(np.abs(d).sum())
    return _share(sums, float(sums[0]), tol, alternative) / sums.size


def permutation_p(a: Sequence[float], b: Sequence[float], alternative: str = "greater") -> float:
    """The exact two-sample label-permutation p-value of mean(a) - mean(b) (unpaired; module docstring),
    the observed labelling included (so p >= 1 / C(n_a + n_b, n_a)).

    Raises:
        CurvlabError: an empty sample, a non-finite value, more than ``MAX_RELABELINGS`` relabelings, or
        an unknown alternative.
    """
    alternative = _alternative(alternative)
    xa, xb = _values(a, "a permutation test's first sample"), _values(b, "a permutation test's second sample")
    na, nb = xa.size, xb.size
    total_labelings = math.comb(na + nb, na)
    if total_labelings > MAX_RELABELINGS:
        raise CurvlabError(
            f"a permutation test of {na} vs {nb} values has {total_labelings} relabelings; "
            f"at most {MAX_RELABELINGS} are enumerated"
        )
    z = np.concatenate([xa, xb])
    total = float(z.sum())
    # combinations() yields range(na) first: the observed labelling, computed the way every other one is
    observed = float(xa.sum() / na - (total - xa.sum()) / nb)
    tol = RTOL * float(np.abs(z).max())
    combos = itertools.combinations(range(na + nb), na)
    count = 0
    while block := list(itertools.islice(combos, _BLOCK)):
        sa = z[np.asarray(block, dtype=np.intp)].sum(axis=1)
        count += _share(sa / na - (total - sa) / nb, observed, tol, alternative)
    return count / total_labelings


# -- what a design can reach ------------------------------------------------------------------------


def sign_flip_floor(n: int, alternative: str = "greater") -> float:
    """The smallest p-value :func:`sign_flip_p` can give with n values: 1/2^n one-sided (reached when
    every d_i > 0 for "greater": the identity alone attains the largest sum), 2/2^n two-sided (s and -s
    always give the same |sum|, so the count is even; reached when every d_i is nonzero: only ±1 attain
    sum |d_i|).

    Raises:
        CurvlabError: n < 1 or n > ``MAX_SIGN_FLIP_N``, or an unknown alternative.
    """
    alternative = _alternative(alternative)
    if not 1 <= n <= MAX_SIGN_FLIP_N:
        raise CurvlabError(f"a sign-flip test takes 1 to {MAX_SIGN_FLIP_N} values, got n = {n}")
    return (2.0 if alternative == "two-sided" else 1.0) / 2.0**n


def permutation_floor(n_a: int, n_b: int, alternative: str = "greater") -> float:
    """The smallest p-value :func:`permutation_p` can give with samples of n_a and n_b values, C the
    number of relabelings C(n_a + n_b, n_a):

    * one-sided: 1/C, reached when every a exceeds every b ("greater"): the difference of means is
      sum_a (1/n_a + 1/n_b) - total/n_b, increasing in the a-sum, which only the observed labelling
      maximises;
    * two-sided with n_a == n_b: 2/C. Swapping the labels maps D to -D and is another labelling, so the
      labellings with |D| >= |D_obs| come in pairs; reached when every a exceeds every b.
    * two-sided with n_a != n_b: 1/C. The swap is no labelling of the design, and the largest and the
      smallest D differ in size: with every a far above every b (a ≫ b), D_max ≈ a while
      |D_min| ≈ a·min(n_a, n_b)/max(n_a, n_b), so the observed labelling is alone.

    Raises:
        CurvlabError: an empty sample, more than ``MAX_RELABELINGS`` relabelings, or an unknown
        alternative.
    """
    alternative = _alternative(alternative)
    if n_a < 1 or n_b < 1:
        raise CurvlabError(f"a permutation test needs both samples non-empty, got {n_a} and {n_b} values")
    c = math.comb(n_a + n_b, n_a)
    if c > MAX_RELABELINGS:
        raise CurvlabError(f"a permutation test of {n_a} vs {n_b} values has {c} relabelings (> {MAX_RELABELINGS})")
    return (2.0 if alternative == "two-sided" and n_a == n_b else 1.0) / c


def floor_text(p_min: float) -> str:
    """A p-value floor as the exact fraction it is, ``"1/32"`` for 0.03125, ``"1/126"`` for 2/252, ``"1"``
    for 1. Every floor here is 1/m: 2/2^n = 1/2^(n-1), and 2/C(2k, k) = 1/(C(2k, k)/2), C(2k, k) being
    even; a value that is no 1/m (within 1e-9 of itself) is written ``f"{p_min:.3g}"``.

    Raises:
        CurvlabError: ``p_min`` not in (0, 1].
    """
    if not (math.isfinite(p_min) and 0.0 < p_min <= 1.0):
        raise CurvlabError(f"a p-value floor lies in (0, 1], got {p_min}")
    m = round(1.0 / p_min)
    if abs(1.0 / m - p_min) > 1e-9 * p_min:
        return f"{p_min:.3g}"
    return "1" if m == 1 else f"1/{m}"


# -- A/A power -----------------------------------------------------------------------------------------


def _power_args(sd: float, n: int, factor: float, alpha: float, n_tests: int) -> float:
    """Check the arguments of the power functions; return the per-test level alpha / n_tests."""
    if n < 2:
        raise CurvlabError(f"power needs n >= 2 units (a t test on n - 1 degrees of freedom), got n = {n}")
    if not (math.isfinite(sd) and sd >= 0):
        raise CurvlabError(f"power needs a finite sd >= 0, got {sd}")
    if not (math.isfinite(factor) and factor > 0):
        raise CurvlabError(f"power needs a finite factor > 0 (its log is the effect), got {factor}")
    if not 0 < alpha < 1:
        raise CurvlabError(f"power needs a level alpha in (0, 1), got {alpha}")
    if n_tests < 1:
        raise CurvlabError(f"power needs n_tests >= 1, got {n_tests}")
    return alpha / n_tests


def aa_power(
    sd: float, n: int, factor: float, alpha: float = 0.05, n_tests: int = 1, sims: int = 20000, seed: int = 0
) -> float:
    """The share of ``sims`` simulated designs that the two-sided one-sample t test flags (module
    docstring; z from ``Generator(PCG64(seed))``), as :mod:`curvlab.inference.statistics` tests. Bonferroni's alpha /
    n_tests stands in for Holm's correction over the n_tests claims of a family: conservative, since Holm's first step
    is exactly Bonferroni and each later step is no stricter. ``factor`` 1 gives the test's size, about alpha / n_tests.

    sd == 0: no spread, so the mean decides (as statistics' t test does): power 1 when factor != 1, else 0.
    The same ``seed`` gives the same z for every factor (common random numbers: power rises with factor).

    Raises:
        CurvlabError: n < 2, sd < 0, factor <= 0, alpha outside (0, 1), n_tests < 1 or sims < 1.
    """
    level = _power_args(sd, n, factor, alpha, n_tests)
    if sims < 1:
        raise CurvlabError(f"power needs sims >= 1 simulations, got {sims}")
    if sd == 0:
        return 0.0 if factor == 1 else 1.0
    z = np.random.Generator(np.random.PCG64(seed)).standard_normal((sims, n))
    y = math.log(factor) + sd * z
    t = y.mean(axis=1) / (y.std(axis=1, ddof=1) / math.sqrt(n))
    p = 2 * special.stdtr(n - 1, -np.abs(t))
    return float(np.count_nonzero(p < level) / sims)


def aa_power_closed_form(sd: float, n: int, factor: float, alpha: float = 0.05, n_tests: int = 1) -> float:
    """The power :func:`aa_power` estimates, from the noncentral t (module docstring). sd == 0 as in
    :func:`aa_power`.

    Raises:
        CurvlabError: as :func:`aa_power`.
    """
    level = _power_args(sd, n, factor, alpha, n_tests)
    if sd == 0:
        return 0.0 if factor == 1 else 1.0
    df, delta = n - 1, math.sqrt(n) * math.log(factor) / sd
    c = float(stats.t.ppf(1 - level / 2, df))
    # P(T < -c) as the upper tail at -delta: scipy's nct.cdf returns NaN that far out (delta ~ 40)
    return float(stats.nct.sf(c, df, delta) + stats.nct.sf(c, df, -delta))


def aa_power_table(
    sd: float,
    n: int,
    alpha: float = 0.05,
    n_tests: int = 1,
    sims: int = 20000,
    seed: int = 0,
    factors: Sequence[float] = AA_FACTORS,
) -> dict[str, float]:
    """:func:`aa_power` at each factor, keyed ``"x1.5"``, ``"x2"`` (``f"x{factor:g}"``), all from the same
    seed (common random numbers).

    Raises:
        CurvlabError: as :func:`aa_power`.
    """
    return {f"x{f:g}": aa_power(sd, n, f, alpha, n_tests, sims, seed) for f in factors}
