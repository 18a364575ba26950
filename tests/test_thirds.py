"""Observations 3 and 4 by thirds of training at matched loss (curvlab.studies.thirds), against references computed
here by hand from the raw window members of standard's committed levels.json (8 seeds, 6 matched levels each, s = 0);
an "s = 1" reproduction is standard's comparisons with s set to 1 and one arm's scalars scaled by a known factor."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from curvlab.errors import CurvlabError
from curvlab.inference.statistics import ALPHA, FEW_SEEDS
from curvlab.studies.primary import estimated
from curvlab.studies.records import ComparisonRecord, LevelData
from curvlab.studies.thirds import (
    QUANTITIES,
    RISES,
    THIRDS,
    ThirdEstimate,
    by_thirds,
    levels_in_third,
    rho_within,
    split_levels,
    thirds,
)

LEVELS = Path(__file__).resolve().parents[1] / "docs" / "results" / "standard" / "levels.json"
SCOPE_NDS = {"hidden": "hidden_nds", "all": "nds"}
RHO = {"all": ("within", "nds"), "hidden": ("within_layers", "nds_layers")}


@pytest.fixture(scope="module")
def standard() -> LevelData:
    return LevelData.load(LEVELS)


@pytest.fixture(scope="module")
def result(standard):
    """by_thirds of standard at s = 0 and of itself relabelled s = 1 with AdamW's NDS x1.5 (both scopes)."""
    return by_thirds({0.0: standard, 1.0: at_s1(standard, nds_factor=1.5)})


# ---- hand references (none of curvlab's aggregation: the window members' raw scalars) ----


def raw(side, key: str) -> float:
    return float(np.mean([m.value(key) for m in side.members]))


def arms(level) -> dict:
    return {side.optimizer: side for side in (level.a, level.b)}


def hand_thirds(levels) -> list[list]:
    """Off the plateau, highest target first, cut into 3 with the larger parts first (array_split's sizes)."""
    off = sorted((lv for lv in levels if not lv.on_plateau), key=lambda lv: lv.target, reverse=True)
    q, r = divmod(len(off), 3)
    sizes = [q + (i < r) for i in range(3)]
    starts = np.cumsum([0, *sizes])
    return [off[starts[i] : starts[i + 1]] for i in range(3)]


def primary_records(data: LevelData) -> list[ComparisonRecord]:
    return sorted((r for r in data.comparisons if r.name == "adamw/muon"), key=lambda r: r.seed)


def hand_log_t(a, b):
    r = np.asarray(a) / np.asarray(b)
    x = np.log(r)
    n = x.size
    h = stats.t.ppf(0.975, n - 1) * x.std(ddof=1) / np.sqrt(n)
    return float(np.exp(x.mean())), [float(np.exp(x.mean() - h)), float(np.exp(x.mean() + h))], r


def hand_fieller(a, b):
    a, b = np.asarray(a), np.asarray(b)
    n = a.size
    t2 = stats.t.ppf(0.975, n - 1) ** 2
    vaa, vbb = a.var(ddof=1) / n, b.var(ddof=1) / n
    vab = float(np.sum((a - a.mean()) * (b - b.mean())) / (n - 1) / n)
    # (ā − ρ b̄)² = t² (v_aa − 2ρ v_ab + ρ² v_bb), a quadratic in ρ
    coefficients = [b.mean() ** 2 - t2 * vbb, -2 * (a.mean() * b.mean() - t2 * vab), a.mean() ** 2 - t2 * vaa]
    assert coefficients[0] > 0  # a bounded interval
    return float(a.mean() / b.mean()), sorted(np.roots(coefficients).real.tolist())


def scaled_members(side, factor: float, keys: tuple[str, ...] = ("nds",), paired: dict | None = None):
    """The side with each member's scalars scaled: ``keys`` among nds / within (both scopes' NDS for "nds"), and the
    paired ones by their own factors."""
    members = []
    for m in side.members:
        changes = {}
        if "nds" in keys:
            changes |= {
                "all": replace(m.all, nds=m.all.nds * factor),
                "hidden": replace(m.hidden, nds=m.hidden.nds * factor),
            }
        if "within" in keys:
            changes["within"] = m.within * factor
        if paired:
            changes["paired"] = {k: v * paired.get(k, 1.0) for k, v in m.paired.items()}
        members.append(replace(m, **changes))
    return replace(side, members=members)


def map_arm(data: LevelData, arm: str, change, s: float | None = None, which=lambda record, level: True) -> LevelData:
    """``data`` with ``change`` applied to ``arm``'s side of the chosen levels of every comparison (s set to ``s``)."""
    records = []
    for r in data.comparisons:
        c = r.comparison
        if c is not None:
            levels = []
            for lv in c.levels:
                if which(r, lv):
                    lv = replace(lv, a=change(lv.a) if lv.a.optimizer == arm else lv.a)
                    lv = replace(lv, b=change(lv.b) if lv.b.optimizer == arm else lv.b)
                levels.append(lv)
            c = replace(c, levels=levels)
        records.append(replace(r, comparison=c, s=r.s if s is None else s))
    return LevelData(records, [], data.plateau_ceiling, list(data.s_values))


def at_s1(data: LevelData, nds_factor: float) -> LevelData:
    return map_arm(data, "adamw", lambda side: scaled_members(side, nds_factor), s=1.0)


def find(out, quantity, scope, s, third):
    hits = [e for e in out if (e.quantity, e.scope, e.s, e.third) == (quantity, scope, s, third)]
    assert len(hits) == 1, (quantity, scope, s, third, len(hits))
    return hits[0]


# ---- thirds ----


def test_thirds_partition_each_record_in_loss_order(standard):
    assert len(standard.comparisons) == 24
    for r in standard.comparisons:
        parts = thirds(r)
        off = sorted(r.comparison.headline_levels, key=lambda lv: -lv.target)
        assert [lv for p in parts for lv in p.comparison.levels] == off
        assert [len(p.comparison.levels) for p in parts] == [len(x) for x in np.array_split(np.arange(len(off)), 3)]
        for p in parts:
            assert (p.name, p.seed, p.s) == (r.name, r.seed, r.s)
            assert p.comparison.headline_levels == p.comparison.levels
            targets = [lv.target for lv in p.comparison.levels]
            assert targets == sorted(targets, reverse=True)
        # early above middle above late, every level of one third above every level of the next
        assert min(lv.target for lv in parts[0].comparison.levels) > max(lv.target for lv in parts[1].comparison.levels)
        assert min(lv.target for lv in parts[1].comparison.levels) > max(lv.target for lv in parts[2].comparison.levels)


@pytest.mark.parametrize("n, plateau", [(6, 0), (5, 1), (4, 2), (2, 1), (1, 0), (0, 2)])
def test_thirds_sizes_shuffled_levels_and_plateau(standard, n, plateau):
    r = primary_records(standard)[3]
    levels = list(r.comparison.levels)
    chosen = [replace(lv, on_plateau=True) for lv in levels[:plateau]] + levels[plateau : plateau + n]
    rng = np.random.default_rng(n)
    shuffled = [chosen[i] for i in rng.permutation(len(chosen))]
    parts = thirds(replace(r, comparison=replace(r.comparison, levels=shuffled)))
    assert [len(p.comparison.levels) for p in parts] == [len(x) for x in np.array_split(np.arange(n), 3)]
    assert [lv for p in parts for lv in p.comparison.levels] == [lv for part in hand_thirds(shuffled) for lv in part]
    assert not any(lv.on_plateau for p in parts for lv in p.comparison.levels)


def test_a_record_without_comparison_gives_three(standard):
    r = ComparisonRecord("adamw/muon", 9, 0.0, None, "the runs never overlap")
    parts = thirds(r)
    assert len(parts) == 3 and all(p.comparison is None and p.error == r.error and p.seed == 9 for p in parts)
    assert split_levels([]) == [[], [], []]


def test_levels_in_third_restricts_every_comparison_and_drops_tracks(standard):
    assert standard.tracks
    for k in range(3):
        third = levels_in_third(standard, k)
        assert third.tracks == [] and third.s_values == standard.s_values
        assert len(third.comparisons) == len(standard.comparisons)
        for r, t in zip(standard.comparisons, third.comparisons):
            assert t.comparison.levels == hand_thirds(r.comparison.levels)[k]
    with pytest.raises(CurvlabError):
        levels_in_third(standard, 3)


# ---- the primary claims on a third ----


@pytest.mark.parametrize("scope", ["hidden", "all"])
def test_between_ratio_on_a_third_by_hand(standard, result, scope):
    claim = QUANTITIES["between_nds_ratio" if scope == "hidden" else "between_nds_ratio_all"]
    key = SCOPE_NDS[scope]
    for k in range(3):
        a, b = [], []
        for r in primary_records(standard):
            levels = hand_thirds(r.comparison.levels)[k]
            a.append(np.mean([raw(arms(lv)["adamw"], key) for lv in levels]))
            b.append(np.mean([raw(arms(lv)["muon"], key) for lv in levels]))
        value, ci, per_seed = hand_log_t(a, b)
        (e,) = estimated(levels_in_third(standard, k), (claim,))
        assert e.method == "log-t" and e.n_seeds == 8 and e.n_units == 16
        assert e.value == pytest.approx(value, rel=1e-10)
        assert e.ci95 == pytest.approx(ci, rel=1e-10)
        assert [x["value"] for x in e.per_seed] == pytest.approx(per_seed.tolist(), rel=1e-10)
        t = find(result, "between_nds_ratio_all" if scope == "all" else "between_nds_ratio", scope, 0.0, THIRDS[k])
        assert t.value == pytest.approx(value, rel=1e-10) and t.ci95 == pytest.approx(ci, rel=1e-10)
        assert not t.judged and t.verdict is None and t.p_holm is None


def test_paired_claims_read_only_the_third(standard, result):
    """A third's paired points are its windows' members alone (the trajectories dropped): 2 levels x 2 arms x
    3 members a seed."""
    for k in range(3):
        e = find(result, "paired_direction_ratio", "hidden", 0.0, THIRDS[k])
        points = {
            (r.seed, side.optimizer, m.step)
            for r in primary_records(standard)
            for lv in hand_thirds(r.comparison.levels)[k]
            for side in (lv.a, lv.b)
            for m in side.members
        }
        assert e.n_units == len(points) and e.n_seeds == 8


# ---- observation 3 ----


def hand_gaps(data: LevelData, k: int, key: str, factor: float = 1.0) -> dict[int, float]:
    return {
        r.seed: float(
            np.mean(
                [
                    factor * raw(arms(lv)["adamw"], key) - raw(arms(lv)["muon"], key)
                    for lv in hand_thirds(r.comparison.levels)[k]
                ]
            )
        )
        for r in primary_records(data)
    }


def test_gap_ratio_by_hand(standard, result):
    methods = set()
    for scope, key in SCOPE_NDS.items():
        for k in range(3):
            g0, g1 = hand_gaps(standard, k, key), hand_gaps(standard, k, key, factor=1.5)
            seeds = sorted(g0)
            a, b = [g1[i] for i in seeds], [g0[i] for i in seeds]
            r = np.array(a) / np.array(b)
            log_t = (all(x > 0 for x in b) or all(x < 0 for x in b)) and all(r > 0)
            value, ci = hand_log_t(a, b)[:2] if log_t else hand_fieller(a, b)
            e = find(result, "nds_gap_ratio", scope, None, THIRDS[k])
            assert e.method == ("log-t" if log_t else "fieller")
            methods.add(e.method)
            assert e.value == pytest.approx(value, rel=1e-9) and e.ci95 == pytest.approx(ci, rel=1e-9)
            assert [x["numerator"] for x in e.per_seed] == pytest.approx(a, rel=1e-12)
            assert [x["denominator"] for x in e.per_seed] == pytest.approx(b, rel=1e-12)
            assert e.n_seeds == 8 and e.p is not None and not e.judged
            for s, g in ((0.0, g0), (1.0, g1)):
                assert find(result, "nds_gap", scope, s, THIRDS[k]).value == pytest.approx(np.mean(list(g.values())))
    assert methods == {"log-t", "fieller"}  # (all parameters, late: seed 3's gap is negative at s = 0)


def test_gap_ratio_closed_form_and_seeds_paired_by_id(standard):
    """Both arms' NDS x2 at s = 1: every seed's gap doubles, so the ratio is 2 exactly; a seed missing at s = 1 is
    left out, and counted."""
    both = map_arm(at_s1(standard, 2.0), "muon", lambda side: scaled_members(side, 2.0))
    both = replace(both, comparisons=[r for r in both.comparisons if r.seed != 5])
    out = by_thirds({0.0: standard, 1.0: both})
    e = find(out, "nds_gap_ratio", "hidden", None, "early")
    assert e.method == "log-t" and e.value == pytest.approx(2.0, rel=1e-12) and e.n_seeds == 7
    assert e.ci95 == pytest.approx([2.0, 2.0], rel=1e-9)
    assert "seeds [5]: only at s = 0, left out" in e.note
    assert 5 not in [x["seed"] for x in e.per_seed]


def test_paired_ratio_and_q_changes_closed_form(standard):
    """AdamW's paired NDS x3 and its q /3 at s = 1: each seed's median ratio, and q's (Muon over AdamW), x3."""
    factors = {f"paired_nds_adamw_{s}": 3.0 for s in ("all", "hidden")} | {
        f"paired_q_adamw_{s}": 1 / 3 for s in ("all", "hidden")
    }
    change = lambda side: scaled_members(side, 1.0, keys=(), paired=factors)  # noqa: E731
    s1 = map_arm(map_arm(standard, "adamw", change, s=1.0), "muon", change)  # (both runs' points carry both directions)
    out = by_thirds({0.0: standard, 1.0: s1})
    for k in range(3):
        for name in ("paired_direction_ratio_change", "direction_efficiency_ratio_change"):
            e = find(out, name, "hidden", None, THIRDS[k])
            assert e.method == "log-t" and e.n_seeds == 8
            assert e.value == pytest.approx(3.0, rel=1e-9)
            assert [x["value"] for x in e.per_seed] == pytest.approx([3.0] * 8, rel=1e-9)


# ---- observation 4 ----


def hand_rho(record, k: int, arm: str, scope: str) -> float:
    within, total = RHO[scope]
    levels = hand_thirds(record.comparison.levels)[k]
    return sum(raw(arms(lv)[arm], within) for lv in levels) / sum(raw(arms(lv)[arm], total) for lv in levels)


@pytest.mark.parametrize("scope", ["all", "hidden"])
def test_rho_within_by_third_by_hand(standard, result, scope):
    for k in range(3):
        rho, notes = rho_within(standard, k, scope)
        assert notes == [] and sorted(rho) == list(range(8))
        for r in primary_records(standard):
            for arm in ("adamw", "muon"):
                assert rho[r.seed][arm] == pytest.approx(hand_rho(r, k, arm, scope), rel=1e-12)
        for arm in ("adamw", "muon"):
            e = find(result, f"rho_within_{arm}", scope, 0.0, THIRDS[k])
            hand = [hand_rho(r, k, arm, scope) for r in primary_records(standard)]
            assert e.value == pytest.approx(np.mean(hand), rel=1e-12) and e.p is None
    for k, label in zip((1, 2), RISES):
        e = find(result, "rho_within_rise_gap", scope, 0.0, label)
        hand = [
            (hand_rho(r, k, "muon", scope) - hand_rho(r, 0, "muon", scope))
            - (hand_rho(r, k, "adamw", scope) - hand_rho(r, 0, "adamw", scope))
            for r in primary_records(standard)
        ]
        h = stats.t.ppf(0.975, 7) * np.std(hand, ddof=1) / np.sqrt(8)
        assert e.value == pytest.approx(np.mean(hand), rel=1e-10)
        assert e.ci95 == pytest.approx([np.mean(hand) - h, np.mean(hand) + h], rel=1e-10)
        assert e.p == pytest.approx(2 * stats.t.sf(abs(np.mean(hand)) / (np.std(hand, ddof=1) / np.sqrt(8)), 7))


def test_only_the_two_rises_at_s0_over_all_parameters_are_judged(result):
    judged = [e for e in result if e.judged]
    assert [(e.quantity, e.scope, e.s, e.third) for e in judged] == [
        ("rho_within_rise_gap", "all", 0.0, label) for label in RISES
    ]
    assert all(e.verdict is None and e.p_holm is None for e in result if not e.judged)


def holm_two(p1: float, p2: float) -> tuple[float, float]:
    lo, hi = sorted((p1, p2))
    adjusted = {lo: min(1.0, 2 * lo), hi: min(1.0, max(2 * lo, hi))}
    return adjusted[p1], adjusted[p2]


def test_holm_and_verdicts_on_constructed_rises(standard):
    """Muon's within-layer NDS x1.6 in the middle third and x0.5 in the late: its rho rises to the middle and falls
    to the late, so the first rise is supported and the second contradicted, Holm over the two."""
    thirds_of = {
        (r.name, r.seed): [{lv.target for lv in part} for part in hand_thirds(r.comparison.levels)]
        for r in standard.comparisons
        if r.comparison
    }

    def factor_at(k: int, f: float):
        return lambda side: scaled_members(side, f, keys=("within",))

    def in_third(k):
        return lambda r, lv: lv.target in thirds_of[(r.name, r.seed)][k]

    data = map_arm(standard, "muon", factor_at(1, 1.6), which=in_third(1))
    data = map_arm(data, "muon", factor_at(2, 0.5), which=in_third(2))
    out = by_thirds({0.0: data})
    middle, late = (find(out, "rho_within_rise_gap", "all", 0.0, label) for label in RISES)
    assert middle.value > 0 > late.value
    assert (middle.p_holm, late.p_holm) == pytest.approx(holm_two(middle.p, late.p), rel=1e-12)
    assert middle.p_holm < ALPHA and late.p_holm < ALPHA
    assert (middle.verdict, late.verdict) == ("supported", "contradicted")
    # one value of s: observation 3 is not measured, and says why
    e = find(out, "nds_gap_ratio", "all", None, "late")
    assert e.value is None and "one value of s only" in e.note


def test_few_seeds_no_holm_and_what_is_left_out_is_counted(standard):
    records = [r for r in standard.comparisons if r.seed in (0, 1)]
    short = next(r for r in records if r.name == "adamw/muon" and r.seed == 1)
    records = [r for r in records if r is not short] + [
        replace(short, comparison=replace(short.comparison, levels=short.comparison.levels[:2])),
        ComparisonRecord("adamw/muon", 7, 0.0, None, "the runs never overlap"),
    ]
    out = by_thirds({0.0: replace(standard, comparisons=records, tracks=[])})
    middle, late = (find(out, "rho_within_rise_gap", "all", 0.0, label) for label in RISES)
    assert middle.n_seeds == 2 and middle.verdict == FEW_SEEDS and middle.p_holm is None
    assert late.n_seeds == 1 and late.verdict == FEW_SEEDS and late.p_holm is None
    assert "seeds [1]: no rho in one of the two thirds, left out" in late.note
    e = find(out, "between_nds_ratio", "hidden", 0.0, "late")
    assert "seeds [1]: no level in the late third, left out" in e.note
    assert "seeds [7]: no matched comparison, left out" in e.note
    assert e.n_seeds == 1


def test_estimates_round_trip_through_json(result):
    for e in result:
        again = ThirdEstimate.from_dict(json.loads(json.dumps(e.to_dict())))
        assert again.to_dict() == e.to_dict()
