import functools

import numpy as np
import pytest
from scipy import stats as scipy_stats

from curvlab.errors import CurvlabError
from curvlab.inference import statistics
from tests.synthetic import ar1

# The simulated experiments of the issue: 6 levels per seed, AR(1) correlation 0.7 between neighbouring
# levels, and a seed effect; 1000 experiments per number of seeds.
LEVELS, RHO, EXPERIMENTS = 6, 0.7, 1000


def _positive_units(rng, n_seeds, n_experiments, log_ratio=0.5):
    """(numerator, denominator) units, shape (experiments, seeds, levels): NDS-like positive values
    with multiplicative seed effects (sd 0.4 and 0.3 in log) and AR(1) level noise (sd 0.5 in log)."""
    shape = (n_experiments, n_seeds, 1)
    den = np.exp(
        rng.normal(0, 0.3, shape) + ar1(rng, LEVELS, RHO, 0.5, n_experiments * n_seeds).reshape(*shape[:2], -1)
    )
    noise = ar1(rng, LEVELS, RHO, 0.5, n_experiments * n_seeds).reshape(*shape[:2], -1)
    num = den * np.exp(log_ratio + rng.normal(0, 0.4, shape) + noise)
    return num, den


@functools.cache
def _truth_log_ratio(log_ratio=0.5):
    """E log(mean num / mean den) of one seed (the log-t interval's target), by a large simulation."""
    num, den = _positive_units(np.random.default_rng(99), 1, 400_000, log_ratio)
    return float(np.mean(np.log(num.mean(-1) / den.mean(-1))))


@pytest.mark.parametrize("n_seeds", [2, 3, 5, 6])
def test_seed_level_intervals_cover_at_the_presets_sizes(n_seeds):
    """The shipped intervals cover the truth >= 93% of the time with AR(1) levels and seed effects:
    the ratio (log-t on per-seed ratios of means; truth from a 400k-seed simulation), the mean (t; the
    truth is exact), and Fieller's ratio on per-seed means of either sign (truth mu_a / mu_b, exact)."""
    rng = np.random.default_rng(n_seeds)
    truth = _truth_log_ratio()
    num, den = _positive_units(rng, n_seeds, EXPERIMENTS)
    covered = 0
    for a, b in zip(num.mean(-1), den.mean(-1)):
        inf = statistics.ratio_inference(a, b)
        assert inf.method == statistics.LOG_T
        covered += inf.ci95[0] <= np.exp(truth) <= inf.ci95[1]
    assert covered / EXPERIMENTS >= 0.93

    x = (
        2.0
        + rng.normal(0, 1.0, (EXPERIMENTS, n_seeds, 1))
        + ar1(rng, LEVELS, RHO, 0.5, EXPERIMENTS * n_seeds).reshape(EXPERIMENTS, n_seeds, LEVELS)
    )
    covered = sum(lo <= 2.0 <= hi for lo, hi in (statistics.mean_inference(v.mean(-1)).ci95 for v in x))
    assert covered / EXPERIMENTS >= 0.93

    # numerators of either sign (NDS can be negative), a denominator of settled sign: Fieller's interval
    shape = (EXPERIMENTS, n_seeds)
    a = 0.3 + rng.normal(0, 0.3, shape) + ar1(rng, LEVELS, RHO, 0.3, EXPERIMENTS * n_seeds).reshape(*shape, -1).mean(-1)
    b = 1.0 + 0.05 * (a - 0.3) + rng.normal(0, 0.01, shape)  # correlated with the numerator, as paired NDS are
    methods = [statistics.ratio_inference(ai, bi).method for ai, bi in zip(a, b)]
    assert methods.count(statistics.FIELLER) >= 0.2 * EXPERIMENTS  # the shipped path for seeds of either sign
    ci = [statistics.fieller_interval(ai, bi) for ai, bi in zip(a, b)]
    assert all(c is not None for c in ci)
    assert np.mean([lo <= 0.3 <= hi for lo, hi in ci]) >= 0.93


@pytest.mark.parametrize("n_seeds", [3, 5, 6])
def test_false_verdict_rate_without_an_effect(n_seeds):
    """No true effect (numerator and denominator exchangeable): the share of direction verdicts is at
    most 5% plus three binomial standard errors of 2000 experiments (sqrt(0.05 * 0.95 / 2000) = 0.0049),
    for a single claim and for a Holm-corrected family of three."""
    rng = np.random.default_rng(10 + n_seeds)
    n = 2000
    num, den = _positive_units(rng, n_seeds, n, log_ratio=0.0)
    slack = 3 * np.sqrt(0.05 * 0.95 / n)
    verdicts = []
    for a, b in zip(num.mean(-1), den.mean(-1)):
        inf = statistics.ratio_inference(a, b)
        verdicts.append(statistics.direction_verdict("greater", inf, inf.p))
    assert np.mean([v != statistics.INCONCLUSIVE for v in verdicts]) <= 0.05 + slack
    family = []
    for k in range(0, n - 2, 3):  # three independent claims per family
        infs = [statistics.ratio_inference(num[j].mean(-1), den[j].mean(-1)) for j in (k, k + 1, k + 2)]
        adjusted = statistics.holm([i.p for i in infs])
        family.append(
            any(
                statistics.direction_verdict("greater", i, p) != statistics.INCONCLUSIVE for i, p in zip(infs, adjusted)
            )
        )
    assert np.mean(family) <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / len(family))  # family-wise error


def test_two_seeds_are_descriptive_but_keep_their_interval():
    inf = statistics.ratio_inference([2.0, 3.0], [1.0, 1.0])
    assert inf.ci95 is not None and inf.n_seeds == 2 and inf.method == statistics.LOG_T
    assert statistics.direction_verdict("greater", inf, 1e-6) == statistics.FEW_SEEDS
    assert statistics.magnitude_verdict(inf.ci95, 2.0, inf.n_seeds) == statistics.FEW_SEEDS


def test_log_t_and_mean_intervals_match_scipy():
    """Against scipy's one-sample t test and its confidence interval."""
    r = np.array([2.1, 2.9, 1.7, 2.4])
    inf = statistics.ratio_inference(r, np.ones(4))
    ref = scipy_stats.ttest_1samp(np.log(r), 0.0)
    lo, hi = ref.confidence_interval(0.95)
    assert inf.ci95 == pytest.approx((np.exp(lo), np.exp(hi)), rel=1e-12)
    assert inf.value == pytest.approx(np.exp(np.log(r).mean())) and inf.p == pytest.approx(ref.pvalue)
    x = np.array([0.3, -0.1, 0.5, 0.2, 0.4])
    m = statistics.mean_inference(x, null=0.1)
    ref = scipy_stats.ttest_1samp(x, 0.1)
    assert m.ci95 == pytest.approx(tuple(ref.confidence_interval(0.95)), rel=1e-12)
    assert m.p == pytest.approx(ref.pvalue) and m.value == pytest.approx(x.mean())


def test_fieller_endpoints_solve_its_defining_equation():
    """At each end rho of Fieller's interval the t statistic of a_i - rho b_i is exactly t_{n-1}
    (scipy's t test as the reference); the interval excludes 1 exactly when the test of a - b rejects."""
    a = np.array([1.2, -0.3, 0.9, 0.5, 1.6])
    b = np.array([0.8, 0.7, 1.1, 0.9, 1.0])
    lo, hi = statistics.fieller_interval(a, b)
    crit = scipy_stats.t.ppf(0.975, a.size - 1)
    for rho in (lo, hi):
        assert abs(scipy_stats.ttest_1samp(a - rho * b, 0.0).statistic) == pytest.approx(crit, rel=1e-9)
    inf = statistics.ratio_inference(a, b)
    assert inf.method == statistics.FIELLER and inf.ci95 == pytest.approx((lo, hi))
    assert inf.value == pytest.approx(a.mean() / b.mean())
    assert inf.p == pytest.approx(scipy_stats.ttest_1samp(a - b, 0.0).pvalue)
    assert (lo <= 1.0 <= hi) == (inf.p >= 0.05)


def test_a_denominator_of_unsettled_sign_is_judged_as_a_difference_never_a_wrong_signed_ratio():
    """The numerator is clearly above the denominator, but the denominator's mean is near 0 and slightly
    negative: the ratio of means (-40) would read 'AdamW below Muon'. The entry is the difference
    numerator - denominator instead, says so, and its verdict is not 'contradicted'."""
    num = np.array([1.1, 0.9, 1.0, 1.2])
    den = np.array([-0.5, 0.45, -0.3, 0.25])
    assert num.mean() / den.mean() < 0
    assert statistics.fieller_interval(num, den) is None
    inf = statistics.ratio_inference(num, den)
    assert inf.kind == "difference" and inf.method == statistics.DIFFERENCE_T and "not settled" in inf.note
    assert inf.value == pytest.approx((num - den).mean())
    assert (
        statistics.direction_verdict("greater", inf, inf.p) == statistics.SUPPORTED
    )  # AdamW's is larger, in the difference
    noisy = statistics.ratio_inference([0.2, -0.1, 0.3, -0.2], den)
    assert statistics.direction_verdict("greater", noisy, noisy.p) == statistics.INCONCLUSIVE
    assert statistics.magnitude_verdict(None, 1.76) == statistics.UNINFORMATIVE


def test_one_seed_and_bad_input():
    one = statistics.ratio_inference([3.0], [2.0])
    assert one.value == 1.5 and one.ci95 is None and one.p is None and one.n_seeds == 1
    assert statistics.direction_verdict("greater", one, None) == statistics.FEW_SEEDS
    assert statistics.mean_inference([0.4]).ci95 is None
    with pytest.raises(ValueError, match="no seed"):
        statistics.mean_inference([])
    with pytest.raises(ValueError, match="not finite"):
        statistics.ratio_inference([1.0, np.nan], [1.0, 1.0])
    with pytest.raises(ValueError, match="one numerator per denominator"):
        statistics.ratio_inference([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="direction"):
        statistics.direction_verdict("bigger", one, None)


def test_values_at_or_below_zero_are_never_logged_or_dropped():
    """A seed whose ratio is negative sends the whole ratio to Fieller's interval on the means: the
    value is mean(a) / mean(b) with every seed in it, not a geometric mean over the positive seeds."""
    a, b = np.array([2.0, -0.5, 3.0, 2.5]), np.array([1.0, 1.1, 0.9, 1.0])
    inf = statistics.ratio_inference(a, b)
    assert inf.method == statistics.FIELLER and inf.value == pytest.approx(a.mean() / b.mean())
    assert len(inf.per_seed) == 4 and inf.per_seed[1] < 0


def test_holm_against_a_hand_computation():
    """p = (0.01, 0.04, 0.03, 0.005): sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03,
    0.06, 0.04, made monotone: 0.02, 0.03, 0.06, 0.06; in the input order 0.03, 0.06, 0.06, 0.02."""
    p = [0.01, 0.04, 0.03, 0.005]
    assert statistics.holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert statistics.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0]) and statistics.holm([]) == []
    assert statistics.holm([0.2]) == [0.2]
    with pytest.raises(ValueError, match="p-values"):
        statistics.holm([0.1, 1.5])


def _inf(value, ci, n=5, null=1.0):
    return statistics.SeedInference("ratio", statistics.LOG_T, value, ci, 0.01, null, n, ())


@pytest.mark.parametrize(
    "direction, value, ci, p_holm, expected",
    [
        ("greater", 2.0, (1.5, 2.7), 0.01, statistics.SUPPORTED),
        ("greater", 0.6, (0.4, 0.9), 0.01, statistics.CONTRADICTED),
        ("greater", 1.3, (1.05, 1.6), 0.08, statistics.INCONCLUSIVE),  # excludes 1 unadjusted, not after Holm
        ("less", 0.6, (0.4, 0.9), 0.01, statistics.SUPPORTED),
        ("less", 2.0, (1.5, 2.7), 0.001, statistics.CONTRADICTED),
        ("about", 1.02, (0.9, 1.15), 0.6, statistics.SUPPORTED),  # inside the +-25% band
        ("about", 1.05, (1.02, 1.08), 0.01, statistics.SUPPORTED),  # a real but small difference is still "about"
        ("about", 1.6, (1.3, 2.0), 0.001, statistics.CONTRADICTED),
        ("about", 1.1, (0.7, 1.6), 0.5, statistics.INCONCLUSIVE),
        ("greater", 2.0, None, None, statistics.INCONCLUSIVE),
    ],
)
def test_direction_verdicts(direction, value, ci, p_holm, expected):
    band = (0.8, 1.25) if direction == "about" else None
    assert statistics.direction_verdict(direction, _inf(value, ci), p_holm, band) == expected


@pytest.mark.parametrize(
    "ci, paper, expected",
    [
        ((1.5, 2.4), 1.76, statistics.CONSISTENT),
        ((2.85, 22.7), 1.76, statistics.LARGER),  # the example: excludes 1.76, however wide
        ((0.9, 1.5), 1.76, statistics.SMALLER),
        ((0.5, 3.0), 1.76, statistics.UNINFORMATIVE),  # contains 1.76 but spans x6
        ((0.5, 2.0), 1.76, statistics.CONSISTENT),  # spans exactly x4
        ((-0.2, 3.0), 1.76, statistics.UNINFORMATIVE),  # contains 0: an infinite span
        ((0.3, 0.9), 0.5, statistics.CONSISTENT),  # a difference: |bounds| within x3
        ((0.1, 0.9), 0.5, statistics.UNINFORMATIVE),  # a difference pinned only within x9
        ((-0.4, -0.1), 0.5, statistics.SMALLER),
        ((0.6, 0.9), 0.5, statistics.LARGER),
        (None, 0.5, statistics.UNINFORMATIVE),
        ((0.6, 0.9), None, None),  # no paper number, no magnitude
    ],
)
def test_magnitude_verdicts(ci, paper, expected):
    assert statistics.magnitude_verdict(ci, paper, 5) == expected


def test_span():
    assert statistics.span((2.0, 8.0)) == 4.0 and statistics.span((-8.0, -2.0)) == 4.0
    assert (
        statistics.span((0.0, 1.0)) == np.inf
        and statistics.span((-1.0, 1.0)) == np.inf
        and statistics.span(None) == np.inf
    )


def test_estimate_gives_a_seed_level_interval_and_the_value_it_is_about():
    """The older interface: the interval over per-seed statistics, paired by index across groups. A
    ratio with its denominator keeps the pooled ratio of means; any other statistic's value is the
    mean of its per-seed values, the interval's centre (here per-seed 0.5 and 1.5: a t_1 interval
    around 1.0, where the pooled statistic, (5/3)/2, would lie off-centre); one seed: its own value."""
    a = [np.array([[2.0, 1.0], [4.0, 2.0]]), np.array([[6.0, 3.0]])]
    est = statistics.estimate({"pairs": a}, lambda g: statistics.ratio_of_means(g["pairs"]))
    assert est.value == 2.0 and est.ci95 == pytest.approx((2.0, 2.0))  # every seed has ratio 2
    groups = {"x": [np.array([[1.0], [1.0]]), np.array([[3.0]])], "base": [np.array([[2.0]]), np.array([[2.0]])]}
    stat = lambda g: statistics.mean(g["x"]) / statistics.mean(g["base"])  # noqa: E731
    est = statistics.estimate(groups, stat)
    half = scipy_stats.t.ppf(0.975, 1) * 0.5
    assert est.value == pytest.approx(1.0) and est.ci95 == pytest.approx((1.0 - half, 1.0 + half))
    assert stat({k: np.concatenate(v) for k, v in groups.items()}) == pytest.approx(5.0 / 6.0)
    one = statistics.estimate({k: v[:1] for k, v in groups.items()}, stat)
    assert one.value == pytest.approx(0.5) and one.ci95 is None
    ratio = statistics.ratio_estimates(
        [np.array([[2.0, 1.0], [3.0, 1.0]]), np.array([[4.0, 1.0]]), np.array([[3.0, 2.0]])]
    )
    per_seed = np.array([2.5, 4.0, 1.5])
    ref = scipy_stats.ttest_1samp(np.log(per_seed), 0.0).confidence_interval(0.95)
    assert ratio[""].value == pytest.approx(12.0 / 5.0) and ratio[""].method == statistics.LOG_T
    assert ratio[""].ci95 == pytest.approx(tuple(np.exp(ref)))


def test_estimate_pairs_seeds_by_id_and_uses_only_the_shared_ones():
    """Group x lacks seed 1 (absent from a mapping, or without rows in a list): seeds 0, 2, 3 of both
    groups are paired, x's seed 2 with base's seed 2 (not base's seed 1), against a t interval on the
    per-seed ratios by hand; the value is that interval's centre, the mean of those seeds' ratios (the
    pooled ratio, (23/4)/2 = 2.875, would lie off-centre)."""
    x = {0: np.array([[2.0], [4.0]]), 2: np.array([[9.0]]), 3: np.array([[8.0]])}
    base = {0: np.array([[1.0]]), 1: np.array([[100.0]]), 2: np.array([[3.0]]), 3: np.array([[2.0]])}
    per_seed = np.array([3.0 / 1.0, 9.0 / 3.0, 8.0 / 2.0])
    ref = scipy_stats.ttest_1samp(per_seed, 0.0).confidence_interval(0.95)
    stat = lambda g: statistics.mean(g["x"]) / statistics.mean(g["base"])  # noqa: E731
    as_list = {"x": [x[0], np.empty((0, 1)), x[2], x[3]], "base": [base[k] for k in range(4)]}
    for groups in ({"x": x, "base": base}, as_list):
        est = statistics.estimate(groups, stat)
        assert est.seeds == (0, 2, 3) and est.n_seeds == 3 and est.n_units == 4 + 3
        assert est.value == pytest.approx(per_seed.mean()) and est.value != pytest.approx((23.0 / 4.0) / 2.0)
        assert est.ci95 == pytest.approx(tuple(ref))
    assert statistics.shared_seeds({"x": x, "base": base}) == [0, 2, 3]
    # no seed in common: no value, no interval (nothing is paired)
    none = statistics.estimate({"x": {0: x[0]}, "base": {1: base[1]}}, stat)
    assert np.isnan(none.value) and none.ci95 is None and none.n_seeds == 0
    # ratio_estimates (the fine-tuning summary's caller) takes either form too
    rows = {3: np.array([[2.0, 1.0]]), 5: np.array([[6.0, 2.0]])}
    assert statistics.ratio_estimates(rows)[""].seeds == (3, 5) and statistics.ratio_estimates(list(rows.values()))[
        ""
    ].seeds == (0, 1)


def test_median_of_ratios_is_not_swung_by_one_extreme_unit():
    rows = np.array([[2.0, 1.0], [4.0, 2.0], [6.0, 3.0], [-600.0, 1.0]])  # one spike of the other sign
    assert statistics.median_ratio(rows) == 2.0
    assert statistics.ratio_of_means(rows) == pytest.approx(-588.0 / 7.0)


def test_fewer_than_two_seeds_gives_no_interval():
    est = statistics.estimate({"x": [np.array([[1.0], [2.0], [3.0]])]}, lambda g: statistics.mean(g["x"]))
    assert est.value == 2.0 and est.ci95 is None and est.n_seeds == 1
    # a group with fewer seeds than another limits the interval too
    groups = {"x": [np.array([[1.0]]), np.array([[2.0]])], "base": [np.array([[1.0]])]}
    assert statistics.estimate(groups, lambda g: statistics.mean(g["x"])).ci95 is None
    with pytest.raises(ValueError, match="no data"):
        statistics.estimate({"x": [np.empty((0, 1))]}, lambda g: statistics.mean(g["x"]))


def test_standard_error():
    assert statistics.standard_error([1.0, 3.0]) == pytest.approx(1.0)
    assert np.isnan(statistics.standard_error([1.0]))


def test_a_ratio_whose_denominator_interval_contains_zero_is_flagged():
    """Denominators of either sign: no ratio interval, and the estimate says why; a denominator far
    from zero is not flagged."""
    rng = np.random.default_rng(3)
    near_zero = [np.column_stack([rng.normal(1, 0.1, 4), rng.normal(0, 1, 4)]) for _ in range(4)]
    stat = lambda g: statistics.ratio_of_means(g["x"])  # noqa: E731
    den = lambda g: statistics.denominator_of_means(g["x"])  # noqa: E731
    flagged = statistics.estimate({"x": near_zero}, stat, denominator=den)
    assert flagged.denominator_spans_zero and flagged.ci95 is None
    away = [np.column_stack([rng.normal(1, 0.1, 4), rng.normal(5, 1, 4)]) for _ in range(4)]
    assert not statistics.estimate({"x": away}, stat, denominator=den).denominator_spans_zero
    assert not statistics.estimate({"x": near_zero}, stat).denominator_spans_zero  # only checked when asked


def test_trajectory_means_leave_out_the_unigram_plateau():
    """Like matched levels, tracked checkpoints on the plateau are kept out of trajectory means (and
    the rho_within thirds); warmup is left out too."""
    from curvlab.curvature.scalars import CheckpointScalars
    from curvlab.studies.records import TrackRecord

    rows = [{"step": k, "nds": float(k), "on_plateau": k < 20, "taylor_ok": True} for k in range(0, 60, 10)]
    t = TrackRecord("muon", 0.0, 0, 60, 5, [CheckpointScalars.from_dict(r) for r in rows])
    assert [r.step for r in t.off_plateau()] == [20, 30, 40, 50]
    assert [r.step for r in t.after_warmup()] == [20, 30, 40, 50]
    t = TrackRecord("muon", 0.0, 0, 60, 25, [CheckpointScalars.from_dict({**r, "on_plateau": False}) for r in rows])
    assert [r.step for r in t.after_warmup()] == [30, 40, 50]


def test_the_equivalence_test_is_tost_on_log_ratios_by_hand():
    """TOST against a hand computation with scipy.stats.t, its duality with the 90% interval, and its limits."""
    st, equivalence_test = scipy_stats, statistics.equivalence_test
    band = (0.9, 1 / 0.9)
    for ratios in ([1.01, 0.98, 1.03, 0.99, 1.02], [1.05, 1.12, 0.97, 1.08], [1.2, 1.25, 1.18]):
        x = np.log(ratios)
        n, m, se = x.size, x.mean(), x.std(ddof=1) / np.sqrt(x.size)
        p_low = 1 - st.t.cdf((m - np.log(band[0])) / se, n - 1)
        p_high = 1 - st.t.cdf((np.log(band[1]) - m) / se, n - 1)
        test = equivalence_test(ratios, band)
        assert test.p == pytest.approx(max(p_low, p_high), rel=1e-10)
        lo, hi = np.exp(m + np.array([-1, 1]) * st.t.ppf(0.95, n - 1) * se)  # the 90% interval
        assert test.passed == bool(band[0] < lo and hi < band[1])
    assert equivalence_test([1.01, 0.99, 1.0, 1.02, 0.98], band).passed is True
    assert equivalence_test([1.2, 1.25, 1.18], band).passed is False  # outside the band: fails
    assert equivalence_test([0.5, 2.0, 1.0], band).passed is False  # too wide to show anything: fails
    assert equivalence_test([1.0], band).passed is None and equivalence_test([1.0, -1.0], band).p is None
    with pytest.raises(CurvlabError, match="band"):
        equivalence_test([1.0, 1.0], (1.1, 1.2))
