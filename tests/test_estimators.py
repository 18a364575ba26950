"""The directional-curvature estimators (curvlab.curvature.estimators) against closed forms and exact NDS."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn.functional as F

from curvlab.analysis.estimate import EstimateReport
from curvlab.analysis.report import analyze_checkpoint
from curvlab.analysis.targets import AnalysisSettings
from curvlab.cli import app
from curvlab.curvature import estimators as E
from curvlab.engine.loss import make_loss_fn
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, MICRO_OVERRIDES, get_config
from tests.builders import assert_refused, batch_for, runner, small_run
from tests.reference import MLP, dense_hessian

SHAPES = {"u": (3,), "v": (2, 2)}


def quadratic(seed=0, definite=False):
    """L(w) = ½ wᵀAw + bᵀw on a dict of two tensors, its A, b, parameters and a direction with <G, z> > 0."""
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(7, 7, generator=g, dtype=torch.float64)
    A = m @ m.T + 0.5 * torch.eye(7, dtype=torch.float64) if definite else (m + m.T) / 2
    b = torch.randn(7, generator=g, dtype=torch.float64)

    def loss_fn(params, batch):
        w = torch.cat([params["u"].reshape(-1), params["v"].reshape(-1)])
        return 0.5 * w @ A @ w + b @ w

    params = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in SHAPES.items()}
    z = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in SHAPES.items()}
    w = torch.cat([params["u"].reshape(-1), params["v"].reshape(-1)])
    zf = torch.cat([z["u"].reshape(-1), z["v"].reshape(-1)])
    if float((A @ w + b) @ zf) < 0:
        z, zf = {n: -t for n, t in z.items()}, -zf
    return loss_fn, params, z, float(zf @ A @ zf / (zf @ zf))


@pytest.mark.parametrize("name", ["exact", "finite_difference", "quadratic_fit", "forward"])
def test_quadratic_indefinite_closed_form(name):
    loss_fn, params, z, want = quadratic(seed=1)
    before = {n: t.clone() for n, t in params.items()}
    # a quadratic has no higher terms, so the fit may take long steps (rounding ~ ε|L|/α²‖Z‖² stays small)
    options = {"steps": [0.25, 0.5, 1.0, 2.0]} if name == "quadratic_fit" else {}
    r = E.directional_curvature(loss_fn, params, None, z, estimator=name, **options)
    assert r.estimator == name and r.nds == pytest.approx(want, rel=1e-10)
    assert all(torch.equal(params[n], before[n]) for n in params)
    if name == "quadratic_fit":
        assert abs(r.detail["cubic"]) * 2.0 < 1e-10 * abs(r.zhz)
    if name in ("exact", "forward"):
        assert r.error is None


def test_quadratic_default_fit():
    loss_fn, params, z, want = quadratic(seed=2, definite=True)
    fit = E.quadratic_fit(loss_fn, params, None, z)
    assert abs(fit.nds - want) <= fit.error and fit.forwards == 5 and fit.backwards == 1


@pytest.fixture(scope="module")
def mlp():
    torch.manual_seed(0)
    model = MLP().double()
    loss_fn = make_loss_fn(model, criterion=F.cross_entropy)
    params = {n: t.detach().clone() for n, t in model.named_parameters()}
    g = torch.Generator().manual_seed(1)
    batch = (torch.randn(9, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (9,), generator=g))
    z = {n: torch.randn(t.shape, generator=g, dtype=torch.float64) for n, t in params.items()}
    return loss_fn, params, batch, z


def _flat(z):
    return torch.cat([t.reshape(-1) for t in z.values()])


def test_mlp_exact_matches_dense_hessian(mlp):
    loss_fn, params, batch, z = mlp
    zf = _flat(z)
    want = float(zf @ dense_hessian(loss_fn, params, batch) @ zf / (zf @ zf))
    assert E.exact(loss_fn, params, batch, z).nds == pytest.approx(want, rel=1e-12)
    assert E.forward(loss_fn, params, batch, z).nds == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("name", ["finite_difference", "quadratic_fit"])
def test_mlp_within_stated_error(mlp, name):
    loss_fn, params, batch, z = mlp
    exact = E.exact(loss_fn, params, batch, z).nds
    r = E.directional_curvature(loss_fn, params, batch, z, estimator=name)
    assert 0 < r.error < 1e-5 * abs(exact) and abs(r.nds - exact) <= r.error
    assert E.DirectionalCurvatureEstimate.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_mlp_finite_difference_truncation_is_h_squared(mlp):
    loss_fn, params, batch, z = mlp
    exact = E.exact(loss_fn, params, batch, z).nds
    errors = [E.finite_difference(loss_fn, params, batch, z, step=h).nds - exact for h in (1e-2, 5e-3, 2.5e-3)]
    for big, small in itertools.pairwise(errors):
        assert 3.8 < big / small < 4.2
    # truncation-dominated: Richardson's estimate is the error itself to O(h²) (not a bound: the h⁴ term)
    r = E.finite_difference(loss_fn, params, batch, z, step=5e-3)
    assert r.error == pytest.approx(abs(r.nds - exact), rel=1e-3)


def test_tiny_gpt_float32_within_stated_error():
    torch.manual_seed(0)
    model = GPT(get_config("tiny", **MICRO_OVERRIDES))
    loss_fn, batch = make_loss_fn(model), batch_for(model, seed=0, batch=2)
    params = {n: t.detach() for n, t in model.named_parameters()}
    g = torch.Generator().manual_seed(3)
    z = {n: torch.randn(t.shape, generator=g) for n, t in params.items()}
    exact = E.exact(loss_fn, params, batch, z)
    assert exact.zhz == pytest.approx(E.forward(loss_fn, params, batch, z).zhz, rel=1e-3)
    for name in ("finite_difference", "quadratic_fit"):
        r = E.directional_curvature(loss_fn, params, batch, z, estimator=name)
        assert abs(r.nds - exact.nds) <= r.error, name


def test_bad_input():
    loss_fn, params, z, _ = quadratic(seed=3, definite=True)
    zero = {n: torch.zeros_like(t) for n, t in z.items()}
    for name in E.ESTIMATORS:
        with pytest.raises(CurvlabError):
            E.directional_curvature(loss_fn, params, None, zero, estimator=name)
        with pytest.raises(CurvlabError):
            E.directional_curvature(loss_fn, params, None, {"u": z["u"]}, estimator=name)
    with pytest.raises(CurvlabError, match="unknown estimator"):
        E.directional_curvature(loss_fn, params, None, z, estimator="nope")


# -- on a checkpoint: curvlab nds --estimator ------------------------------------------------------------------


@pytest.fixture(scope="module")
def muon_run(pcfg_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("estimate_runs")
    small_run(pcfg_data, root / "muon", "muon", steps=8)
    return root / "muon"


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["finite_difference", "quadratic_fit", "forward"])
def test_cli_estimate_of_the_next_step_against_the_exact_report(muon_run, tmp_path, name):
    """``curvlab nds CKPT --estimator NAME`` in float64: the NDS within its stated error of the exact report's
    (the same W, Z and batch), the first-order term and realized decrease equal to the report's, and the JSON
    read back."""
    ckpt, out = muon_run / "ckpt_000004.pt", tmp_path / "estimate.json"
    result = runner.invoke(app, ["nds", str(ckpt), "--estimator", name, "--dtype", "float64", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"estimator {name}: NDS" in result.output
    report = EstimateReport.from_dict(json.loads(out.read_text()))
    exact = analyze_checkpoint(ckpt, AnalysisSettings(dtype="float64"))
    assert report.estimate.estimator == name and report.step == 4
    error = report.estimate.error or 1e-9 * abs(exact.split.nds)
    assert abs(report.estimate.nds - exact.split.nds) <= error
    assert report.first_order == pytest.approx(exact.split.first_order, rel=1e-9)
    assert report.realized == pytest.approx(exact.split.realized, rel=1e-9)
    assert report.predicted == pytest.approx(report.first_order - report.estimate.zhz / 2, rel=1e-12)


def test_cli_estimator_refusals(muon_run):
    ckpt = str(muon_run / "ckpt_000004.pt")
    assert_refused(["nds", ckpt, "--estimator", "critical_sharpness"], "unknown estimator 'critical_sharpness'")
    assert_refused(["nds", ckpt, "--estimator", "forward", "--gauss-newton"], "not with --directions")


def test_the_unit_roundoff_is_autocasts_where_it_is_on():
    """Under bfloat16 autocast a float32 point's products round at bfloat16's ε (2^-7), which the finite
    difference's step and every stated rounding take; outside it, the working dtype's."""
    cpu = torch.device("cpu")
    assert E.unit_roundoff(torch.float32, cpu) == torch.finfo(torch.float32).eps
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert E.unit_roundoff(torch.float32, cpu) == 2.0**-7
        assert E.unit_roundoff(torch.float64, cpu) == 2.0**-7
