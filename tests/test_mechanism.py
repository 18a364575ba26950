"""The factorial of filters and maps measured at a checkpoint (curvlab.analysis.factorial) and its aggregation
(curvlab.studies.mechanism): the cells against the paired directions and a dense float64 reference, and the
decomposition against points with a known factor structure."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from curvlab.analysis.factorial import factorial_directions, factorial_heldout_key, factorial_key, random_sv_seed
from curvlab.analysis.report import CurvatureReport, analyze
from curvlab.analysis.targets import AnalysisSettings, open_checkpoint
from curvlab.engine import params as param_dicts
from curvlab.engine.forward import forward_quadratic_form
from curvlab.engine.loss import make_loss_fn
from curvlab.jobs.measure import settings as analysis_settings
from curvlab.jobs.presets import PRESETS
from curvlab.runs.checkpoint import read_index
from curvlab.runs.train import train
from curvlab.steps.factorial import CELLS, cell_name
from curvlab.steps.update import next_update
from curvlab.studies.mechanism import MUON, TERMS, cells, decomposition, paired_parts
from tests.builders import shadow_config
from tests.synthetic import level_data, record

STEPS = 4


@pytest.fixture(scope="module", params=["adamw", "muon"])
def checkpoint(request, pcfg_data, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"factorial-{request.param}") / "run"
    cfg = shadow_config(
        pcfg_data, out, optimizer=request.param, steps=STEPS, eval_every=2, ckpt_every=STEPS, shadow=True
    )
    train(cfg, progress=False)
    return request.param, out / next(e["path"] for e in read_index(out) if e["step"] == STEPS)


def test_the_cells_at_a_checkpoint_are_the_arms_directions_and_the_held_out_h(checkpoint, tmp_path):
    """The two arms' own cells have the paired directions' NDS and cosine on the hidden matrices (the cells
    carry no weight decay, which these runs don't use, and are rescaled, which the hidden scope ignores);
    every cell's held-out NDS is its quadratic form under the validation batch's H in float64; the report
    keeps the cells through its JSON."""
    _, path = checkpoint
    settings = AnalysisSettings(dtype="float64", held_out=True, factorial=True)
    target = open_checkpoint(path, batches=settings.train_batches())
    r = analyze(target, settings)
    f = r.factorial
    assert [d.name for d in f.cells] == [cell_name(*c) for c in CELLS] and f.seed == random_sv_seed(target.seed, STEPS)
    own = {d.name: d.hidden for d in r.paired.directions}
    for cell, paired in ((cell_name("ema", "adam"), "adamw"), (MUON, "muon")):
        got = next(d.hidden for d in f.cells if d.name == cell)
        assert got.nds == pytest.approx(own[paired].nds, rel=1e-6) and got.cosine == pytest.approx(
            own[paired].cosine, rel=1e-6
        )
    model = target.model
    model.eval()
    loss_fn = make_loss_fn(model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    G, Z = next_update(model, target.optimizer, loss_fn, target.train_batches[0], max_grad_norm=target.grad_clip)
    hidden = r.paired.hidden_names
    for d in factorial_directions(model, target.optimizer, G, Z, target.shadow, seed=f.seed):
        zh = param_dicts.cast(
            {n: d.z[n] if n in hidden else torch.zeros_like(params[n]) for n in params}, torch.float64
        )
        _, zhz = forward_quadratic_form(loss_fn, params, target.val_batches[0], zh, dtype=torch.float64)
        assert f.held_out[d.name]["nds"] == pytest.approx(zhz / param_dicts.dot(zh, zh), rel=1e-8)
        assert r.scalars().paired[factorial_heldout_key("nds", d.name)] == f.held_out[d.name]["nds"]
    r.save(tmp_path / "report.json")
    again = CurvatureReport.from_dict(json.loads((tmp_path / "report.json").read_text()))
    assert json.dumps(again.factorial.to_dict()) == json.dumps(f.to_dict())  # (NaN where nothing is stepped)


# -- aggregation, on points with a known factor structure ------------------------------------------


FILTER = {"ema": 2.0, "nesterov": 1.0}
MAP = {"identity": 20.0, "adam": 3.0, "sign": 5.0, "msign": 1.0, "random_sv": 1.5}
INTERACTION = 1.25  # on (ema, adam) only
COS = {"ema_adam": 0.4, "nesterov_msign": 0.2}


def _point(rng, negative=False):
    base = math.exp(rng.normal(0, 0.3))  # the landscape at this point: every cell alike
    x = {}
    for f, m in CELLS:
        cell = cell_name(f, m)
        nds = base * FILTER[f] * MAP[m] * (INTERACTION if cell == "ema_adam" else 1.0) * math.exp(rng.normal(0, 0.01))
        cos = COS.get(cell, 0.3)
        for scope in ("hidden", "all"):
            x[factorial_key("nds", cell, scope)] = -nds if negative and cell == MUON else nds
            x[factorial_key("cos", cell, scope)] = cos
            x[factorial_key("q", cell, scope)] = cos**2 / x[factorial_key("nds", cell, scope)]
        x[factorial_heldout_key("nds", cell)] = nds * 1.1
        x[factorial_heldout_key("cos", cell)] = cos
    return x


def _data(seeds=5, negative_every=0):
    rng = np.random.default_rng(0)
    records = []
    for s in range(seeds):
        points = [_point(rng, negative=bool(negative_every) and k % negative_every == 0) for k in range(6)]
        records.append(record("adamw/muon", s, points[:3], points[3:]))
    return level_data(records, s_values=(0.0,))


def test_the_decomposition_recovers_a_known_filter_map_and_interaction():
    d = decomposition(_data())
    assert set(d) == set(TERMS)
    expected = {"filter": FILTER["ema"], "map": MAP["adam"], "interaction": INTERACTION}
    for term, factor in expected.items():
        assert d[term].value == pytest.approx(factor, rel=0.02) and d[term].ci95[0] < factor < d[term].ci95[1]
    total = FILTER["ema"] * MAP["adam"] * INTERACTION
    assert d["alignment"].value == pytest.approx((0.4 / 0.2) ** 2)
    assert d["alignment"].value * d["efficiency"].value == pytest.approx(total, rel=0.02)
    assert math.isclose(
        sum(d[t].log for t in ("filter", "map", "interaction")), d["alignment"].log + d["efficiency"].log
    )
    assert all(d[t].n_seeds == 5 and d[t].n_points == 30 and d[t].excluded_points == 0 for t in TERMS)


def test_cells_are_ratios_to_muons_cell_and_negative_points_are_counted_not_logged():
    grid = cells(_data())
    assert len(grid) == 2 * len(CELLS) and {c.scope for c in grid} == {"hidden", "all"}
    for c in grid:
        factor = FILTER[c.filter] * MAP[c.map] * (INTERACTION if (c.filter, c.map) == ("ema", "adam") else 1.0)
        assert c.nds_ratio == pytest.approx(factor, rel=0.02) and c.n_seeds == 5
        assert set(c.ci95) == {"nds", "cos", "q"}
        if c.scope == "hidden":
            assert c.held_out["nds_ratio"] == pytest.approx(factor, rel=0.02) and c.held_out["cos_ratio"] is not None
    muon = next(c for c in grid if (c.filter, c.map) == ("nesterov", "msign") and c.scope == "hidden")
    assert muon.nds_ratio == muon.q_ratio == muon.cos_ratio == 1.0
    negative = cells(_data(negative_every=3))
    assert all(c.n_points == 30 and c.n_excluded == 10 for c in negative)  # Muon's cell's NDS < 0 at 10 points
    assert all(
        c.nds_ratio
        == pytest.approx(
            FILTER[c.filter] * MAP[c.map] * (INTERACTION if (c.filter, c.map) == ("ema", "adam") else 1.0), rel=0.02
        )
        for c in negative
    )
    d = decomposition(_data(negative_every=3))
    assert d["filter"].excluded_points == 10 and d["filter"].n_points == 20 and "left out" in d["filter"].note


def test_the_paired_ratio_is_its_alignment_part_times_its_efficiency_part():
    """NDS = cos²/q, so log(N_A/N_M) = 2 log(cos_A/cos_M) + log(q_M/q_A) at every point, and in the seed means."""
    rng = np.random.default_rng(1)

    def point():
        cos_a, cos_m = 0.4 * math.exp(rng.normal(0, 0.05)), 0.2
        q_a, q_m = 0.01, 0.0125 * math.exp(rng.normal(0, 0.05))  # Muon's direction 1.25x as efficient
        return {
            "paired_nds_adamw_hidden": cos_a**2 / q_a,
            "paired_nds_muon_hidden": cos_m**2 / q_m,
            "paired_cos_adamw_hidden": cos_a,
            "paired_cos_muon_hidden": cos_m,
        }

    data = level_data(
        [record("adamw/muon", s, [point() for _ in range(3)], [point() for _ in range(3)]) for s in range(4)]
    )
    parts = paired_parts(data)
    assert parts["alignment"].value == pytest.approx(4.0, rel=0.05) and parts["efficiency"].value == pytest.approx(
        1.25, rel=0.05
    )
    assert parts["total"].log == pytest.approx(parts["alignment"].log + parts["efficiency"].log, abs=1e-12)
    assert parts["total"].n_points == 24 and parts["total"].n_seeds == 4


def test_the_paired_ratio_is_its_gauss_newton_part_times_the_residual_factor():
    """N = GN (1 + r): log(N_A/N_M) = log(GN_A/GN_M) + log((1 + r_A)/(1 + r_M)) at every point and in the seed
    means; a point with an NDS <= 0 is left out of the split and counted; no split where none was measured."""
    rng = np.random.default_rng(2)

    def point(k):
        gn_a, gn_m = 3.0 * math.exp(rng.normal(0, 0.05)), 1.0
        r_a, r_m = 0.5, -0.25 if k else -1.5  # (the first point of each run: Muon's NDS < 0, all in the residual)
        return {
            "paired_nds_adamw_hidden": gn_a * (1 + r_a),
            "paired_nds_muon_hidden": gn_m * (1 + r_m),
            "paired_cos_adamw_hidden": 0.4,
            "paired_cos_muon_hidden": 0.2,
            "paired_ndsgn_adamw_hidden": gn_a,
            "paired_ndsgn_muon_hidden": gn_m,
        }

    data = level_data([record("adamw/muon", s, [point(k) for k in range(3)], [point(k) for k in range(3)])
                       for s in range(4)])  # fmt: skip
    parts = paired_parts(data)
    gn, residual, total = parts["gauss_newton"], parts["gn_residual"], parts["gn_total"]
    assert gn.value == pytest.approx(3.0, rel=0.05) and residual.value == pytest.approx(1.5 / 0.75, rel=1e-12)
    assert total.log == pytest.approx(gn.log + residual.log, abs=1e-12)
    assert total.n_points == 16 and total.excluded_points == 8 and total.n_seeds == 4
    without = level_data(
        [
            record(
                "adamw/muon",
                0,
                [
                    {
                        "paired_nds_adamw_hidden": 1.0,
                        "paired_nds_muon_hidden": 0.5,
                        "paired_cos_adamw_hidden": 0.4,
                        "paired_cos_muon_hidden": 0.2,
                    }
                ],
                [],
            )
        ]
    )
    assert "gauss_newton" not in paired_parts(without)  # fmt: skip


def test_the_mechanism_section_and_figures_show_what_was_measured(tmp_path):
    from types import SimpleNamespace

    from curvlab.output.mechanism import mechanism_figures, mechanism_section

    data = _data()
    summary = SimpleNamespace(cells=cells(data), decomposition=decomposition(data), paired_parts=None)
    text = "\n".join(mechanism_section(summary))
    assert text.count("| Adam's EMA (β₁ 0.9) |") == 5 and text.count("| Muon's Nesterov (0.95) |") == 5
    assert "| filter: EMA over Nesterov, under msign | ×2" in text  # the known filter effect
    written = mechanism_figures(summary, tmp_path)
    assert {p.suffix for paths in written.values() for p in paths} == {".png", ".pdf"} and len(written) == 2
    assert mechanism_section(SimpleNamespace(cells=[], decomposition=None, paired_parts=None)) == []


def test_the_mechanism_design_splits_the_arms_nds_where_the_paired_directions_are_measured():
    mechanism, quick = PRESETS["mechanism"], PRESETS["quick"]
    assert analysis_settings(mechanism, 1).gauss_newton and not analysis_settings(quick, 1).gauss_newton
    assert not analysis_settings(mechanism, 1, paired=False).gauss_newton  # (the A/A: no paired directions)
