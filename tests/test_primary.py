"""The primary family, the A/A calibration, their schema, report rows and figure, on synthetic records."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
from scipy import stats as scipy_stats

from curvlab.errors import CurvlabError
from curvlab.inference import statistics
from curvlab.jobs.presets import PRESETS
from curvlab.output.plots import primary_forest
from curvlab.output.text import render_readme_results, render_report
from curvlab.studies.headline import headline
from curvlab.studies.paper import PRIMARY
from curvlab.studies.primary import Calibration, PrimaryEntry, calibration, primary_family
from curvlab.studies.summary import QuadraticRecord, Summary
from curvlab.studies.tuning import TuningRecord
from tests.synthetic import ar1, level_data, record, track

LEVELS = 6


def _levels(rng, n, nds, cos_adamw, cos_muon, paired=True):
    """One side's window means at ``n`` levels: its own NDS (AR(1) in log around ``nds``) and, when
    ``paired``, the NDS and cos of AdamW's and Muon's directions at its W."""
    noise = np.exp(ar1(rng, n, 0.7, 0.3)[0])
    out = []
    for k in range(n):
        x = {"hidden_nds": nds * noise[k], "nds": nds * noise[k]}
        if paired:
            x |= {
                "paired_nds_adamw_hidden": 6.0 * noise[k] * np.exp(rng.normal(0, 0.2)),
                "paired_nds_muon_hidden": noise[k],
                "paired_cos_adamw_hidden": cos_adamw + rng.normal(0, 0.01),
                "paired_cos_muon_hidden": cos_muon + rng.normal(0, 0.01),
            }
            for arm in ("adamw", "muon"):  # q = cos² / NDS, as PairedDirections.scalars gives it
                x[f"paired_q_{arm}_hidden"] = x[f"paired_cos_{arm}_hidden"] ** 2 / x[f"paired_nds_{arm}_hidden"]
        out.append(x)
    return out


def _experiment(rng, n_seeds, paired=True, s_values=(0.0, 1.0), tracks=True):
    comparisons, runs = [], []
    for seed in range(n_seeds):
        u = np.exp(rng.normal(0, 0.2))  # a seed effect
        a = _levels(rng, LEVELS, 3.0 * u, 0.30, 0.10, paired)
        b = _levels(rng, LEVELS, 1.0, 0.31, 0.30, paired)
        comparisons.append(record("adamw/muon", seed, a, b))
        if not tracks:
            continue
        for arm, level0, level1 in (("adamw", 1.6, 2.4), ("muon", 1.0, 1.25)):
            within = np.linspace(0.1, 0.5, 9) * (1.0 if arm == "muon" else 0.3) * np.exp(rng.normal(0, 0.1))
            runs.append(track(arm, s_values[0], seed, level0 * np.exp(rng.normal(0, 0.05, 9)), within * level0))
            if len(s_values) > 1:
                runs.append(track(arm, s_values[-1], seed, level1 * np.exp(rng.normal(0, 0.05, 9))))
    return level_data(comparisons, runs, s_values)


def _by_name(entries):
    return {e.name: e for e in entries}


def test_primary_entries_match_a_hand_computation_from_the_raw_levels():
    data = _experiment(np.random.default_rng(0), 4)
    e = _by_name(primary_family(data))
    assert [x.name for x in primary_family(data)] == [c.name for c in PRIMARY] and len(PRIMARY) <= 6

    def level_means(key_a, key_b, both=False):
        num, den = [], []
        for r in data.matched("adamw/muon"):
            sides = [(lv.a, lv.b) for lv in r.comparison.levels]
            if both:  # every point: both sides of every level, two directions at each; the median ratio
                pts = [s for pair in sides for s in pair]
                num.append(np.median([s.members[0].value(key_a) / s.members[0].value(key_b) for s in pts]))
                den.append(1.0)
            else:
                num.append(np.mean([a.members[0].value(key_a) for a, _ in sides]))
                den.append(np.mean([b.members[0].value(key_b) for _, b in sides]))
        return np.array(num), np.array(den)

    p = {}
    for name, (ka, kb, both) in {
        "between_nds_ratio": ("hidden_nds", "hidden_nds", False),
        "paired_direction_ratio": ("paired_nds_adamw_hidden", "paired_nds_muon_hidden", True),
        "alignment_ratio": ("paired_cos_adamw_hidden", "paired_cos_muon_hidden", False),
        # Muon over AdamW: q of Muon's direction over AdamW's (every NDS > 0 here, so every point counts)
        "direction_efficiency_ratio": ("paired_q_muon_hidden", "paired_q_adamw_hidden", True),
    }.items():
        num, den = level_means(ka, kb, both)
        ref = scipy_stats.ttest_1samp(np.log(num / den), 0.0)
        assert e[name].method == statistics.LOG_T and e[name].n_seeds == 4
        assert e[name].value == pytest.approx(np.exp(np.log(num / den).mean()))
        assert e[name].ci95 == pytest.approx(list(np.exp(ref.confidence_interval(0.95))))
        assert e[name].p == pytest.approx(ref.pvalue)
        p[name] = ref.pvalue
    assert e["between_nds_ratio"].n_units == 4 * LEVELS and e["paired_direction_ratio"].n_units == 8 * LEVELS
    assert e["direction_efficiency_ratio"].n_units == 8 * LEVELS and e["direction_efficiency_ratio"].paper == 1.76

    # the Zipf gap change: per seed (a1 - m1 - a0 + m0) / m0 of trajectory means, a t interval over seeds
    def traj(arm, s):
        return np.array([np.mean([r.value("hidden_nds") for r in t.rows]) for t in data.track(arm, s)])

    m0 = traj("muon", 0.0)
    g = (traj("adamw", 1.0) - traj("muon", 1.0) - traj("adamw", 0.0) + m0) / m0
    ref = scipy_stats.ttest_1samp(g, 0.0)
    z = e["zipf_gap_change"]
    assert z.method == statistics.MEAN_T and z.value == pytest.approx(g.mean())
    assert z.ci95 == pytest.approx(list(ref.confidence_interval(0.95)))
    p["zipf_gap_change"] = ref.pvalue
    assert z.p == pytest.approx(p["zipf_gap_change"])

    # rho_within: per seed, (late - early) of Muon minus AdamW's, over the thirds of steps 10-90
    def rise(t):
        early = [r for r in t.rows if r.step <= 30]
        late = [r for r in t.rows if r.step > 60]
        return sum(r.within for r in late) / sum(r.all.nds for r in late) - sum(r.within for r in early) / sum(
            r.all.nds for r in early
        )

    gaps = np.array([rise(m) - rise(a) for m, a in zip(data.track("muon", 0.0), data.track("adamw", 0.0))])
    ref = scipy_stats.ttest_1samp(gaps, 0.0)
    assert e["rho_within_change_gap"].value == pytest.approx(gaps.mean())
    assert e["rho_within_change_gap"].ci95 == pytest.approx(list(ref.confidence_interval(0.95)))
    p["rho_within_change_gap"] = ref.pvalue

    # Holm over the six tests, by hand
    names = [c.name for c in PRIMARY]
    order = sorted(names, key=lambda n: p[n])
    running = 0.0
    for k, n in enumerate(order):
        running = max(running, min(1.0, (len(names) - k) * p[n]))
        assert e[n].p_holm == pytest.approx(running)
    # verdicts: AdamW's own NDS 3x Muon's (paper 1.76: larger), its direction 6x at the same point,
    # alignment 0.30 vs 0.31 of each run's own step (about equal)
    assert (
        e["between_nds_ratio"].direction == statistics.SUPPORTED
        and e["between_nds_ratio"].magnitude == statistics.LARGER
    )
    assert (
        e["paired_direction_ratio"].direction == statistics.SUPPORTED and e["paired_direction_ratio"].magnitude is None
    )
    assert e["alignment_ratio"].direction == statistics.SUPPORTED
    assert e["rho_within_change_gap"].direction == statistics.SUPPORTED


def test_missing_data_is_not_measured_never_a_verdict_or_a_crash():
    """Older runs without paired-direction scalars, one value of s, no trajectories: those entries are
    marked not measured (and out of Holm's family); the rest is still judged."""
    data = _experiment(np.random.default_rng(1), 3, paired=False, s_values=(0.0,), tracks=False)
    e = _by_name(primary_family(data))
    for name in ("paired_direction_ratio", "alignment_ratio", "zipf_gap_change", "rho_within_change_gap"):
        assert e[name].direction == statistics.NOT_MEASURED and e[name].value is None and e[name].p_holm is None
        assert e[name].note.startswith("not measured")
    assert "paired_nds_adamw_hidden" in e["paired_direction_ratio"].note
    assert e["between_nds_ratio"].p_holm == pytest.approx(e["between_nds_ratio"].p)  # a family of one
    empty = _by_name(primary_family(level_data()))
    assert all(x.direction == statistics.NOT_MEASURED for x in empty.values())


def test_a_level_whose_value_is_not_finite_is_left_out_with_a_note_and_none_left_is_not_measured():
    """The between-run claims average each seed's levels; a level whose window mean is NaN (a scalar an
    older file lacks reads as NaN) is left out and named, never averaged in or turned into a crash; with
    none finite the claim is not measured. The alignment reads each run's own step's cos (hidden_cosine)."""
    from curvlab.studies.seed_values import claim_inputs

    data = _experiment(np.random.default_rng(3), 4, s_values=(0.0,), tracks=False)
    claim = next(c for c in PRIMARY if c.name == "alignment_ratio")
    whole = claim_inputs(claim, data, data.comparisons)
    first = data.comparisons[0]
    lv = first.comparison.levels[2]
    broken = replace(lv.a.members[0], hidden=replace(lv.a.members[0].hidden, cosine=float("nan")))
    levels = list(first.comparison.levels)
    levels[2] = replace(lv, a=replace(lv.a, members=[broken]))
    records = [replace(first, comparison=replace(first.comparison, levels=levels)), *data.comparisons[1:]]
    got = claim_inputs(claim, data, records)
    kept = [k for k in range(LEVELS) if k != 2]
    cos = [[m.value("hidden_cosine") for m in (x.a.members[0], x.b.members[0])] for x in first.comparison.levels]
    assert got.units == [LEVELS - 1, *whole.units[1:]] and got.seeds == whole.seeds
    assert got.numerator[0] == pytest.approx(np.mean([cos[k][0] for k in kept]))
    assert got.denominator[0] == pytest.approx(np.mean([cos[k][1] for k in kept]))
    assert got.numerator[1:] == whole.numerator[1:]
    assert any("1 level(s) with a value that is not finite left out (seed 0 at" in n for n in got.notes)
    nan_all = [
        replace(r, comparison=replace(r.comparison, levels=[
            replace(x, a=replace(x.a, members=[replace(m, hidden=replace(m.hidden, cosine=float("nan")))
                                               for m in x.a.members]))
            for x in r.comparison.levels
        ]))
        for r in data.comparisons
    ]  # fmt: skip
    assert claim_inputs(claim, data, nan_all).startswith("no finite hidden_cosine")
    e = {x.name: x for x in primary_family(replace(data, comparisons=nan_all))}["alignment_ratio"]
    assert e.direction == statistics.NOT_MEASURED and e.value is None


def test_a_design_judges_only_its_own_claims_and_holm_runs_over_those():
    """quick judges the two paired claims: the others keep their estimate and interval, but no verdict
    (direction nor magnitude) and no place in Holm's correction, which then runs over two tests."""
    data = _experiment(np.random.default_rng(0), 4)
    full = _by_name(primary_family(data))
    judged = ("paired_direction_ratio", "alignment_ratio")
    e = _by_name(primary_family(data, judged=judged))
    for name, x in e.items():
        assert x.value == pytest.approx(full[name].value) and x.ci95 == pytest.approx(full[name].ci95)
        if name in judged:
            continue
        assert x.direction == statistics.DESCRIPTIVE and x.magnitude is None and x.p_holm is None
        assert "descriptive in this design" in x.note
    p = sorted((e[n].p, n) for n in judged)
    assert e[p[0][1]].p_holm == pytest.approx(min(1.0, 2 * p[0][0]))
    assert e[p[1][1]].p_holm == pytest.approx(max(min(1.0, 2 * p[0][0]), p[1][0]))
    assert e["paired_direction_ratio"].direction == statistics.SUPPORTED
    assert full["between_nds_ratio"].direction == statistics.SUPPORTED  # the same data, judged in the full family
    with pytest.raises(CurvlabError, match="unknown primary claims: nds_ratio"):
        primary_family(data, judged=("nds_ratio",))
    with pytest.raises(CurvlabError, match="unknown primary claims: paired "):
        PRESETS["quick"].changed(primary=("paired", "alignment_ratio")).validate()
    PRESETS["quick"].validate()


def test_two_seeds_are_descriptive_with_their_interval():
    e = _by_name(primary_family(_experiment(np.random.default_rng(2), 2)))
    for x in e.values():
        assert x.direction == statistics.FEW_SEEDS and x.p_holm is None and x.ci95 is not None and x.n_seeds == 2
        assert x.magnitude in (None, statistics.FEW_SEEDS)
    one = _by_name(primary_family(_experiment(np.random.default_rng(2), 1)))
    assert one["between_nds_ratio"].ci95 is None and one["between_nds_ratio"].direction == statistics.FEW_SEEDS


def test_a_denominator_of_unsettled_sign_becomes_a_difference_and_says_so():
    """Muon's alignment crossing 0 between seeds: the alignment ratio is judged as a difference, with
    no band (it can only be contradicted or inconclusive) and a note."""
    rng = np.random.default_rng(3)
    recs = []
    for seed, cos_muon in enumerate([0.2, -0.25, 0.15, -0.1]):
        a = _levels(rng, LEVELS, 3.0, 0.3, cos_muon)
        b = _levels(rng, LEVELS, 1.0, 0.3, cos_muon)
        recs.append(record("adamw/muon", seed, a, b))
    e = _by_name(primary_family(level_data(recs, [], (0.0,))))["alignment_ratio"]
    assert e.kind == "difference" and e.method == statistics.DIFFERENCE_T and "not settled" in e.note
    # AdamW's cos minus Muon's: 0.10, 0.55, 0.15, 0.39 over the seeds, interval [-0.04, 0.63] (p = 0.067)
    assert e.direction == statistics.INCONCLUSIVE and e.ci95[0] < 0 < e.ci95[1]


def _aa_records(rng, n_records, effect=1.0, name="adamw/adamw"):
    """Same-arm comparisons: two seeds of one arm per record, no true difference (``effect`` 1)."""
    out = []
    for k in range(n_records):
        sides = []
        for factor in (effect, 1.0):
            u = np.exp(rng.normal(0, 0.3))  # each run's seed effect
            lv = _levels(rng, LEVELS, 2.0 * u * factor, 0.3, 0.3)
            for x in lv:
                x["paired_cos_adamw_hidden"] = 0.3 * np.exp(rng.normal(0, 0.1)) * u**0.2
            sides.append(lv)
        out.append(record(name, k, *sides))
    return out


@pytest.mark.heavy
def test_aa_calibration_false_verdict_rate_under_no_effect():
    """300 simulated A/A families (3 to 6 seed pairs each, AR(1) levels, seed effects) through the same
    pipeline: the share of tests with a verdict asserting a difference is at most 5% plus three binomial
    standard errors of the 600 tests (3 * sqrt(0.05 * 0.95 / 600) = 0.027); Holm only lowers it."""
    rng = np.random.default_rng(5)
    false = tests = 0
    for k in range(300):
        c = calibration(_aa_records(rng, 3 + k % 4))
        assert c.n_tests == 2 and {t["claim"] for t in c.per_test} == {"between_nds_ratio", "alignment_ratio"}
        false += round(c.false_verdict_rate * c.n_tests)
        tests += c.n_tests
    assert false / tests <= 0.05 + 3 * np.sqrt(0.05 * 0.95 / tests)
    # a real difference between the two "same-arm" runs is caught: the rate can fail
    c = calibration(_aa_records(np.random.default_rng(6), 5, effect=4.0))
    assert any(t["claim"] == "between_nds_ratio" and t["false"] for t in c.per_test)
    # only same-arm records count; fewer than 3 pairs is no test
    mixed = _aa_records(rng, 2) + _aa_records(rng, 4, name="adamw/muon")
    none = calibration(mixed)
    assert none.n_tests == 0 and math.isnan(none.false_verdict_rate)


def _summary(primary, cal):
    return Summary(
        "micro", [], [], {"adamw": {"checked": 3, "failed": 1}},
        TuningRecord("search", 0.0, 10, [0], {}, {}), ["a note"], {"0": {"adamw": [4.0]}},
        QuadraticRecord(10.0, 0.669421, 0.922913),
        figures={"primary": ["figures/fig0_primary_forest.png"]}, primary=primary, calibration=cal,
    )  # fmt: skip


def test_summary_schema_round_trips_the_primary_family_and_calibration():
    primary = primary_family(_experiment(np.random.default_rng(7), 3))
    cal = calibration(_aa_records(np.random.default_rng(8), 3))
    summary = _summary(primary, cal)
    d = json.loads(json.dumps(summary.to_dict()))
    assert d["schema_version"] == 3
    assert set(d["calibration"]) >= {"false_verdict_rate", "n_tests", "pairs", "claims", "power"}
    assert set(d["calibration"]["power"]) == {"x1.5", "x2"}
    for entry in d["primary"]:
        keys = {"name", "scope", "value", "ci95", "n_seeds", "n_units", "paper", "direction", "magnitude", "p_holm"}
        assert keys | {"p_exact", "p_exact_min"} <= set(entry)
    back = Summary.from_dict(d)
    assert back.primary == primary and back.calibration == cal
    assert isinstance(back.primary[0], PrimaryEntry) and isinstance(back.calibration, Calibration)
    assert back.primary_entry("between_nds_ratio").paper == 1.76
    with pytest.raises(ValueError, match="schema 2 is not 3"):
        Summary.from_dict({**d, "schema_version": 2})


def test_report_and_readme_open_with_the_primary_family_then_calibration_then_the_rest():
    primary = primary_family(_experiment(np.random.default_rng(9), 3))
    summary = _summary(primary, calibration(_aa_records(np.random.default_rng(10), 4)))
    for text in (render_report(summary), render_readme_results(summary, "docs/results")):
        table = text.index("| claim | scope | curvlab [95% CI] | seeds, units | paper | direction | magnitude |")
        calib = text.index("A/A calibration")
        assert table < text.index("fig0_primary_forest") < calib < text.index("| quantity | scope |")
        rows = [line for line in text[table:calib].splitlines() if line.startswith("| ") and "claim |" not in line]
        assert len(rows) == len(PRIMARY) <= 8
        for e in primary:
            assert f"| {e.quantity}: {e.claimed} | {e.scope} |" in text
        assert "Over the full headline" not in text  # no tally of descriptive cells
    assert "; false-verdict rate" in render_report(summary)
    bare = _summary([], Calibration())
    assert "no same-arm comparison" in render_report(bare)


def test_forest_plot_of_measured_unmeasured_and_fallen_back_entries(tmp_path):
    rng = np.random.default_rng(11)
    entries = primary_family(_experiment(rng, 3, s_values=(0.0,)))  # the Zipf entry is not measured
    paths = primary_forest(entries, tmp_path / "forest")
    assert [p.suffix for p in paths] == [".png", ".pdf"] and all(p.stat().st_size > 1000 for p in paths)
    assert primary_forest(primary_family(level_data()), tmp_path / "empty")[0].stat().st_size > 1000


def test_descriptive_decomposition_of_the_between_run_ratio():
    """Headline (descriptive) entries from the paired scalars: the direction term at each arm's W and
    the landscape term, each a ratio of sums over seeds and levels; absent without paired scalars."""
    data = _experiment(np.random.default_rng(12), 3)
    entries = {(e.name, e.scope): e for e in headline(data)[0]}
    a = [lv.a.members[0] for r in data.matched("adamw/muon") for lv in r.comparison.levels]
    b = [lv.b.members[0] for r in data.matched("adamw/muon") for lv in r.comparison.levels]

    def ratio(xs, kx, ys, ky):
        return sum(x.value(kx) for x in xs) / sum(y.value(ky) for y in ys)

    n, m = "paired_nds_adamw_hidden", "paired_nds_muon_hidden"
    assert entries[("direction_term_adamw_w", "hidden")].value == pytest.approx(ratio(a, n, a, m))
    assert entries[("direction_term_muon_w", "hidden")].value == pytest.approx(ratio(b, n, b, m))
    assert entries[("landscape_term", "hidden")].value == pytest.approx(ratio(a, m, b, m))
    assert all(e.verdict == statistics.DESCRIPTIVE for e in entries.values())
    older = _experiment(np.random.default_rng(12), 3, paired=False)
    assert not [e for e in headline(older)[0] if e.name.startswith(("direction_term", "landscape"))]


def test_aa_records_are_no_arm_of_their_own_in_the_headline_figures_or_taylor_counts(monkeypatch, tmp_path):
    from curvlab.output import plots
    from curvlab.studies.headline import taylor_counts

    data = _experiment(np.random.default_rng(13), 3)
    plain = taylor_counts(data)
    data.comparisons.extend(_aa_records(np.random.default_rng(14), 3, name="muon/muon"))
    assert taylor_counts(data) == plain
    summary = _summary(primary_family(data), calibration(data.comparisons))
    assert summary.calibration.n_tests == 2
    drawn = {}
    for name in ("taylor_split_vs_loss", "block_heatmaps", "within_gap_by_layer", "zipf_nds", "tuning_grids",
                 "layer_split_over_training", "quadratic_trajectories", "quadratic_phase"):  # fmt: skip
        monkeypatch.setattr(plots, name, lambda *a, **k: [])
    monkeypatch.setattr(plots, "nds_and_norm_vs_loss", lambda arms, *a, **k: drawn.update(arms) or [])
    monkeypatch.setattr(plots, "within_layer_gap", lambda c: ([], [], []))
    monkeypatch.setattr(plots, "pair_reports", lambda level: {})
    written = plots.reproduction_figures(data, summary, {}, {}, tmp_path)
    assert list(drawn) == ["muon"] and len(drawn["muon"]) == 3  # the A/A records are not Muon's comparisons
    assert (tmp_path / "fig0_primary_forest.png").is_file() and written["primary"]


def test_the_paired_ratio_pools_the_trajectory_with_the_windows_once_per_checkpoint():
    """Every distinct analysed checkpoint of a seed counts once: the window members, and the stable-phase
    trajectory points off the plateau (a tracked step that is also a window member is not counted twice;
    plateau, decay and shadow-less rows add nothing)."""
    rng = np.random.default_rng(3)
    data = _experiment(rng, 3, tracks=False)
    for seed in range(3):
        for arm in ("adamw", "muon"):
            t = track(arm, 0.0, seed, np.ones(6))
            for k, row in enumerate(t.rows):
                paired = {"paired_nds_adamw_hidden": 5.0 + k, "paired_nds_muon_hidden": 1.0 + seed}
                t.rows[k] = replace(row, optimizer=arm, paired=paired)
            # AdamW's / Muon's first window member: a duplicate
            t.rows[0] = replace(t.rows[0], step=10 if arm == "adamw" else 20)
            t.rows[1] = replace(t.rows[1], on_plateau=True)
            t.rows[2] = replace(t.rows[2], phase="decay")
            t.rows[3] = replace(t.rows[3], paired={"paired_nds_muon_hidden": 1.0 + seed})  # analysed without a shadow
            data.tracks.append(t)
    e = _by_name(primary_family(data))["paired_direction_ratio"]
    logs = []
    for r in data.matched("adamw/muon"):
        points = {(s.optimizer, m.step): m for lv in r.comparison.levels for s in (lv.a, lv.b) for m in s.members}
        for t in (t for t in data.tracks if t.seed == r.seed):
            for row in t.rows[4:]:  # the two clean rows of each track
                points[(t.arm, row.step)] = row
        xs = [p.value("paired_nds_adamw_hidden") for p in points.values()]
        ys = [p.value("paired_nds_muon_hidden") for p in points.values()]
        logs.append(np.log(np.median(np.divide(xs, ys))))
        assert len(points) == 2 * LEVELS + 4
    assert e.n_units == 3 * (2 * LEVELS + 4)
    assert e.value == pytest.approx(np.exp(np.mean(logs)))
    ref = scipy_stats.ttest_1samp(logs, 0.0)
    assert e.ci95 == pytest.approx(list(np.exp(ref.confidence_interval(0.95))))


def test_one_spiking_checkpoint_moves_a_seeds_paired_ratio_by_at_most_one_order_statistic():
    """The per-seed value is the median of the per-point ratios: one checkpoint where AdamW's NDS is
    ×1000 (as at one quick checkpoint, ×700 its neighbours) moves it to the next order statistic, where a
    ratio of means would follow the spike; a negative ratio (the directions' signs differ) is kept."""
    data = _experiment(np.random.default_rng(4), 3, tracks=False)

    def seed_ratios(d):
        out = []
        for r in d.matched("adamw/muon"):
            m = [s.members[0] for lv in r.comparison.levels for s in (lv.a, lv.b)]
            out.append(np.sort([p.value("paired_nds_adamw_hidden") / p.value("paired_nds_muon_hidden") for p in m]))
        return out

    before = seed_ratios(data)
    spiked = data.matched("adamw/muon")[0].comparison.levels[0].a.members[0]
    spiked.paired["paired_nds_adamw_hidden"] *= 1000.0
    flipped = data.matched("adamw/muon")[1].comparison.levels[0].b.members[0]
    flipped.paired["paired_nds_adamw_hidden"] *= -1.0
    e = _by_name(primary_family(data))["paired_direction_ratio"]
    after = seed_ratios(data)
    medians = [np.median(x) for x in after]
    assert e.value == pytest.approx(np.exp(np.mean(np.log(medians))))
    n = len(before[0])  # even: the median averages the two middle points, and one of them moves up by one
    assert before[0][n // 2 - 1] <= medians[0] <= before[0][n // 2 + 1]
    assert before[1][n // 2 - 2] <= medians[1] <= before[1][n // 2]  # the flipped point now sorts first
    assert f"take the same sign at {6 * LEVELS - 1} of {6 * LEVELS} points" in e.note
    m = [s.members[0] for lv in data.matched("adamw/muon")[0].comparison.levels for s in (lv.a, lv.b)]
    mean_ratio = np.mean([p.value("paired_nds_adamw_hidden") for p in m]) / np.mean(
        [p.value("paired_nds_muon_hidden") for p in m]
    )
    assert mean_ratio > 10 * medians[0]  # what a ratio of means would have made of that seed


def test_a_seed_without_a_paired_ratio_is_named_and_a_negative_median_is_a_t_interval_on_the_medians():
    """Muon's NDS 0 at every point of a seed: no ratio, the seed is left out and named. A seed whose
    median ratio is negative: no log, the interval is the t interval on the arithmetic mean of the medians."""
    data = _experiment(np.random.default_rng(5), 4, tracks=False)
    records = data.matched("adamw/muon")

    def members(r):
        return [s.members[0] for lv in r.comparison.levels for s in (lv.a, lv.b)]

    for m in members(records[3]):
        m.paired["paired_nds_muon_hidden"] = 0.0
    for m in members(records[1]):
        m.paired["paired_nds_adamw_hidden"] *= -1.0
    e = _by_name(primary_family(data))["paired_direction_ratio"]
    assert e.n_seeds == 3 and "seeds [3]: Muon's NDS is 0 at every point, left out" in e.note
    medians = [np.median([m.value("paired_nds_adamw_hidden") / m.value("paired_nds_muon_hidden") for m in members(r)])
               for r in records[:3]]  # fmt: skip
    assert medians[1] < 0 and e.method == statistics.FIELLER
    ref = scipy_stats.ttest_1samp(medians, 1.0)
    assert e.value == pytest.approx(np.mean(medians))
    assert e.ci95 == pytest.approx(list(ref.confidence_interval(0.95)))
    assert f"same sign at {2 * 2 * LEVELS} of {3 * 2 * LEVELS} points" in e.note


def _on_plateau(data, arm, s, seeds):
    """``data`` with the tracks of ``arm`` at ``s`` of ``seeds`` wholly on the unigram plateau."""
    for t in data.tracks:
        if t.arm == arm and t.s == s and t.seed in seeds:
            t.rows[:] = [replace(r, on_plateau=True) for r in t.rows]
    return data


def _rho(t, third):
    """rho_within over the first (0) or last (1) third, by step, of a track's stable phase off the
    plateau: sum within / sum NDS there."""
    steps = [r.step for r in t.rows if not r.on_plateau and r.phase == "stable" and r.step >= t.warmup_steps]
    lo, hi = min(steps), max(steps)
    pick = (lambda k: k <= lo + (hi - lo) / 3) if third == 0 else (lambda k: k >= hi - (hi - lo) / 3)
    rows = [r for r in t.rows if r.step in steps and pick(r.step)]
    return sum(r.within for r in rows) / sum(r.all.nds for r in rows)


def test_rho_within_reads_the_thirds_of_the_stable_phase_off_the_plateau():
    """Tracks of 12 checkpoints (steps 10-120) whose first four are on the unigram plateau and last two in
    the decay, as in a short run: early and late are the first and last third of steps 50-100 (50, 60
    and 90, 100), not of training, whose first third is all plateau. The primary gap (value, interval,
    units) and the headline's early, late and change values match a hand computation; a seed with one
    analysable checkpoint is left out, named; a segment at a single step has no thirds."""
    rng = np.random.default_rng(3)
    tracks = []
    for seed in range(4):
        for arm in ("adamw", "muon"):
            t = track(arm, 0.0, seed, np.exp(rng.normal(0, 0.3, 12)), rng.uniform(0.1, 0.9, 12))
            stable_to = 100 if seed < 3 else 40  # seed 3: one checkpoint (step 50) left to analyse
            t.rows[:] = [
                replace(r, on_plateau=r.step <= 40, phase="stable" if r.step <= max(stable_to, 50) else "decay")
                for r in t.rows
            ]
            tracks.append(t)
    data = level_data([], tracks, (0.0,))
    by = {(t.arm, t.seed): t for t in tracks}
    assert [r.step for r in by["muon", 0].early_and_late()[0]] == [50, 60]
    assert [r.step for r in by["muon", 0].early_and_late()[1]] == [90, 100]
    gaps = [_rho(by["muon", k], 1) - _rho(by["muon", k], 0) - _rho(by["adamw", k], 1) + _rho(by["adamw", k], 0)
            for k in range(3)]  # fmt: skip
    gap = _by_name(primary_family(data))["rho_within_change_gap"]
    assert gap.n_seeds == 3 and gap.value == pytest.approx(np.mean(gaps))
    ref = scipy_stats.ttest_1samp(gaps, 0.0).confidence_interval(0.95)
    assert gap.ci95 == pytest.approx([ref.low, ref.high])
    assert gap.n_units == 3 * 2 * 4  # three seeds, two arms, two checkpoints early and two late
    assert "seed 3: muon: fewer than two stable checkpoints off the plateau" in gap.note
    e = _by_name([x for x in headline(data)[0] if x.scope == "all"])
    for arm in ("muon", "adamw"):
        early, late = (e[f"rho_within_{arm}_{k}"] for k in ("early", "late"))
        assert [x["early"] for x in early.per_level] == pytest.approx([_rho(by[arm, k], 0) for k in range(3)])
        assert [x["late"] for x in late.per_level] == pytest.approx([_rho(by[arm, k], 1) for k in range(3)])
        rises = [_rho(by[arm, k], 1) - _rho(by[arm, k], 0) for k in range(3)]
        assert e[f"rho_within_{arm}_change"].value == pytest.approx(np.mean(rises))
        assert f"{arm} seed 3" in early.note
    assert e["rho_within_change_gap"].value == pytest.approx(np.mean(gaps))
    one_step = replace(by["muon", 0], rows=[replace(r, step=70) for r in by["muon", 0].rows])
    assert one_step.early_and_late() == ([], [])


def test_a_track_wholly_on_the_plateau_is_left_out_of_rho_within_with_a_note():
    """AdamW's seed 1 at the first s on the plateau throughout: the rho_within entries keep the real
    seed ids (0, 2, 3), the change gap pairs seed k of Muon with seed k of AdamW (hand computation),
    and a note names the seed left out. Every AdamW track on the plateau: no entry, and a note."""
    data = _on_plateau(_experiment(np.random.default_rng(7), 4), "adamw", 0.0, {1})
    e = _by_name([x for x in headline(data)[0] if x.scope == "all"])
    early = e["rho_within_adamw_early"]
    assert [x["seed"] for x in early.per_level] == [0, 2, 3] and early.n_seeds == 3
    assert "adamw seed 1" in early.note and e["rho_within_muon_early"].n_seeds == 4
    tracks = {(t.arm, t.seed): t for t in data.tracks if t.s == 0.0}
    gaps = [
        _rho(tracks["muon", k], 1)
        - _rho(tracks["muon", k], 0)
        - _rho(tracks["adamw", k], 1)
        + _rho(tracks["adamw", k], 0)
        for k in (0, 2, 3)
    ]
    gap = e["rho_within_change_gap"]
    assert [x["seed"] for x in gap.per_level] == [0, 2, 3] and gap.n_seeds == 3
    assert [x["value"] for x in gap.per_level] == pytest.approx(gaps)
    ref = scipy_stats.ttest_1samp(gaps, 0.0).confidence_interval(0.95)
    assert gap.ci95 == pytest.approx([ref.low, ref.high])
    assert "adamw seed 1" in gap.note and "muon seed(s) 1" in gap.note

    data = _on_plateau(_experiment(np.random.default_rng(7), 2), "adamw", 0.0, {0, 1})
    e = _by_name([x for x in headline(data)[0] if x.scope == "all"])["rho_within_change_gap"]
    assert e.value is None and "no trajectory with two stable checkpoints" in e.note and "adamw seed 0" in e.note


def test_zipf_entries_pair_seeds_by_id_not_by_position():
    """AdamW's seed 1 at the last s has no checkpoint off the plateau: its Zipf entry and point use
    seeds 0, 2, 3 of both (AdamW's seed 2 at the last s over Muon's seed 2 at the first, not Muon's
    seed 1), against a hand computation from the tracks."""
    data = _on_plateau(_experiment(np.random.default_rng(8), 4), "adamw", 1.0, {1})
    entries, points = headline(data)
    mean = {(t.arm, t.s, t.seed): np.mean([r.value("hidden_nds") for r in t.rows]) for t in data.tracks}
    seeds = [0, 2, 3]
    ratios = np.array([mean["adamw", 1.0, k] / mean["muon", 0.0, k] for k in seeds])
    ref = np.exp(scipy_stats.ttest_1samp(np.log(ratios), 0.0).confidence_interval(0.95))
    pooled = np.mean([mean["adamw", 1.0, k] for k in seeds]) / np.mean([mean["muon", 0.0, k] for k in seeds])
    e = _by_name([x for x in entries if x.scope == "hidden"])["normalized_nds_adamw_s1"]
    assert e.n_seeds == 3 and sorted({x["seed"] for x in e.per_level}) == seeds
    assert e.value == pytest.approx(pooled) and e.ci95 == pytest.approx(list(ref))
    assert "muon at s = 0 seed(s) 1" in e.note
    point = next(z for z in points if (z.arm, z.s, z.scope) == ("adamw", 1.0, "hidden"))
    assert point.seeds == seeds and point.per_seed == pytest.approx([mean["adamw", 1.0, k] for k in seeds])
    assert point.value == pytest.approx(pooled) and point.ci95 == pytest.approx(list(ref))
    muon = next(z for z in points if (z.arm, z.s, z.scope) == ("muon", 1.0, "hidden"))
    assert muon.seeds == [0, 1, 2, 3] and muon.n_seeds == 4  # Muon's own seed 1 is not on the plateau


def test_the_primary_family_tests_claims_from_min_seeds_seeds(monkeypatch):
    """Holm's family takes the claims with at least ``statistics.MIN_SEEDS`` seeds (not a fixed 3)."""
    monkeypatch.setattr(statistics, "MIN_SEEDS", 2)
    e = _by_name(primary_family(_experiment(np.random.default_rng(1), 2)))["between_nds_ratio"]
    assert e.n_seeds == 2 and e.p_holm is not None and e.direction != statistics.FEW_SEEDS


def _hand_sign_flip(x, null, alternative):
    """The sign-flip p by explicit enumeration of the 2^n sign vectors (the reference)."""
    import itertools

    d = [v - null for v in x]
    observed = sum(d)
    count = 0
    for signs in itertools.product((1, -1), repeat=len(d)):
        t = sum(s * v for s, v in zip(signs, d))
        if alternative == "greater":
            count += t >= observed - 1e-12
        elif alternative == "less":
            count += t <= observed + 1e-12
        else:
            count += abs(t) >= abs(observed) - 1e-12
    return count / 2 ** len(d)


def test_exact_p_beside_the_t_model_matches_a_hand_enumeration_at_5_seeds():
    """Each judged claim's p_exact is the sign-flip p of its per-seed log ratios (or values) against the
    null, one-sided in the claim's direction (two-sided for an "about" claim), enumerated by hand; the
    floor is 1/32 one-sided and 1/16 two-sided at 5 seeds; a verdict that only the t model backs says so."""
    entries = {e.name: e for e in primary_family(_experiment(np.random.default_rng(21), 5))}
    paired = entries["paired_direction_ratio"]
    logs = [math.log(s["value"]) for s in paired.per_seed]
    assert paired.p_exact == pytest.approx(_hand_sign_flip(logs, 0.0, "greater"), abs=1e-15)
    assert paired.p_exact_min == 1 / 32 and paired.exact_test.startswith("sign flips")
    alignment = entries["alignment_ratio"]  # an "about" claim: two-sided
    logs = [math.log(s["value"]) for s in alignment.per_seed]
    assert alignment.p_exact == pytest.approx(_hand_sign_flip(logs, 0.0, "two-sided"), abs=1e-15)
    assert alignment.p_exact_min == 1 / 16 and "within each seed's pair" in alignment.exact_test
    gap = entries["rho_within_change_gap"]  # a difference: the values themselves against 0
    values = [s["value"] for s in gap.per_seed]
    assert gap.p_exact == pytest.approx(_hand_sign_flip(values, 0.0, "greater"), abs=1e-15)
    # every log ratio above 1 at 5 seeds: the exact p sits at its floor, and Holm over the family can't reach
    # 0.05 with it, so a t-model verdict is labelled
    supported = [e for e in entries.values() if e.direction == statistics.SUPPORTED and e.exact_backed is False]
    for e in supported:
        assert e.verdict_text.startswith(f"{statistics.SUPPORTED} (t model; ")
    assert all(e.verdict_text == e.direction for e in entries.values() if e.exact_backed is not False)


def test_an_exact_floor_that_holm_cannot_pass_is_labelled():
    """5 seeds, all on the claimed side: p_exact = 1/32 = the floor; Holm over two or more claims needs a
    p below 0.025, so the exact test can't back the t model's verdict and the table says so."""
    entries = {e.name: e for e in primary_family(_experiment(np.random.default_rng(22), 5))}
    paired = entries["paired_direction_ratio"]
    assert paired.direction == statistics.SUPPORTED and paired.p_exact == 1 / 32
    assert paired.exact_backed is False
    assert paired.verdict_text == "supported (t model; the exact floor is 1/32)"
    eight = {e.name: e for e in primary_family(_experiment(np.random.default_rng(22), 8))}["paired_direction_ratio"]
    assert eight.p_exact == 1 / 256 and eight.exact_backed is True and eight.verdict_text == statistics.SUPPORTED


def test_disjoint_aa_pairs_and_power_against_the_noncentral_t():
    from curvlab.inference.exact_tests import aa_power_closed_form

    assert PRESETS["micro"].aa_seed_pairs() == [(0, 1), (1, 2), (2, 3)]
    disjoint = PRESETS["standard"].changed(seeds=8, aa_pairs="disjoint")
    assert disjoint.aa_seed_pairs() == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert disjoint.changed(calibration=False).aa_seed_pairs() == []
    with pytest.raises(CurvlabError, match="aa_pairs"):
        disjoint.changed(aa_pairs="random").validate()
    records = _aa_records(np.random.default_rng(23), 4)
    for k, r in enumerate(records):
        r.seed = 2 * k + 1
    c = calibration(records, pairs=disjoint.aa_seed_pairs(), sims=20000)
    assert c.pairs == [[0, 1], [2, 3], [4, 5], [6, 7]] and c.kind == "smoke test"  # 2 tests: too few for a rate
    assert c.claims == ["between_nds_ratio", "alignment_ratio"]
    for t, claim in zip(c.per_test, ("between_nds_ratio", "alignment_ratio")):
        e = {x.name: x for x in _judge_aa(records)}[claim]
        logs = np.log([s["value"] for s in e.per_seed])
        sd = float(logs.std(ddof=1))
        for label, factor in (("x1.5", 1.5), ("x2", 2.0)):
            hand = aa_power_closed_form(sd, logs.size, factor, 0.05, 2)
            se = math.sqrt(hand * (1 - hand) / 20000)
            assert abs(t["power"][label] - hand) <= 4 * se + 1e-12, (claim, label)
    assert c.power["x2"] == pytest.approx(np.mean([t["power"]["x2"] for t in c.per_test]))


def _judge_aa(records):
    from curvlab.studies.primary import _judge

    claims = tuple(c for c in PRIMARY if c.between_runs)
    return _judge(claims, level_data(s_values=(0.0,)), records, statistics.CONFIDENCE)


def test_the_exact_test_takes_the_side_of_the_ratio_when_denominators_are_negative():
    """Fieller with every denominator negative: a/b > 1 is a - b < 0, so the contrast's sign is flipped
    before the one-sided flip test (else a ratio above 1 would read as evidence below it)."""
    from curvlab.studies.primary import _exact
    from curvlab.studies.seed_values import SeedValues

    claim = next(c for c in PRIMARY if c.name == "between_nds_ratio")  # greater than 1
    num, den = [-3.0, -2.5, 0.5, -3.5, -2.8], [-1.0, -1.1, -0.9, -1.2, -1.0]  # seed 2's ratio is negative
    inf = statistics.ratio_inference(num, den, claim.null)
    assert inf.method == statistics.FIELLER and inf.value > 1
    ex = _exact(claim, SeedValues(list(range(5)), num, den, [1] * 5), inf, statistics.SUPPORTED)
    contrast = [-(a - b) for a, b in zip(num, den)]  # (a - b) < 0 is the ratio above 1
    assert ex.p == pytest.approx(_hand_sign_flip(contrast, 0.0, "greater")) and ex.p < 0.1
    assert _hand_sign_flip([a - b for a, b in zip(num, den)], 0.0, "greater") > 0.9  # the unflipped side


def test_the_trajectory_claims_a_a_puts_two_seeds_of_one_arm_in_the_arms_places():
    """The Zipf gap and rho_within claims' A/A (issue 50): per arm and A/A pair (a, b), seed a's trajectories in
    AdamW's place and seed b's in Muon's, through the claim's own data rule: a gap change of exactly what the
    two seeds' trajectories give, and a false verdict where one seed of each pair differs."""
    from curvlab.studies.primary import same_arm_tracks
    from curvlab.studies.seed_values import claim_inputs

    def data(bias: float):
        tracks = []
        for seed in range(8):
            for s in (0.0, 1.0):
                for arm in ("adamw", "muon"):
                    level = 1.0 + 0.01 * seed + (bias if seed % 2 and s == 1.0 else 0.0)
                    rng = np.random.default_rng(seed * 10 + int(s))
                    nds = level * np.exp(rng.normal(0, 0.05, 6))
                    tracks.append(track(arm, s, seed, nds, within=0.5 * nds * np.linspace(1, 1.05 + bias, 6)))
        return level_data([], tracks)

    pairs = [(0, 1), (2, 3), (4, 5), (6, 7)]
    relabelled = same_arm_tracks(data(0.0), "muon", pairs)
    assert {(t.arm, t.seed) for t in relabelled.tracks} == {(a, k) for a in ("adamw", "muon") for k in range(4)}
    zipf = next(c for c in PRIMARY if c.name == "zipf_gap_change")
    values = claim_inputs(zipf, relabelled, [])
    by = {
        (t.arm, t.s, t.seed): float(np.mean([r.value("hidden_nds") for r in t.after_warmup()]))
        for t in data(0.0).tracks
    }
    a, b = 2, 3  # pair 1: seed 2 as AdamW, seed 3 as Muon
    hand = (by[("muon", 1.0, a)] - by[("muon", 1.0, b)] - by[("muon", 0.0, a)] + by[("muon", 0.0, b)]) / by[
        ("muon", 0.0, b)
    ]
    assert values.numerator[1] == pytest.approx(hand, rel=1e-12)
    biased = calibration([], data=data(2.0), pairs=pairs)
    rows = [t for t in biased.per_test if t["claim"] in ("zipf_gap_change", "rho_within_change_gap")]
    assert {t["comparison"] for t in rows} == {"adamw/adamw trajectories", "muon/muon trajectories"}
    assert any(t["false"] for t in rows if t["claim"] == "zipf_gap_change")  # odd seeds sharper at s = 1: flagged
    assert {"zipf_gap_change", "rho_within_change_gap"} <= set(biased.claims)
