import dataclasses
import itertools
import json
import math

import numpy as np
import pytest
import torch

from curvlab import hvp, taylor_split
from curvlab.errors import CurvlabError
from curvlab.output.files import read_quadratic, write_quadratic
from curvlab.studies.summary import QuadraticRecord
from curvlab.theory.quadratic import QUADRATIC_SCHEMA_VERSION, QuadraticStudy, phase_sweep, quadratic_study
from curvlab.theory.quadratic_model import (
    KroneckerQuadratic,
    Trajectory,
    TwoLevelSpec,
    best_fixed_lr,
    gd_contraction,
    gd_initial_share,
    muon_contraction,
    muon_nds,
    optimal_loss,
    power_law,
    run_fixed_lr,
    run_line_search,
    scalar_two_level,
    theorem_condition,
    two_level,
)
from curvlab.util import schema

EXAMPLE = TwoLevelSpec(d1=96, d2=96, q=88, m=8, w_H=100.0, w_L=1.0, sigma_H=3.0, sigma_L=1.0)


def test_factored_hvp_equals_dense_kronecker_hessian_and_curvlab_hvp():
    p = two_level(TwoLevelSpec(d1=7, d2=5, q=5, m=2, w_H=9.0, w_L=1.0))
    Y = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    dense = p.dense_hessian()
    assert torch.allclose(p.hvp(Y).reshape(-1), dense @ Y.reshape(-1), atol=1e-12)
    assert torch.allclose(hvp(p.loss_fn, {"Y": Y}, None, {"Y": Y})["Y"], p.hvp(Y), atol=1e-12)
    split = taylor_split(p.loss_fn, {"Y": torch.zeros(7, 5, dtype=torch.float64)}, None, {"Y": Y})
    assert split.nds == pytest.approx(float((Y * p.hvp(Y)).sum() / (Y * Y).sum()), rel=1e-12)
    assert split.realized == pytest.approx(split.predicted, rel=1e-12)  # exact for a quadratic
    eig = torch.linalg.eigvalsh(dense)
    assert eig.min() > 0  # positive definite: every mode has positive curvature


def test_muon_closed_forms_on_the_worked_example():
    p = two_level(EXAMPLE)
    traj = run_line_search(p, "muon", 8)
    assert muon_nds(EXAMPLE) == pytest.approx(10.0)
    assert traj.nds == pytest.approx([10.0] * 8, rel=1e-10)
    gap = np.array(traj.loss) - optimal_loss(EXAMPLE)
    assert muon_contraction(EXAMPLE) == pytest.approx(0.669421, abs=5e-7)
    assert gap[2:] / gap[1:-1] == pytest.approx([muon_contraction(EXAMPLE)] * 7, rel=1e-8)


def test_gd_closed_forms_on_the_worked_example():
    p = two_level(EXAMPLE)
    traj = run_line_search(p, "gd", 8)
    assert traj.nds[0] == pytest.approx(47.895, abs=5e-4) and traj.nds[1] == pytest.approx(53.105, abs=5e-4)
    assert traj.nds[::2] == pytest.approx([traj.nds[0]] * 4) and traj.nds[1::2] == pytest.approx([traj.nds[1]] * 4)
    P0 = gd_initial_share(EXAMPLE)
    two_step = gd_contraction(EXAMPLE, P0) * gd_contraction(EXAMPLE, 1 - P0)
    assert two_step == pytest.approx(0.922913, abs=5e-7)
    gap = np.array(traj.loss) - optimal_loss(EXAMPLE)
    assert gap[2::2] / gap[:-2:2] == pytest.approx([two_step] * 4, rel=1e-8)
    d = EXAMPLE.w_H - EXAMPLE.w_L  # every single step: Kantorovich's ratio, symmetric in P <-> 1 - P
    one_step = d * d * P0 * (1 - P0) / ((EXAMPLE.w_L + d * P0) * (EXAMPLE.w_H - d * P0))
    assert gap[1:] / gap[:-1] == pytest.approx([one_step] * 8, rel=1e-8)
    assert one_step**2 == pytest.approx(two_step, rel=1e-12)
    # GD's direction is R, so its NDS is P w_H + (1 - P) w_L with P the residual's high-curvature
    # energy share: P alternates P -> 1 - P
    shares = [(x - EXAMPLE.w_L) / (EXAMPLE.w_H - EXAMPLE.w_L) for x in traj.nds]
    assert shares[0] == pytest.approx(P0, rel=1e-10)
    assert all(b == pytest.approx(1 - a, rel=1e-9) for a, b in itertools.pairwise(shares))
    assert scalar_shares(EXAMPLE, 6) == pytest.approx(shares[:6], rel=1e-9)


def scalar_shares(spec, steps):
    """The high-curvature energy share of GD's residual, from the scalar model's coefficients."""
    n = np.array([spec.m, spec.q - spec.m])
    w = np.array([spec.w_H, spec.w_L])
    s = np.array([spec.sigma_H, spec.sigma_L])
    y, shares = np.zeros(2), []
    for _ in range(steps):
        r = s - w * y
        shares.append(n[0] * r[0] ** 2 / (n * r * r).sum())
        y = y + (n * r * r).sum() / (n * w * r * r).sum() * r
    return shares


@pytest.mark.parametrize("method", ["gd", "muon"])
def test_matrix_realization_equals_the_scalar_model(method):
    spec = TwoLevelSpec(d1=40, d2=48, q=30, m=6, w_H=20.0, w_L=0.5, sigma_H=2.0, sigma_L=1.0, seed=3)
    matrix = run_line_search(two_level(spec), method, 10)
    scalar = scalar_two_level(spec, method, 10)
    assert matrix.loss == pytest.approx(scalar.loss, rel=1e-10, abs=1e-12)
    assert matrix.nds == pytest.approx(scalar.nds, rel=1e-10)


def test_theorem_part_one_time_averaged_nds():
    rng = np.random.default_rng(2)
    specs = [EXAMPLE]
    while len(specs) < 40:  # random aligned settings (σ_H >= σ_L), the theorem's assumption
        q = int(rng.integers(10, 200))
        m = int(rng.integers(1, (q - 1) // 2 + 1))
        specs.append(TwoLevelSpec(d1=q, d2=q, q=q, m=m, w_H=float(10 ** rng.uniform(0.1, 3)), w_L=1.0,
                                  sigma_H=float(rng.uniform(1, 5)), sigma_L=1.0))  # fmt: skip
    for spec in specs:
        muon = scalar_two_level(spec, "muon", 40).nds
        gd = scalar_two_level(spec, "gd", 40).nds
        k = min(len(muon), len(gd))  # a run may end early at the exact optimum
        assert np.all(np.cumsum(muon[:k]) < np.cumsum(gd[:k])), spec  # every T: Muon's mean NDS is lower


def test_gd_nds_averages_to_the_midpoint_over_even_T():
    gd_nds = scalar_two_level(EXAMPLE, "gd", 40).nds
    # the two alternating NDS values average to (w_H + w_L) / 2 over any even number of steps
    assert np.mean(gd_nds[:2]) == pytest.approx((EXAMPLE.w_H + EXAMPLE.w_L) / 2, rel=1e-10)
    assert np.mean(gd_nds) == pytest.approx((EXAMPLE.w_H + EXAMPLE.w_L) / 2, rel=1e-10)


def test_theorem_part_two_on_a_random_sweep():
    rng = np.random.default_rng(0)
    checked = 0
    while checked < 60:
        q = int(rng.integers(20, 200))
        m = int(rng.integers(1, q // 2))
        ratio = float(rng.uniform(0.1, 5.0))  # ratios < 1 are drawn too: the condition must exclude them
        rho = float(10 ** rng.uniform(0, 3))
        spec = TwoLevelSpec(d1=q, d2=q, q=q, m=m, w_H=rho, w_L=1.0, sigma_H=ratio, sigma_L=1.0)
        if not theorem_condition(spec) or spec.rho <= 1:
            continue
        checked += 1
        best = optimal_loss(spec)
        muon = np.array(scalar_two_level(spec, "muon", 30).loss) - best
        gd = np.array(scalar_two_level(spec, "gd", 30).loss) - best
        k = min(len(muon), len(gd))
        assert np.all(muon[1:k] <= gd[1:k] * (1 + 1e-9) + 1e-12), spec


def test_the_condition_needs_the_alignment_assumption():
    unaligned = TwoLevelSpec(d1=90, d2=90, q=90, m=38, w_H=154.5, w_L=1.0, sigma_H=0.26, sigma_L=1.0)
    inv = 1 / unaligned.alpha
    assert unaligned.rho + 1 > inv > 1 + unaligned.sigma_H / unaligned.sigma_L  # the bare inequalities hold
    assert not theorem_condition(unaligned)
    best = optimal_loss(unaligned)
    assert scalar_two_level(unaligned, "muon", 1).loss[1] - best > scalar_two_level(unaligned, "gd", 1).loss[1] - best


def test_theorem_part_two_on_the_matrix_model():
    spec = TwoLevelSpec(d1=64, d2=64, q=50, m=5, w_H=30.0, w_L=1.0, sigma_H=2.0, sigma_L=1.0, seed=1)
    assert theorem_condition(spec)
    p = two_level(spec)
    muon, gd = run_line_search(p, "muon", 15), run_line_search(p, "gd", 15)
    assert all(a < b for a, b in zip(muon.loss[1:], gd.loss[1:]))


def test_phase_sweep_agrees_with_the_condition_where_it_holds():
    sweep = phase_sweep(rhos=[2, 10, 100, 1000], alphas=[0.05, 0.1, 0.3, 0.45], ratios=[0.5, 1.0, 3.0], steps=20)
    cond = np.array(sweep.condition)
    always = np.array(sweep.muon_below_every_step)
    assert cond.any() and not cond.all()
    assert np.all(always[cond])  # sufficient: wherever it holds, Muon is below GD at every step
    assert np.array(sweep.muon_wins).shape == (3, 4, 4)


def test_newton_schulz_polar_express_adam_and_sign_run():
    spec = TwoLevelSpec(d1=32, d2=32, q=20, m=4, w_H=20.0, w_L=1.0, sigma_H=2.0, sigma_L=1.0)
    p = two_level(spec)
    for polar in ("newton_schulz", "polar_express"):
        traj = run_line_search(p, "muon", 6, polar=polar)
        assert traj.loss[-1] < traj.loss[0] and traj.method == f"muon-{polar}"
    grid = [1e-3, 3e-3, 1e-2, 3e-2, 1e-1]
    for method in ("gd", "muon", "adam", "sign"):
        traj = best_fixed_lr(p, method, grid, 30)
        assert traj.loss[-1] < traj.loss[0] and traj.lr in grid and len(traj.nds) == 30
    diverged = run_fixed_lr(p, "gd", 10.0, 30, momentum=0.0)
    assert diverged.loss[-1] == math.inf or diverged.loss[-1] > diverged.loss[0]


def test_power_law_alignment_knob():
    flat = power_law(d1=40, d2=40, q=30, alignment=0.0, seed=0)
    aligned = power_law(d1=40, d2=40, q=30, alignment=1.0, seed=0)

    def gradient_nds(p):
        return float((p.G * p.hvp(p.G)).sum() / (p.G * p.G).sum())

    assert gradient_nds(aligned) > 2 * gradient_nds(flat)


def test_bad_specs_name_the_failing_assumption():
    with pytest.raises(ValueError, match="α = m/q < 1/2"):
        two_level(TwoLevelSpec(q=10, m=6))
    with pytest.raises(ValueError, match="w_H > w_L"):
        two_level(TwoLevelSpec(w_H=1.0, w_L=2.0))
    with pytest.raises(ValueError, match="q=200 > min"):
        two_level(TwoLevelSpec(q=200, m=8))
    with pytest.raises(ValueError, match="positive"):
        two_level(TwoLevelSpec(w_L=-1.0))
    two_level(TwoLevelSpec(q=10, m=6, d1=16, d2=16), outside_theorem=True)  # allowed on purpose
    with pytest.raises(ValueError, match="unknown method"):
        run_line_search(two_level(TwoLevelSpec()), "adam", 3)
    assert isinstance(two_level(TwoLevelSpec(d1=12, d2=12, q=10, m=2)), KroneckerQuadratic)


# -- the study's record (quadratic.json) ---------------------------------------------------------

SMALL = TwoLevelSpec(d1=16, d2=16, q=10, m=2, w_H=20.0, w_L=1.0, sigma_H=2.0, sigma_L=1.0, seed=1)
SMALL_RUN = dict(steps=4, fixed_lr_steps=5, lr_grid=(1e-2, 1e-1), rhos=(2.0, 50.0, 300.0), alphas=(0.1, 0.3),
                 ratios=(1.0, 3.0), sweep_steps=4)  # fmt: skip


@pytest.fixture(scope="module")
def small_study():
    return quadratic_study(SMALL, **SMALL_RUN)


def old_example_dict(spec, steps, fixed_lr_steps, lr_grid):
    """The example part of quadratic.json as the dict-returning quadratic_study assembled it, from the
    building blocks (what files written before the typed record hold)."""
    p = two_level(spec)
    line = {"gd": run_line_search(p, "gd", steps).to_dict()}
    for polar in ("svd", "newton_schulz", "polar_express"):
        t = run_line_search(p, "muon", steps, polar=polar)
        line[t.method] = t.to_dict()
    fixed = {
        f"{m}-fixed-lr": best_fixed_lr(p, m, lr_grid, fixed_lr_steps).to_dict() for m in ("gd", "muon", "adam", "sign")
    }
    P0 = gd_initial_share(spec)
    closed = {
        "optimal_loss": optimal_loss(spec),
        "muon_nds": muon_nds(spec),
        "muon_contraction": muon_contraction(spec),
        "gd_two_step_contraction": gd_contraction(spec, P0) * gd_contraction(spec, 1 - P0),
        "gd_initial_share": P0,
        "theorem_condition": theorem_condition(spec),
    }
    title = "q=10, m=2, w_H=20, w_L=1, σ_H=2, σ_L=1 (d=16x16)"
    return {"spec": dataclasses.asdict(spec), "title": title, "closed_forms": closed, "line_search": line,
            "fixed_lr": fixed}  # fmt: skip


def test_the_study_record_round_trips_and_its_json_is_the_old_dict(small_study, tmp_path):
    study = small_study
    assert QuadraticStudy.from_dict(study.to_dict()) == study
    paths = write_quadratic(study, tmp_path, figures=False)
    assert paths == [tmp_path / "quadratic.json"]
    d = json.loads((tmp_path / "quadratic.json").read_text())
    assert read_quadratic(tmp_path / "quadratic.json") == study
    # the file holds what the dict form held: same keys, same values, and its seal (curvlab.util.schema)
    assert list(d) == ["schema_version", "example", "sweep", "content_digest"]
    assert d["schema_version"] == QUADRATIC_SCHEMA_VERSION == 1
    run = {k: SMALL_RUN[k] for k in ("steps", "fixed_lr_steps", "lr_grid")}
    assert d["example"] == old_example_dict(SMALL, **run)
    assert list(d["example"]["closed_forms"]) == ["optimal_loss", "muon_nds", "muon_contraction",
                                                  "gd_two_step_contraction", "gd_initial_share", "theorem_condition"]  # fmt: skip
    assert list(d["example"]["line_search"]) == ["gd", "muon", "muon-newton_schulz", "muon-polar_express"]
    alpha = SMALL.m / SMALL.q
    assert d["example"]["closed_forms"]["muon_nds"] == pytest.approx(alpha * 20.0 + (1 - alpha) * 1.0, rel=1e-15)
    assert d["example"]["closed_forms"]["optimal_loss"] == pytest.approx(-0.5 * (2 * 4 / 20 + 8 * 1 / 1), rel=1e-15)
    assert d["example"]["closed_forms"]["theorem_condition"] is True  # ρ + 1 = 21 > 1/α = 5 > 1 + σ_H/σ_L = 3
    sweep = d["sweep"]
    assert list(sweep) == ["rhos", "alphas", "ratios", "steps", "q", "muon_wins", "muon_below_every_step",
                           "condition", "log10_suboptimality_ratio"]  # fmt: skip
    assert (sweep["rhos"], sweep["alphas"], sweep["ratios"]) == ([2.0, 50.0, 300.0], [0.1, 0.3], [1.0, 3.0])
    assert (sweep["steps"], sweep["q"]) == (4, 100)
    assert np.array(sweep["muon_wins"]).shape == (2, 2, 3) and isinstance(sweep["condition"][0][0][0], bool)
    # one point by hand: σ_H/σ_L = 3, α = 0.1, ρ = 50 on the scalar model, T = 4
    point = TwoLevelSpec(d1=100, d2=100, q=100, m=10, w_H=50.0, w_L=1.0, sigma_H=3.0, sigma_L=1.0)
    best = optimal_loss(point)
    muon = scalar_two_level(point, "muon", 4).loss[-1] - best
    gd = scalar_two_level(point, "gd", 4).loss[-1] - best
    assert sweep["muon_wins"][1][0][1] == (muon < gd) and sweep["condition"][1][0][1] == theorem_condition(point)
    assert sweep["log10_suboptimality_ratio"][1][0][1] == pytest.approx(math.log10(muon / gd), rel=1e-12)
    assert study.title == d["example"]["title"]
    assert QuadraticRecord.from_study(study) == QuadraticRecord(muon_nds(SMALL), muon_contraction(SMALL),
                                                                d["example"]["closed_forms"]["gd_two_step_contraction"])  # fmt: skip


def test_a_file_of_the_dict_era_reads_as_the_record(small_study, tmp_path):
    """A quadratic.json written by ``json.dumps`` of the dict (``Infinity``/``NaN`` allowed) reads back, sealed
    (unsealed, it is refused: nothing unsealed is trusted, and a reproduction recomputes it)."""
    old = json.loads(json.dumps(small_study.to_dict()))
    diverged = {"method": "gd", "loss": [0.0, math.inf], "nds": [math.nan], "step_norm": [1.0], "first_order": [-1.0],
                "lr": 10.0}  # fmt: skip
    old["example"]["fixed_lr"]["gd-diverged"] = diverged
    (tmp_path / "quadratic.json").write_text(json.dumps(old))  # the old writer
    with pytest.raises(CurvlabError, match="unsealed quadratic"):
        read_quadratic(tmp_path / "quadratic.json")
    (tmp_path / "quadratic.json").write_text(json.dumps(schema.sealed(old, strict=False)))
    study = read_quadratic(tmp_path / "quadratic.json")
    assert study.line_search == small_study.line_search and study.sweep == small_study.sweep
    t = study.fixed_lr["gd-diverged"]
    assert t.loss == [0.0, math.inf] and math.isnan(t.nds[0]) and t.lr == 10.0
    # written again, strictly (non-finite as null), it reads back the same: null loss is inf, null NDS nan
    write_quadratic(study, tmp_path / "again", figures=False)
    text = (tmp_path / "again" / "quadratic.json").read_text()
    assert "Infinity" not in text and "NaN" not in text
    assert json.loads(text)["example"]["fixed_lr"]["gd-diverged"]["loss"] == [0.0, None]
    t = read_quadratic(tmp_path / "again" / "quadratic.json").fixed_lr["gd-diverged"]
    assert (
        t.loss == [0.0, math.inf] and math.isnan(t.nds[0]) and t == Trajectory("gd", t.loss, t.nds, [1.0], [-1.0], 10.0)
    )


def test_read_quadratic_of_another_version_or_none_is_none_and_a_corrupt_file_an_error(small_study, tmp_path):
    path = tmp_path / "quadratic.json"
    assert read_quadratic(path) is None  # absent: a study to compute
    d = small_study.to_dict()
    path.write_text(json.dumps({**d, "schema_version": QUADRATIC_SCHEMA_VERSION + 1}))
    assert read_quadratic(path) is None  # another version: a study to recompute
    path.write_text(json.dumps({k: v for k, v in d.items() if k != "schema_version"}))
    assert read_quadratic(path) is None  # written before schema_version existed
    path.write_text('{"schema_version": 1, "exam')
    with pytest.raises(CurvlabError, match="corrupt JSON") as e:
        read_quadratic(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    malformed = {**d, "example": {k: v for k, v in d["example"].items() if k != "closed_forms"}}
    path.write_text(json.dumps(schema.sealed(malformed, strict=False)))  # (sealed: its content is what is wrong)
    with pytest.raises(CurvlabError, match="not a quadratic study record .KeyError") as e:
        read_quadratic(path)
    assert "\n" not in str(e.value)
    with pytest.raises(CurvlabError, match="quadratic study schema 2 is not 1"):
        QuadraticStudy.from_dict({**d, "schema_version": 2})
