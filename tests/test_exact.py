"""Exact sign-flip and permutation tests against hand enumeration in exact arithmetic, their floors, and
the A/A power simulation against the noncentral-t closed form."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from curvlab.errors import CurvlabError
from curvlab.inference import exact_tests as exact

# decimal strings: Fraction(s) is the value meant, float(s) what the code sees. The 0.1-steps make sums
# that tie exactly but round differently in floats (0.1 + 0.2 vs 0.3), the integers make plain ties.
SIGN_CASES = [
    (["1", "2", "3", "4", "5"], "0"),
    (["1", "-2", "3", "4", "5"], "0"),
    (["0.1", "0.2", "0.3", "0.4", "0.5"], "0"),
    (["0.3", "-0.1", "0.2", "0.2", "-0.4"], "0"),
    (["2", "2", "-1", "0", "3"], "0"),  # a tie between values and a zero
    (["1.1", "1.3", "0.9", "1.2", "1.0"], "1.0"),  # against a null, one value on it
    (["-0.7", "-1.3", "-0.2", "-2.5", "-0.1"], "0"),
]
PERM_CASES = [
    (["1", "2", "3", "4", "5"], ["6", "7", "8", "9", "10"]),
    (["0.1", "0.2", "0.7"], ["0.3", "0.4", "0.5", "0.6"]),  # equal-sum relabelings that round differently
    (["3", "-1", "2", "2"], ["2", "0", "-1"]),
    (["1.5", "-0.5", "2.5", "0.5", "-1.5"], ["0.5", "1.5", "-2.5", "0.0", "1.0"]),
]


def _extreme(stat, observed, alternative):
    if alternative == "greater":
        return stat >= observed
    if alternative == "less":
        return stat <= observed
    return abs(stat) >= abs(observed)


def _hand_sign_flip(values, null, alternative):
    d = [Fraction(v) - Fraction(null) for v in values]
    observed = sum(d)
    hits = total = 0
    for signs in itertools.product((-1, 1), repeat=len(d)):
        total += 1
        hits += _extreme(sum(s * x for s, x in zip(signs, d)), observed, alternative)
    return Fraction(hits, total)


def _hand_permutation(a, b, alternative):
    pooled = [Fraction(v) for v in a + b]
    na, nb = len(a), len(b)

    def diff(idx):
        in_a = [pooled[i] for i in idx]
        rest = [pooled[i] for i in range(len(pooled)) if i not in idx]
        return sum(in_a) / na - sum(rest) / nb

    observed = diff(tuple(range(na)))
    hits = total = 0
    for idx in itertools.combinations(range(na + nb), na):
        total += 1
        hits += _extreme(diff(idx), observed, alternative)
    return Fraction(hits, total)


@pytest.mark.parametrize("alternative", exact.ALTERNATIVES)
@pytest.mark.parametrize(("values", "null"), SIGN_CASES)
def test_sign_flip_matches_hand_enumeration(values, null, alternative):
    p = exact.sign_flip_p([float(v) for v in values], float(null), alternative)
    assert p == float(_hand_sign_flip(values, null, alternative))


@pytest.mark.parametrize("alternative", exact.ALTERNATIVES)
@pytest.mark.parametrize(("a", "b"), PERM_CASES)
def test_permutation_matches_hand_enumeration(a, b, alternative):
    p = exact.permutation_p([float(v) for v in a], [float(v) for v in b], alternative)
    assert p == float(_hand_permutation(a, b, alternative))
    # swapping the samples mirrors the one-sided alternatives and keeps the two-sided one
    mirror = {"greater": "less", "less": "greater", "two-sided": "two-sided"}[alternative]
    assert exact.permutation_p([float(v) for v in b], [float(v) for v in a], mirror) == p


def test_float_ties_count_as_ties():
    # +0.1 +0.2 -0.3 ... and the sign vectors that trade 0.3 for 0.1 + 0.2 tie exactly; in floats
    # 0.1 + 0.2 > 0.3, so without the tolerance some ties would be lost or gained
    values = [0.1, 0.2, 0.3, 0.4, 0.5]
    assert (0.1 + 0.2) - 0.3 != 0.0
    assert exact.sign_flip_p(values, 0.3, "greater") == float(
        _hand_sign_flip(["0.1", "0.2", "0.3", "0.4", "0.5"], "0.3", "greater")
    )


def test_sign_flip_by_hand():
    assert exact.sign_flip_p([1, 2, 3, 4, 5]) == 1 / 32
    # [1, -2, 3, 4, 5], sum 11: flipping the set F changes the sum by -2 sum(F), so ">= 11" needs
    # sum(F) <= 0: F = {}, {-2}, {1, -2} -> 3; "<= 11" fails only for sum(F) < 0: {-2}, {1, -2} -> 32 - 2
    assert exact.sign_flip_p([1, -2, 3, 4, 5], 0.0, "greater") == 3 / 32
    assert exact.sign_flip_p([1, -2, 3, 4, 5], 0.0, "two-sided") == 6 / 32  # and their 3 mirror images
    assert exact.sign_flip_p([1, -2, 3, 4, 5], 0.0, "less") == 30 / 32
    assert exact.sign_flip_p([0, 0, 0], 0.0, "two-sided") == 1.0  # every sign vector ties
    assert exact.sign_flip_p([3.0, 3.0], 3.0, "greater") == 1.0


def test_permutation_by_hand():
    # 10 relabelings of 3 vs 2; only the observed one puts {3, 4, 5} in a
    assert exact.permutation_p([3, 4, 5], [1, 2], "greater") == 1 / 10
    assert exact.permutation_p([3, 4, 5], [1, 2], "less") == 1.0
    # a = [10] vs b = [0, 1]: differences 9.5, -5.5, -4.0: two-sided, only the observed is as extreme
    assert exact.permutation_p([10], [0, 1], "two-sided") == 1 / 3
    assert exact.permutation_p([2], [0, 1.9], "two-sided") == 2 / 3  # 1.05, -1.95, 0.9


@pytest.mark.parametrize("n", [1, 2, 5, 6, 8, 12])
@pytest.mark.parametrize("alternative", exact.ALTERNATIVES)
def test_sign_flip_floor_is_reached(n, alternative):
    rng = np.random.default_rng(n)
    x = np.sort(rng.uniform(0.5, 2.0, n))  # every value positive and distinct
    sample = -x if alternative == "less" else x
    assert exact.sign_flip_p(sample, 0.0, alternative) == exact.sign_flip_floor(n, alternative)


def test_sign_flip_floor_values():
    assert exact.sign_flip_floor(5, "greater") == 1 / 32
    assert exact.sign_flip_floor(6, "less") == 1 / 64
    assert exact.sign_flip_floor(8, "greater") == 1 / 256
    assert exact.sign_flip_floor(5, "two-sided") == 2 / 32
    assert exact.sign_flip_floor(20, "greater") == 2.0**-20


@pytest.mark.parametrize(("na", "nb"), [(5, 5), (3, 3), (3, 5), (5, 2), (1, 4), (6, 6)])
@pytest.mark.parametrize("alternative", exact.ALTERNATIVES)
def test_permutation_floor_is_reached(na, nb, alternative):
    a = 1000.0 + np.arange(na)  # every a far above every b
    b = np.arange(nb) * 0.5
    if alternative == "less":
        a, b = -a, -b
    c = math.comb(na + nb, na)
    floor = exact.permutation_floor(na, nb, alternative)
    assert floor == (2 if alternative == "two-sided" and na == nb else 1) / c
    assert exact.permutation_p(a, b, alternative) == floor


def test_permutation_floor_values():
    assert exact.permutation_floor(5, 5, "greater") == 1 / 252
    assert exact.permutation_floor(5, 5, "two-sided") == 2 / 252
    assert exact.permutation_floor(3, 5, "two-sided") == 1 / 56


def test_two_sided_equal_sizes_never_below_floor():
    # n_a == n_b: swapping labels maps D to -D, so no sample goes below 2/C
    rng = np.random.default_rng(3)
    floor = exact.permutation_floor(4, 4, "two-sided")
    ps = [
        exact.permutation_p(rng.normal(size=4) + 3 * rng.uniform(), rng.normal(size=4), "two-sided") for _ in range(50)
    ]
    assert min(ps) >= floor
    assert floor == 2 / 70


def test_floor_text():
    assert exact.floor_text(0.03125) == "1/32"
    assert exact.floor_text(exact.sign_flip_floor(8, "greater")) == "1/256"
    assert exact.floor_text(exact.sign_flip_floor(20, "greater")) == "1/1048576"
    assert exact.floor_text(exact.permutation_floor(5, 5, "greater")) == "1/252"
    assert exact.floor_text(exact.permutation_floor(5, 5, "two-sided")) == "1/126"
    assert exact.floor_text(exact.permutation_floor(10, 10, "greater")) == "1/184756"
    assert exact.floor_text(3 / 70) == "0.0429"  # no floor of these designs
    assert exact.floor_text(1.0) == "1"
    assert exact.floor_text(0.0371234567) == "0.0371"
    for bad in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(CurvlabError, match="floor"):
            exact.floor_text(bad)


@pytest.mark.parametrize(
    ("sd", "n", "factor", "n_tests"),
    [(0.3, 5, 1.5, 1), (0.5, 8, 1.5, 3), (0.8, 4, 2.0, 1), (0.2, 3, 1.2, 2), (1.0, 10, 0.6, 1)],
)
def test_aa_power_matches_noncentral_t(sd, n, factor, n_tests):
    sims = 20000
    sim = exact.aa_power(sd, n, factor, 0.05, n_tests, sims, seed=1)
    closed = exact.aa_power_closed_form(sd, n, factor, 0.05, n_tests)
    se = math.sqrt(closed * (1 - closed) / sims)
    assert 0.05 < closed < 0.99  # the settings are informative: neither no power nor certain
    assert abs(sim - closed) <= 3 * se


@pytest.mark.parametrize(("n", "n_tests"), [(3, 1), (6, 1), (5, 2)])
def test_aa_power_factor_one_is_the_level(n, n_tests):
    sims = 40000
    level = 0.05 / n_tests
    assert exact.aa_power_closed_form(0.4, n, 1.0, 0.05, n_tests) == pytest.approx(level, rel=1e-9)
    sim = exact.aa_power(0.4, n, 1.0, 0.05, n_tests, sims, seed=2)
    assert abs(sim - level) <= 3 * math.sqrt(level * (1 - level) / sims)


def test_aa_power_reproducible_and_monotone():
    assert exact.aa_power(0.5, 5, 1.5, seed=7) == exact.aa_power(0.5, 5, 1.5, seed=7)
    table = exact.aa_power_table(0.5, 5, 0.05, 1, 5000, seed=7)
    assert set(table) == {"x1.5", "x2"}
    assert table["x1.5"] == exact.aa_power(0.5, 5, 1.5, 0.05, 1, 5000, 7)
    assert table["x2"] == exact.aa_power(0.5, 5, 2.0, 0.05, 1, 5000, 7)
    assert table["x1.5"] < table["x2"]  # common random numbers: a larger effect flags at least as often
    # more claims in the family: a stricter level, less power
    assert exact.aa_power(0.5, 5, 1.5, 0.05, 4, 5000, 7) < table["x1.5"]


def test_aa_power_without_spread():
    assert exact.aa_power(0.0, 4, 1.5) == 1.0
    assert exact.aa_power(0.0, 4, 1.0) == 0.0
    assert exact.aa_power_closed_form(0.0, 4, 0.8) == 1.0
    assert exact.aa_power_closed_form(0.0, 4, 1.0) == 0.0


def test_errors():
    with pytest.raises(CurvlabError, match="at most 20"):
        exact.sign_flip_p(np.ones(21))
    with pytest.raises(CurvlabError, match="20"):
        exact.sign_flip_floor(21)
    with pytest.raises(CurvlabError, match="relabelings"):
        exact.permutation_p(np.arange(13.0), np.arange(13.0))
    with pytest.raises(CurvlabError, match="relabelings"):
        exact.permutation_floor(13, 13)
    with pytest.raises(CurvlabError, match="none"):
        exact.sign_flip_p([])
    with pytest.raises(CurvlabError, match="none"):
        exact.permutation_p([], [1.0])
    with pytest.raises(CurvlabError, match="none"):
        exact.permutation_p([1.0], [])
    with pytest.raises(CurvlabError, match="non-empty"):
        exact.permutation_floor(0, 3)
    with pytest.raises(CurvlabError, match="1 of 3 values are not finite"):
        exact.sign_flip_p([1.0, float("nan"), 2.0])
    with pytest.raises(CurvlabError, match="not finite"):
        exact.permutation_p([1.0, 2.0], [float("inf")])
    with pytest.raises(CurvlabError, match="finite null"):
        exact.sign_flip_p([1.0, 2.0], float("nan"))
    with pytest.raises(CurvlabError, match="alternative"):
        exact.sign_flip_p([1.0, 2.0], 0.0, "about")
    with pytest.raises(CurvlabError, match="alternative"):
        exact.permutation_floor(3, 3, "two_sided")
    with pytest.raises(CurvlabError, match="n >= 2"):
        exact.aa_power(0.5, 1, 1.5)
    with pytest.raises(CurvlabError, match="n >= 2"):
        exact.aa_power_closed_form(0.5, 1, 1.5)
    with pytest.raises(CurvlabError, match="sd"):
        exact.aa_power(-0.1, 5, 1.5)
    with pytest.raises(CurvlabError, match="factor"):
        exact.aa_power(0.5, 5, 0.0)
    with pytest.raises(CurvlabError, match="n_tests"):
        exact.aa_power_table(0.5, 5, 0.05, 0)
    with pytest.raises(CurvlabError, match="sims"):
        exact.aa_power(0.5, 5, 1.5, sims=0)


def test_twenty_seeds_enumerate():
    x = np.linspace(0.1, 2.0, 20)
    assert exact.sign_flip_p(x, 0.0, "greater") == 2.0**-20
    assert exact.sign_flip_p(x, 0.0, "two-sided") == 2.0**-19
