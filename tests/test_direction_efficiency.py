"""Direction efficiency (issue 50, docs/science.md section 12): the quadratic model's optimal step along a paired
direction on the hidden matrices (η* = <G_h, Z_h> / <Z_h, H Z_h>, its predicted decrease ½||G_h||² q and the loss
it realizes) against a dense float64 Hessian, a brute-force line search and a hand evaluation of the loss; the
primary claim's per-seed values and its descriptive rows on synthetic per-level data; the rule set in
``summary.json``, old summaries included."""

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy import stats as scipy_stats

from curvlab.analysis.directions import (
    DIRECTION_KEYS,
    Direction,
    PairedDirection,
    PairedDirections,
    measure_directions,
)
from curvlab.engine import params as param_dicts
from curvlab.engine.hvp import CurvaturePoint
from curvlab.inference import statistics
from curvlab.output.text import primary_table
from curvlab.studies.headline import headline
from curvlab.studies.paper import MUON_OVER_ADAMW, POST_HOC_RULES, PRIMARY, RULE_SETS
from curvlab.studies.primary import PrimaryEntry, primary_family
from curvlab.studies.seed_values import efficiency_values, optimal_step_values
from curvlab.studies.summary import QuadraticRecord, Summary
from curvlab.studies.tuning import TuningRecord
from tests.synthetic import level_data, record

HIDDEN = ["w1", "w2"]


# -- the optimal step at one point, on a tiny model with a dense float64 Hessian ----------------------------------


def _loss(params, batch):
    """A two-hidden-layer tanh network's squared error: ``w1`` and ``w2`` are the hidden matrices, ``head`` the rest."""
    x, y = batch
    h = torch.tanh(torch.tanh(x @ params["w1"].T) @ params["w2"].T)
    return ((h @ params["head"].T - y) ** 2).mean()


@pytest.fixture(scope="module")
def problem():
    """The tiny model's parameters, batch, gradient and dense Hessian (torch.autograd.functional.hessian: no
    LayerNorm here), all float64 and independent of curvlab's HVPs."""
    gen = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(4, 3, generator=gen, dtype=torch.float64),
        "w2": torch.randn(4, 4, generator=gen, dtype=torch.float64) * 0.8,
        "head": torch.randn(2, 4, generator=gen, dtype=torch.float64),
    }
    batch = (
        torch.randn(16, 3, generator=gen, dtype=torch.float64),
        torch.randn(16, 2, generator=gen, dtype=torch.float64),
    )

    def flat_loss(flat):
        return _loss(param_dicts.unflatten(flat, params), batch)

    flat = param_dicts.flatten(params)
    H = torch.autograd.functional.hessian(flat_loss, flat)
    x = flat.clone().requires_grad_()
    (g,) = torch.autograd.grad(flat_loss(x), x)
    mask = param_dicts.flatten({n: torch.full_like(t, float(n in HIDDEN)) for n, t in params.items()})
    return params, batch, g.detach(), H.detach(), mask.bool()


def _hidden_eigenvectors(H, mask):
    """The hidden block's eigenpairs (ascending), as full-length vectors zero off the hidden matrices."""
    block = H[mask][:, mask]
    values, vectors = torch.linalg.eigh(block)
    full = torch.zeros(H.shape[0], vectors.shape[1], dtype=torch.float64)
    full[mask] = vectors
    return values, full


def _directions(params, H, mask):
    """A direction with <Z_h, H Z_h> > 0 (a positive eigenvector's mix with a random part, and a head part that
    the hidden scope leaves out), and one with <Z_h, H Z_h> < 0 (the hidden block's lowest eigenvector)."""
    values, vectors = _hidden_eigenvectors(H, mask)
    assert values[0] < 0 < values[-1]  # (an indefinite hidden block: both cases are there)
    gen = torch.Generator().manual_seed(1)
    noise = torch.randn(H.shape[0], generator=gen, dtype=torch.float64)
    up = vectors[:, -1] + 0.05 * noise  # (the head part of the noise: off the hidden scope)
    down = vectors[:, 0] + 0.5 * (~mask) * noise
    return [
        Direction("adamw", param_dicts.unflatten(up, params), "test", "lr"),
        Direction("muon", param_dicts.unflatten(down, params), "test", "lr"),
    ]


def _reference(g, H, z, mask):
    """(<G_h, Z_h>, <Z_h, H Z_h>, ||G_h||²) from the dense float64 quantities."""
    zh, gh = z * mask, g * mask
    return float(gh @ zh), float(zh @ H @ zh), float(gh @ gh)


def _line_search(gz: float, zhz: float) -> tuple[float, float]:
    """The quadratic model's best decrease η gz − ½ η² zhz by brute force: a coarse grid over [-10³, 10³], then a
    fine one around its argmax. Returns (argmax, max)."""
    coarse = np.linspace(-1e3, 1e3, 2_000_001)
    model = coarse * gz - 0.5 * coarse**2 * zhz
    k = int(np.argmax(model))
    fine = np.linspace(coarse[max(k - 1, 0)], coarse[min(k + 1, coarse.size - 1)], 200_001)
    model = fine * gz - 0.5 * fine**2 * zhz
    k = int(np.argmax(model))
    return float(fine[k]), float(model[k])


def test_the_optimal_step_matches_a_line_search_of_the_dense_quadratic_model_and_the_loss_there(problem):
    params, batch, g, H, mask = problem
    dirs = _directions(params, H, mask)
    with CurvaturePoint(_loss, params, batch, dtype=torch.float64) as point:
        up, down = measure_directions(point, dirs, HIDDEN, optimal=True)
    z = param_dicts.flatten(dirs[0].z)
    gz, zhz, gg = _reference(g, H, z, mask)
    assert zhz > 0 and up.hidden.nds == pytest.approx(zhz / float((z * mask) @ (z * mask)), rel=1e-10)
    eta, best = _line_search(gz, zhz)
    # η*: the grid's argmax (its spacing is 1e-8); the predicted optimum: the grid's max, and ½||G_h||² q
    eta_star = gz / zhz
    assert abs(eta_star - eta) <= 1e-8
    assert up.hidden.optimal_predicted == pytest.approx(best, rel=1e-12)
    assert up.hidden.optimal_predicted == pytest.approx(0.5 * gg * up.hidden.q, rel=1e-10)
    assert up.hidden.grad_norm**2 == pytest.approx(gg, rel=1e-12)
    # the realized decrease: the loss by hand at W - η* Z_h (the head untouched), on the same batch
    stepped = param_dicts.unflatten(param_dicts.flatten(params) - eta_star * (z * mask), params)
    by_hand = float(_loss(params, batch) - _loss(stepped, batch))
    assert up.hidden.optimal_realized == pytest.approx(by_hand, rel=1e-10)
    assert abs(up.hidden.optimal_realized - up.hidden.optimal_predicted) < 0.5 * up.hidden.optimal_predicted
    # no optimum where <Z_h, H Z_h> <= 0, and none measured over all parameters
    assert _reference(g, H, param_dicts.flatten(dirs[1].z), mask)[1] < 0 and down.hidden.nds < 0
    assert math.isnan(down.hidden.optimal_predicted) and math.isnan(down.hidden.optimal_realized)
    assert all(math.isnan(d.all.optimal_predicted) and math.isnan(d.all.optimal_realized) for d in (up, down))


def test_the_optimal_step_costs_one_forward_per_direction_with_an_optimum_and_nothing_unasked(problem):
    params, batch, _, H, mask = problem
    dirs = _directions(params, H, mask)
    calls = []

    def counted(p, b):
        calls.append(1)
        return _loss(p, b)

    for optimal, extra in ((False, 0), (True, 1)):  # (the second direction has no optimum: no forward)
        with CurvaturePoint(counted, params, batch, dtype=torch.float64) as point:
            before = len(calls)
            measured = measure_directions(point, dirs, HIDDEN, optimal=optimal)
            assert len(calls) - before == extra
        if not optimal:
            assert all(math.isnan(d.hidden.optimal_predicted) for d in measured)


def test_a_loss_not_finite_at_the_optimal_step_is_an_unbounded_rise_not_a_failed_analysis(problem):
    params, batch, _, H, mask = problem

    def blows_up(p, b):  # finite at W (its gradient and Hessian are _loss's), infinite anywhere else
        loss = _loss(p, b)
        return loss if all(torch.equal(p[n], params[n]) for n in HIDDEN) else loss + math.inf

    with CurvaturePoint(blows_up, params, batch, dtype=torch.float64) as point:
        up, _ = measure_directions(point, _directions(params, H, mask), HIDDEN, optimal=True)
    assert up.hidden.optimal_realized == -math.inf and up.hidden.optimal_predicted > 0
    paired = PairedDirections("adam", "adamw", (up,), tuple(HIDDEN), 1.0)
    assert paired.scalars()["paired_optreal_adamw_hidden"] == -math.inf


def test_paired_directions_keep_the_optimal_step_and_older_reports_read_it_as_nan(problem):
    params, batch, _, H, mask = problem
    with CurvaturePoint(_loss, params, batch, dtype=torch.float64) as point:
        measured = measure_directions(point, _directions(params, H, mask), HIDDEN, optimal=True)
    paired = PairedDirections("adam", "adamw", measured, tuple(HIDDEN), 1.0)
    d = json.loads(json.dumps(paired.to_dict()))
    assert set(d["directions"][0]["hidden"]) == set(DIRECTION_KEYS) == set(d["directions"][0]["all"])
    back = PairedDirections.from_dict(d)
    up = back.get("adamw").hidden
    assert up.optimal_predicted == measured[0].hidden.optimal_predicted
    assert up.optimal_realized == measured[0].hidden.optimal_realized
    scalars = back.scalars()
    assert scalars["paired_optpred_adamw_hidden"] == measured[0].hidden.optimal_predicted
    assert scalars["paired_optreal_adamw_hidden"] == measured[0].hidden.optimal_realized
    # a direction without an optimum has no such scalars (no NaN in a window's mean), nor has the scope "all"
    assert "paired_optpred_muon_hidden" not in scalars and "paired_optreal_muon_hidden" not in scalars
    assert "paired_optpred_adamw_all" not in scalars and scalars["paired_nds_muon_hidden"] < 0
    # a report written before the optimal step was measured: the keys are absent, and read as NaN
    for direction in d["directions"]:
        for scope in ("all", "hidden"):
            del direction[scope]["optimal_predicted"], direction[scope]["optimal_realized"]
    old = PairedDirections.from_dict(d)
    assert math.isnan(old.get("adamw").hidden.optimal_realized)
    assert not [k for k in old.scalars() if k.startswith(("paired_optpred", "paired_optreal"))]
    assert old.get("adamw").hidden.nds == measured[0].hidden.nds
    assert isinstance(old.get("muon"), PairedDirection)


# -- the claim's per-seed values, on synthetic per-level data ---------------------------------------------------


def _point(cos_a=0.2, cos_m=0.3, nds_a=6.0, nds_m=2.0):
    """One analysed point's paired scalars on the hidden matrices (q = cos² / NDS, as the reports give it), with
    the optimal step's where there is one (NDS > 0): predicted ½ gz² / zhz, realized a share of it."""
    x = {}
    for arm, cos, nds in (("adamw", cos_a, nds_a), ("muon", cos_m, nds_m)):
        x |= {f"paired_nds_{arm}_hidden": nds, f"paired_cos_{arm}_hidden": cos, f"paired_q_{arm}_hidden": cos**2 / nds}
        if nds > 0:
            predicted, share = 0.5 * cos**2 / nds, 0.9 if arm == "adamw" else 0.7
            x |= {f"paired_optpred_{arm}_hidden": predicted, f"paired_optreal_{arm}_hidden": predicted * share}
    x |= {"hidden_nds": nds_a, "nds": nds_a}
    return x


def _efficiency_data(rng, n_seeds=4, levels=4):
    """Seeds of matched comparisons whose points hold paired scalars, some with NDS <= 0: seed 1 has one point
    where AdamW's NDS is negative and one where Muon's is, seed 2 two where both are; seed 3's AdamW NDS is
    negative at most points (its median over every point is negative)."""
    records = []
    for seed in range(n_seeds):
        sides = []
        for _ in range(2):
            sides.append(
                [
                    _point(0.2 * np.exp(rng.normal(0, 0.2)), 0.3, 6.0 * np.exp(rng.normal(0, 0.3)), 2.0)
                    for _ in range(levels)
                ]
            )
        a, b = sides
        if seed == 1:
            a[0] = _point(nds_a=-1.5)
            b[1] = _point(nds_m=-0.5)
        if seed == 2:
            a[2] = b[3] = _point(nds_a=-2.0, nds_m=-1.0)
        if seed == 3:
            for k in range(3):
                a[k] = _point(nds_a=-3.0)
                b[k] = _point(nds_a=-3.0)
        records.append(record("adamw/muon", seed, a, b))
    return level_data(records, [], (0.0,))


def _points(data):
    """Per seed, every analysed point's paired scalars (the window members of both sides)."""
    return [
        [s.members[0].paired for lv in r.comparison.levels for s in (lv.a, lv.b)] for r in data.matched("adamw/muon")
    ]


def test_the_claim_leaves_out_and_counts_points_without_an_optimum_and_the_descriptive_row_keeps_them():
    data = _efficiency_data(np.random.default_rng(0))
    e = {x.name: x for x in primary_family(data)}["direction_efficiency_ratio"]
    per_seed = _points(data)

    def ratio(p):
        return p["paired_q_muon_hidden"] / p["paired_q_adamw_hidden"]

    def optimum(p):
        return p["paired_nds_adamw_hidden"] > 0 and p["paired_nds_muon_hidden"] > 0

    medians = [float(np.median([ratio(p) for p in ps if optimum(p)])) for ps in per_seed]
    assert all(m > 0 for m in medians)
    ref = scipy_stats.ttest_1samp(np.log(medians), 0.0)
    assert e.method == statistics.LOG_T and e.kind == "ratio" and e.n_seeds == 4
    assert [s["value"] for s in e.per_seed] == pytest.approx(medians, rel=1e-12)
    assert e.value == pytest.approx(np.exp(np.mean(np.log(medians))), rel=1e-12)
    assert e.ci95 == pytest.approx(list(np.exp(ref.confidence_interval(0.95))), rel=1e-10)
    assert e.p == pytest.approx(ref.pvalue, rel=1e-10)
    kept = sum(optimum(p) for ps in per_seed for p in ps)
    assert e.n_units == kept == 4 * 8 - 2 - 2 - 6
    # counted per arm: AdamW's NDS <= 0 at 1 + 2 + 6 points, Muon's at 1 + 2, either at 10 of 32
    assert "of 32 points, 10 had NDS <= 0 (no quadratic optimum) along a direction" in e.note
    assert "9 along AdamW's, 3 along Muon's; left out of the estimate" in e.note
    assert e.rule_set == "before" and e.paper == 1.76 and e.name in MUON_OVER_ADAMW
    assert e.direction == statistics.SUPPORTED  # Muon's q is 2.25 x 3 / ... larger: (0.3² / 2) / (0.2² / 6)
    assert e.magnitude == statistics.LARGER  # about 6.75, against the paper's 1.76

    # the descriptive row: every point, q negative kept; seed 3's median is negative, so Fieller's interval with
    # unit denominators: the t interval on the mean of the medians
    row = {(x.name, x.scope): x for x in headline(data)[0]}[("direction_efficiency_ratio_all_points", "hidden")]
    every = [float(np.median([ratio(p) for p in ps])) for ps in per_seed]
    assert every[3] < 0 < min(every[:3])
    ref = scipy_stats.ttest_1samp(every, 0.0)
    assert row.verdict == statistics.DESCRIPTIVE and row.n_seeds == 4 and row.n_levels == 32
    assert [s["value"] for s in row.per_level] == pytest.approx(every, rel=1e-12)
    assert row.value == pytest.approx(np.mean(every), rel=1e-12)
    assert row.ci95 == pytest.approx(list(ref.confidence_interval(0.95)), rel=1e-9)
    assert "kept, their q negative" in row.note and "Muon over AdamW" in row.quantity
    # the same values through the seed-values rule itself, and the claim is outside the headline
    values = efficiency_values(data.matched("adamw/muon"), data, "hidden", every_point=True)
    assert values.numerator == pytest.approx(every, rel=1e-12) and values.denominator == [1.0] * 4
    assert not [x for x in headline(data)[0] if x.name == "direction_efficiency_ratio"]


def test_older_runs_without_q_are_not_measured_and_the_optimal_step_rows_follow_from_the_points():
    data = _efficiency_data(np.random.default_rng(1))
    per_seed = _points(data)
    rows = optimal_step_values(data.matched("adamw/muon"), data)
    entries = {x.name: x for x in headline(data)[0] if x.name.startswith("optimal_")}
    for arm, share in (("adamw", 0.9), ("muon", 0.7)):
        values = rows[f"realized_over_predicted_{arm}"]
        medians = [
            float(
                np.median(
                    [
                        p[f"paired_optreal_{arm}_hidden"] / p[f"paired_optpred_{arm}_hidden"]
                        for p in ps
                        if p[f"paired_nds_{arm}_hidden"] > 0
                    ]
                )
            )
            for ps in per_seed
        ]
        assert values.numerator == pytest.approx(medians) and medians == pytest.approx([share] * 4)
        e = entries[f"optimal_realized_over_predicted_{arm}"]
        assert e.value == pytest.approx(share) and e.scope == "hidden" and e.verdict == statistics.DESCRIPTIVE
    ratio = [
        float(
            np.median(
                [
                    p["paired_optreal_muon_hidden"] / p["paired_optreal_adamw_hidden"]
                    for p in ps
                    if p["paired_nds_adamw_hidden"] > 0 and p["paired_nds_muon_hidden"] > 0
                ]
            )
        )
        for ps in per_seed
    ]
    e = entries["optimal_realized_ratio"]
    assert [s["value"] for s in e.per_level] == pytest.approx(ratio)
    assert e.value == pytest.approx(np.exp(np.mean(np.log(ratio))))
    assert "Muon over AdamW" in e.quantity and "10 of 32 points without a value" in e.note
    # reports from before q and the optimal step were kept: not measured, never a crash
    for ps in per_seed:
        for p in ps:
            for key in [k for k in p if k.startswith(("paired_q_", "paired_optpred_", "paired_optreal_"))]:
                del p[key]
    e = {x.name: x for x in primary_family(data)}["direction_efficiency_ratio"]
    assert e.direction == statistics.NOT_MEASURED and "paired_q_adamw_hidden" in e.note
    for x in headline(data)[0]:
        if x.name.startswith(("optimal_", "direction_efficiency")):
            assert x.value is None and "older runs" in x.note


# -- the rule set -------------------------------------------------------------------------------------------------


def test_every_claim_has_a_rule_set_and_the_post_hoc_ones_are_those_that_say_why():
    assert all(c.rule_set in RULE_SETS for c in PRIMARY) and len(PRIMARY) <= 6
    assert {c.name for c in PRIMARY if c.rule_set == "after"} == set(POST_HOC_RULES)
    assert next(c for c in PRIMARY if c.name == "direction_efficiency_ratio").rule_set == "before"


def _summary(primary):
    return Summary(
        "micro", [], [], {}, TuningRecord("search", 0.0, 10, [0], {}, {}), [], {},
        QuadraticRecord(10.0, 0.669421, 0.922913), primary=primary,
    )  # fmt: skip


def test_the_rule_set_round_trips_and_an_older_summary_without_it_reads_by_post_hoc_rules():
    data = _efficiency_data(np.random.default_rng(2))
    primary = primary_family(data)
    d = json.loads(json.dumps(_summary(primary).to_dict()))
    assert [x["rule_set"] for x in d["primary"]] == [c.rule_set for c in PRIMARY]
    back = Summary.from_dict(d)
    assert back.primary == primary and all(isinstance(x, PrimaryEntry) for x in back.primary)
    table = primary_table(back.primary)
    for x in back.primary:
        row = next(line for line in table if line.startswith(f"| {x.quantity}:"))
        assert row.endswith("| after data |" if x.name in POST_HOC_RULES else "| before |")
    # an older summary: no rule_set in its entries; they read as "", and the table marks them as it did
    for x in d["primary"]:
        del x["rule_set"]
    old = Summary.from_dict(d)
    assert all(x.rule_set == "" for x in old.primary)
    assert [x.post_hoc for x in old.primary] == [x.name in POST_HOC_RULES for x in old.primary]
    assert primary_table(old.primary) == table
    # a post-hoc claim that an entry itself says was registered before is shown as its entry says
    moved = [replace(x, rule_set="before") for x in old.primary]
    assert not any(x.post_hoc for x in moved) and "after data" not in "\n".join(primary_table(moved))
