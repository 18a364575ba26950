import numpy as np
import pytest

from curvlab import statistics as st


def test_bootstrap_interval_of_a_mean_matches_the_normal_closed_form():
    """Many seeds of one unit each: the percentile interval of the mean is mu ± 1.96 sigma / sqrt(n)."""
    rng = np.random.default_rng(1)
    n, sigma = 400, 2.0
    x = rng.normal(5.0, sigma, n)
    est = st.estimate({"x": [np.array([[v]]) for v in x]}, lambda g: st.mean(g["x"]), n_boot=4000)
    half = 1.96 * x.std(ddof=1) / np.sqrt(n)
    assert est.value == pytest.approx(x.mean())
    assert est.ci95[0] == pytest.approx(x.mean() - half, abs=0.08 * half)
    assert est.ci95[1] == pytest.approx(x.mean() + half, abs=0.08 * half)
    assert (est.n_seeds, est.n_units) == (n, n)


def test_two_stage_bootstrap_covers_the_true_mean_with_seed_effects():
    """Seeds carry a shared offset (sd 1) and levels noise (sd 0.5): the interval must reflect the seed
    variance (a bootstrap over levels alone would be far too narrow) and cover about 95% of the time."""
    rng = np.random.default_rng(2)
    covered, widths = 0, []
    seeds, levels, trials = 20, 6, 150
    for _ in range(trials):
        data = [rng.normal(rng.normal(0, 1.0), 0.5, (levels, 1)) for _ in range(seeds)]
        est = st.estimate({"x": data}, lambda g: st.mean(g["x"]), n_boot=400, seed=int(rng.integers(1 << 30)))
        covered += est.ci95[0] <= 0.0 <= est.ci95[1]
        widths.append(est.ci95[1] - est.ci95[0])
    sd = np.sqrt(1.0 / seeds + 0.25 / (seeds * levels))  # closed form of the sd of the grand mean
    assert 0.88 <= covered / trials <= 0.99
    assert np.mean(widths) == pytest.approx(2 * 1.96 * sd, rel=0.15)


def test_ratio_of_means_and_groups_resampled_independently():
    a = [np.array([[2.0, 1.0], [4.0, 2.0]]), np.array([[6.0, 3.0]])]
    est = st.estimate({"pairs": a}, lambda g: st.ratio_of_means(g["pairs"]))
    assert est.value == 2.0 and est.ci95 == (2.0, 2.0)  # every resample has ratio 2
    groups = {"x": [np.array([[1.0]]), np.array([[3.0]])], "base": [np.array([[2.0]]), np.array([[2.0]])]}
    est = st.estimate(groups, lambda g: st.mean(g["x"]) / st.mean(g["base"]))
    assert est.value == 1.0 and est.ci95[0] == pytest.approx(0.5) and est.ci95[1] == pytest.approx(1.5)


def test_median_of_ratios_is_not_swung_by_one_extreme_unit():
    rows = np.array([[2.0, 1.0], [4.0, 2.0], [6.0, 3.0], [-600.0, 1.0]])  # one spike of the other sign
    assert st.median_ratio(rows) == 2.0
    assert st.ratio_of_means(rows) == pytest.approx(-588.0 / 7.0)


def test_fewer_than_two_seeds_gives_no_interval_and_no_verdict():
    est = st.estimate({"x": [np.array([[1.0], [2.0], [3.0]])]}, lambda g: st.mean(g["x"]))
    assert est.value == 2.0 and est.ci95 is None and est.n_seeds == 1
    assert st.verdict("greater", est.ci95, 1.0) == st.INCONCLUSIVE
    # a group with fewer seeds than another limits the interval too
    groups = {"x": [np.array([[1.0]]), np.array([[2.0]])], "base": [np.array([[1.0]])]}
    assert st.estimate(groups, lambda g: st.mean(g["x"])).ci95 is None
    with pytest.raises(ValueError, match="no data"):
        st.estimate({"x": [np.empty((0, 1))]}, lambda g: st.mean(g["x"]))


@pytest.mark.parametrize(
    "direction, ci, null, band, expected",
    [
        ("greater", (1.2, 2.0), 1.0, None, st.SUPPORTED),
        ("greater", (0.5, 0.9), 1.0, None, st.CONTRADICTED),
        ("greater", (0.9, 1.5), 1.0, None, st.INCONCLUSIVE),
        ("greater", (1.0, 1.5), 1.0, None, st.INCONCLUSIVE),  # touching no effect is not excluding it
        ("less", (0.1, 0.4), 0.5, None, st.SUPPORTED),
        ("less", (0.6, 0.9), 0.5, None, st.CONTRADICTED),
        ("about", (0.9, 1.1), 1.0, (0.8, 1.25), st.SUPPORTED),
        ("about", (1.3, 2.0), 1.0, (0.8, 1.25), st.CONTRADICTED),
        ("about", (0.1, 0.7), 1.0, (0.8, 1.25), st.CONTRADICTED),
        ("about", (0.7, 1.1), 1.0, (0.8, 1.25), st.INCONCLUSIVE),
        ("greater", None, 1.0, None, st.INCONCLUSIVE),
        ("greater", (float("nan"), 2.0), 1.0, None, st.INCONCLUSIVE),
        (None, (1.2, 2.0), 1.0, None, st.NO_CLAIM),
    ],
)
def test_verdicts(direction, ci, null, band, expected):
    assert st.verdict(direction, ci, null, band) == expected


def test_verdict_rejects_a_bad_claim():
    with pytest.raises(ValueError, match="direction"):
        st.verdict("bigger", (1, 2))
    with pytest.raises(ValueError, match="band"):
        st.verdict("about", (1, 2))


def test_standard_error():
    assert st.standard_error([1.0, 3.0]) == pytest.approx(1.0)
    assert np.isnan(st.standard_error([1.0]))


def test_a_ratio_whose_denominator_interval_contains_zero_is_flagged():
    """Denominators of either sign: the percentile interval of the ratio means little, and says so;
    a denominator far from zero is not flagged."""
    rng = np.random.default_rng(3)
    near_zero = [np.column_stack([rng.normal(1, 0.1, 4), rng.normal(0, 1, 4)]) for _ in range(4)]
    stat = lambda g: st.ratio_of_means(g["x"])  # noqa: E731
    den = lambda g: st.denominator_of_means(g["x"])  # noqa: E731
    assert st.estimate({"x": near_zero}, stat, 500, denominator=den).denominator_spans_zero
    away = [np.column_stack([rng.normal(1, 0.1, 4), rng.normal(5, 1, 4)]) for _ in range(4)]
    assert not st.estimate({"x": away}, stat, 500, denominator=den).denominator_spans_zero
    assert not st.estimate({"x": near_zero}, stat, 500).denominator_spans_zero  # only checked when asked


def test_trajectory_means_leave_out_the_unigram_plateau():
    """Like matched levels, tracked checkpoints on the plateau are kept out of trajectory means (and
    the rho_within thirds); warmup is left out too."""
    from curvlab.results import TrackRecord

    rows = [{"step": k, "nds": float(k), "on_plateau": k < 20} for k in range(0, 60, 10)]
    t = TrackRecord("muon", 0.0, 0, 60, 5, rows)
    assert [r["step"] for r in t.off_plateau()] == [20, 30, 40, 50]
    assert [r["step"] for r in t.after_warmup()] == [20, 30, 40, 50]
    t = TrackRecord("muon", 0.0, 0, 60, 25, [{**r, "on_plateau": False} for r in rows])
    assert [r["step"] for r in t.after_warmup()] == [30, 40, 50]
