import hashlib
import json
import math
from dataclasses import asdict

import numpy as np
import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from curvlab.analysis.direction_report import DirectionReport
from curvlab.analysis.directions import (
    Direction,
    DirectionLandscape,
    counterfactual_directions,
    measure_directions,
    parse_directions,
)
from curvlab.analysis.report import CurvatureReport, analyze_checkpoint
from curvlab.analysis.targets import AnalysisSettings, open_checkpoint
from curvlab.cli import app
from curvlab.curvature.gauss_newton import gauss_newton_form
from curvlab.curvature.taylor import nds
from curvlab.engine import params as param_dicts
from curvlab.engine.hvp import CurvaturePoint
from curvlab.engine.loss import make_loss_fn
from curvlab.errors import CurvlabError
from curvlab.optim.build import build_optimizer
from curvlab.runs.checkpoint import load_checkpoint, save_checkpoint
from curvlab.runs.match import MatchCriteria
from curvlab.steps.shadow import ShadowSettings, ShadowState
from curvlab.steps.update import next_update
from curvlab.studies.compare import compare_runs
from tests.builders import assert_made_with_these_packages, random_direction, small_run
from tests.reference import dense_hessian

runner = CliRunner()


# -- a Kronecker quadratic with closed forms ----------------------------------------------------


class KroneckerQuadratic(nn.Module):
    r"""L = ½<W, A W B> + ½ h w² on a hidden n x n matrix W and a 1 x 1 head w, with A = U diag(a) Uᵀ and
    B = V diag(b) Vᵀ. At W = U diag(x) Vᵀ the gradient is G = U diag(s) Vᵀ, s = a x b, so msign(G) = U Vᵀ
    and every direction's NDS has a closed form."""

    def __init__(self, n=5, seed=0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.U = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0]
        self.V = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))[0]
        self.a = torch.tensor([9.0, 4.0, 2.0, 1.0, 0.5], dtype=torch.float64)
        self.b = torch.tensor([3.0, 1.0, 1.0, 0.5, 0.25], dtype=torch.float64)
        self.x = torch.tensor([1.0, -0.5, 2.0, 1.5, -3.0], dtype=torch.float64)
        self.h = 7.0
        self.body = nn.Linear(n, n, bias=False, dtype=torch.float64)  # the hidden matrix
        self.head = nn.Linear(1, 1, bias=False, dtype=torch.float64)  # the last weight matrix: the head
        with torch.no_grad():
            self.body.weight.copy_(self.U @ torch.diag(self.x) @ self.V.T)
            self.head.weight.fill_(0.3)

    def A(self):
        return self.U @ torch.diag(self.a) @ self.U.T

    def B(self):
        return self.V @ torch.diag(self.b) @ self.V.T

    def forward(self, _batch=None):
        W, w = self.body.weight, self.head.weight
        return 0.5 * (W * (self.A() @ W @ self.B())).sum() + 0.5 * self.h * (w**2).sum()


class _QuadLoss:
    """``loss_fn(params, batch)`` of the quadratic, carrying its model (for the parameter roles)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, params, batch):
        return torch.func.functional_call(self.model, dict(params), (batch,))


def closed_nds(model, Z):
    """<Z, A Z B> / ||Z||² on the hidden matrix, densely."""
    return float((Z * (model.A() @ Z @ model.B())).sum() / (Z * Z).sum())


def test_paired_ratio_on_a_kronecker_quadratic_from_a_muon_state():
    model = KroneckerQuadratic()
    opt = build_optimizer("muon", model, polar="svd", polar_dtype="float64")
    loss_fn = _QuadLoss(model)
    G, Z = next_update(model, opt, loss_fn, None, dtype=torch.float64)
    base, mult, dirs = counterfactual_directions(model, opt, G, Z, ["muon", "sgd", "sign"])
    assert base == "muon" and mult == 1.0
    params = {n: p.detach() for n, p in model.named_parameters()}
    with CurvaturePoint(loss_fn, params, None, dtype=torch.float64) as point:
        muon, sgd, sign = measure_directions(point, dirs, ["body.weight"])
    a, b, s = model.a, model.b, model.a * model.x * model.b
    n = len(a)
    muon_nds = float((a * b).sum() / n)  # U Vᵀ: every paired mode once
    sgd_nds = float((a * b * s**2).sum() / (s**2).sum())  # G itself
    assert muon.hidden.nds == pytest.approx(muon_nds, rel=1e-10)
    assert sgd.hidden.nds == pytest.approx(sgd_nds, rel=1e-10)
    assert sgd.hidden.nds / muon.hidden.nds == pytest.approx(sgd_nds / muon_nds, rel=1e-10)  # the paired ratio
    signs = torch.sign(G["body.weight"])
    assert sign.hidden.nds == pytest.approx(closed_nds(model, signs), rel=1e-10)
    # cosines and q = cos²/NDS
    # msign(U diag(s) Vᵀ) = U diag(sign s) Vᵀ
    assert muon.hidden.cosine == pytest.approx(float(s.abs().sum() / (s.norm() * math.sqrt(n))), rel=1e-10)
    assert sgd.hidden.cosine == pytest.approx(1.0, rel=1e-12)
    assert muon.hidden.q == pytest.approx(muon.hidden.cosine**2 / muon_nds, rel=1e-10)
    # scope "all": the real step on the head joins each direction; lr 0.02 and scale 1 on the square matrix
    z_head = float(Z["head.weight"])
    c = 0.02
    all_nds = (c**2 * float((a * b).sum()) + model.h * z_head**2) / (c**2 * n + z_head**2)
    assert muon.all.nds == pytest.approx(all_nds, rel=1e-9)
    assert sgd.scaling == "matched" and sgd.hidden.update_norm == pytest.approx(muon.hidden.update_norm, rel=1e-12)
    g_all = math.sqrt(float(s.square().sum()) + (model.h * 0.3) ** 2)
    assert muon.all.grad_norm == pytest.approx(g_all, rel=1e-12)


def test_paired_ratio_on_a_kronecker_quadratic_from_an_adam_state_and_a_shadow_muon():
    model = KroneckerQuadratic(seed=1)
    opt = build_optimizer("adamw", model)
    loss_fn = _QuadLoss(model)
    G, Z = next_update(model, opt, loss_fn, None, dtype=torch.float64)
    shadow = ShadowState(ShadowSettings.for_kind("muon", polar="svd"), {"body.weight": (5, 5)})
    base, _, dirs = counterfactual_directions(model, opt, G, Z, ["adamw", "muon"], shadow=shadow)
    assert base == "adam" and [d.source for d in dirs] == ["real step", "shadow muon state"]
    params = {n: p.detach() for n, p in model.named_parameters()}
    with CurvaturePoint(loss_fn, params, None, dtype=torch.float64) as point:
        adam, muon = measure_directions(point, dirs, ["body.weight"])
    g = G["body.weight"]
    first_adam = 0.0018 * g / (g.abs() + 1e-8)  # Adam's first step: m̂ = G, √v̂ = |G|
    assert adam.hidden.nds == pytest.approx(closed_nds(model, first_adam), rel=1e-9)
    assert muon.hidden.nds == pytest.approx(float((model.a * model.b).mean()), rel=1e-10)
    ratio = closed_nds(model, first_adam) / float((model.a * model.b).mean())
    assert adam.hidden.nds / muon.hidden.nds == pytest.approx(ratio, rel=1e-9)
    assert muon.hidden.update_norm == pytest.approx(0.02 * math.sqrt(5), rel=1e-10)  # lr · ||U Vᵀ||


def test_direction_names_and_a_muon_state_without_shadow_adam():
    assert parse_directions("muon, adamw,muon") == ("muon", "adamw")
    with pytest.raises(CurvlabError, match="unknown direction 'adam'"):
        parse_directions("adam")
    model = KroneckerQuadratic()
    opt = build_optimizer("muon", model)
    G, Z = next_update(model, opt, _QuadLoss(model), None, dtype=torch.float64)
    with pytest.raises(CurvlabError, match="no shadow Adam"):
        counterfactual_directions(model, opt, G, Z, ["adamw"])
    lion = build_optimizer("lion", model)
    with pytest.raises(CurvlabError, match="neither an Adam nor a Muon state"):
        counterfactual_directions(model, lion, G, Z, ["sgd"])


def test_direction_times_landscape_is_the_between_run_ratio_on_synthetic_values():
    rng = np.random.default_rng(0)
    for values in rng.normal(size=(20, 4)):
        t = DirectionLandscape.of(*values)
        assert t.between == pytest.approx(t.direction_at_adamw * t.landscape_along_muon, rel=1e-12)
        assert t.between == pytest.approx(t.direction_at_muon * t.landscape_along_adamw, rel=1e-12)
        assert t.sign_agreement == (bool(np.all(values > 0)) or bool(np.all(values < 0)))


# -- real tiny runs -------------------------------------------------------------------------------


def without_shadow(src, dst):
    """A copy of a checkpoint as a run without a shadow would have written it."""
    ckpt = load_checkpoint(src)
    del ckpt["shadow"]
    ckpt["config"] = {**ckpt["config"], "shadow": False}
    save_checkpoint(dst, {k: v for k, v in ckpt.items() if k not in ("format", "version")})
    return dst


@pytest.fixture(scope="module")
def runs(pcfg_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("shadow_runs")
    small_run(pcfg_data, root / "muon", "muon", shadow=True)
    small_run(pcfg_data, root / "adamw", "adamw", lr=0.01, shadow=True)
    return root


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_report_pairs_the_real_step_with_the_shadow_step(runs, optimizer):
    path = runs / optimizer / "ckpt_000006.pt"
    report = analyze_checkpoint(path, AnalysisSettings(dtype="float64")).to_dict()
    assert report["schema_version"] == 4
    paired = report["paired"]
    other = {"adamw": "muon", "muon": "adamw"}[optimizer]
    assert [d["name"] for d in paired["directions"]] == ["adamw", "muon"] and paired["real"] == optimizer
    real = next(d for d in paired["directions"] if d["name"] == optimizer)
    shadow = next(d for d in paired["directions"] if d["name"] == other)
    assert shadow["source"] == f"shadow {other} state"
    assert paired["shadow"]["kind"] == other and paired["shadow"]["lr"] == {"muon": 0.02, "adamw": 0.0018}[other]
    # the real direction, measured beside the shadow's, is the report's own step (Taylor split, its own point)
    for key in ("nds", "cosine", "update_norm", "first_order"):
        assert real["all"][key] == pytest.approx(report[key], rel=1e-9)
        assert real["hidden"][key] == pytest.approx(report["hidden"][key], rel=1e-9)
    # the shadow's direction, rebuilt by hand from the checkpoint's payload, and its NDS by another route
    ckpt = load_checkpoint(path)
    target = open_checkpoint(path)
    target.model.eval()
    loss_fn = make_loss_fn(target.model)
    G, _ = next_update(target.model, target.optimizer, loss_fn, target.train_batches[0], max_grad_norm=1.0)
    state = ShadowState.from_state_dict(ckpt["shadow"])
    W = {n: p.detach() for n, p in target.model.named_parameters()}
    group = target.optimizer.param_groups[0]
    Zs = state.direction(G, W, group["lr"] / group["initial_lr"])
    Zh = {n: Zs.get(n, torch.zeros_like(w)) for n, w in W.items()}
    expected = nds(loss_fn, W, target.train_batches[0], Zh, dtype=torch.float64)
    assert shadow["hidden"]["nds"] == pytest.approx(expected, rel=1e-8)
    assert shadow["hidden"]["update_norm"] == pytest.approx(param_dicts.norm(Zs), rel=1e-9)
    scalars = CurvatureReport.from_dict(report).scalars().paired
    for kind in ("nds", "cos", "q"):
        for arm in ("adamw", "muon"):
            for scope in ("all", "hidden"):
                assert math.isfinite(scalars[f"paired_{kind}_{arm}_{scope}"])
    assert scalars[f"paired_nds_{other}_hidden"] == shadow["hidden"]["nds"]
    q = scalars[f"paired_q_{other}_hidden"]
    assert q == pytest.approx(scalars[f"paired_cos_{other}_hidden"] ** 2 / scalars[f"paired_nds_{other}_hidden"])


def test_no_shadow_means_no_paired_keys_and_no_crash(runs, tmp_path):
    plain = without_shadow(runs / "adamw" / "ckpt_000006.pt", tmp_path / "plain.pt")
    report = analyze_checkpoint(plain).to_dict()
    assert report["paired"] is None
    assert not [k for k in CurvatureReport.from_dict(report).scalars().to_dict() if k.startswith("paired_")]
    old = {k: v for k, v in report.items() if k != "paired"}  # a report from before the field existed
    assert not [k for k in CurvatureReport.from_dict(old).scalars().to_dict() if k.startswith("paired_")]
    assert AnalysisSettings().key() != AnalysisSettings(paired=False).key()
    # reports cached before the paired section existed (schema 2, no `paired` setting) are not reused
    before = {k: v for k, v in asdict(AnalysisSettings()).items() if k != "paired"}
    old_key = hashlib.sha256(json.dumps({**before, "schema": 2}, sort_keys=True).encode()).hexdigest()[:10]
    assert AnalysisSettings().key() != old_key


def test_compare_splits_the_between_run_ratio(runs, tmp_path):
    result = compare_runs(
        runs / "muon",
        runs / "adamw",
        tmp_path / "cmp",
        MatchCriteria(levels=3, tolerance=0.05, phase="any"),
        progress=False,
    )
    assert result.levels
    for level in result.levels:
        terms = level.paired_terms
        adamw, muon = (level.b, level.a) if level.b.optimizer == "adamw" else (level.a, level.b)
        for scope, key in (("all", "nds"), ("hidden", "hidden_nds")):
            t = terms[scope]
            assert t.between == pytest.approx(t.direction_at_adamw * t.landscape_along_muon, rel=1e-12)
            assert t.between == pytest.approx(t.direction_at_muon * t.landscape_along_adamw, rel=1e-12)
            # the between term is the ratio of the two runs' own steps
            assert t.between == pytest.approx(adamw.mean[key] / muon.mean[key], rel=1e-4)
    data = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert set(data["pairs"][0]["paired"]) == {"all", "hidden"}
    summed = data["paired_ratio_of_means"]["hidden"]
    assert summed["between"] == pytest.approx(summed["direction_at_adamw"] * summed["landscape_along_muon"], rel=1e-12)
    headline = result.headline_levels
    adamw_sum = sum(lv.paired_nds["hidden"][0] for lv in headline)
    muon_sum = sum(lv.paired_nds["hidden"][3] for lv in headline)
    assert summed["between"] == pytest.approx(adamw_sum / muon_sum, rel=1e-12)
    header = (tmp_path / "cmp" / "compare.csv").read_text().splitlines()[0].split(",")
    assert {"between_hidden", "direction_at_adamw_hidden", "landscape_along_muon_all"} <= set(header)
    assert "paired_nds_muon_hidden_a" in header and "paired_q_adamw_all_b" in header


@pytest.mark.heavy
def test_cli_directions_on_adamw_and_muon_checkpoints(runs, tmp_path):
    for optimizer in ("adamw", "muon"):
        path = runs / optimizer / "ckpt_000004.pt"
        out = tmp_path / f"{optimizer}.json"
        result = runner.invoke(app, ["nds", str(path), "--directions", "adamw,muon,sgd,sign", "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert "NDS hidden" in result.output and f"{optimizer}: real step" in result.output
        record = DirectionReport.from_dict(json.loads(out.read_text()))
        assert_made_with_these_packages(record.versions.to_dict())
        assert record.paired.names == ("adamw", "muon", "sgd", "sign") and record.step == 4
        own = analyze_checkpoint(path).to_dict()
        real = record.paired.get(optimizer)
        assert real.all.nds == pytest.approx(own["nds"], rel=1e-5)
        assert real.hidden.nds == pytest.approx(own["hidden"]["nds"], rel=1e-5)
        for name in ("sgd", "sign"):
            assert record.paired.get(name).hidden.update_norm == pytest.approx(real.hidden.update_norm, rel=1e-5)
    # momentum SGD from Muon's buffer, by hand: B' = B + (1 - μ)(G - B) on the hidden matrices
    path = runs / "muon" / "ckpt_000004.pt"
    target = open_checkpoint(path)
    target.model.eval()
    loss_fn = make_loss_fn(target.model)
    G, _ = next_update(target.model, target.optimizer, loss_fn, target.train_batches[0], max_grad_norm=1.0)
    W = {n: p.detach() for n, p in target.model.named_parameters()}
    hidden = record.paired.hidden_names
    params = dict(target.model.named_parameters())
    B = {n: target.optimizer.state[params[n]]["momentum_buffer"] * 0.95 + 0.05 * G[n] for n in hidden}
    Bh = {n: B.get(n, torch.zeros_like(w)) for n, w in W.items()}
    expected = nds(loss_fn, W, target.train_batches[0], Bh)
    assert record.paired.get("sgd").hidden.nds == pytest.approx(expected, rel=1e-4)


@pytest.mark.heavy
def test_cli_gauss_newton_split_of_the_arms(runs, tmp_path):
    """``curvlab nds --directions ... --gauss-newton``: the real step's Gauss–Newton part over both scopes equals
    gauss_newton_form of the same Z, W and batch computed here; the other directions' are not measured."""
    path, out = runs / "muon" / "ckpt_000004.pt", tmp_path / "gn.json"
    args = ["nds", str(path), "--directions", "adamw,muon,sgd", "--gauss-newton", "--dtype", "float64", "--out"]
    result = runner.invoke(app, [*args, str(out)])
    assert result.exit_code == 0, result.output
    assert "Gauss–Newton split" in result.output and "x residual factor" in result.output
    record = DirectionReport.from_dict(json.loads(out.read_text()))
    target = open_checkpoint(path)
    target.model.eval()
    loss_fn = make_loss_fn(target.model)
    _, Z = next_update(target.model, target.optimizer, loss_fn, target.train_batches[0], max_grad_norm=1.0)
    W = {n: p.detach() for n, p in target.model.named_parameters()}
    Zh = {n: z if n in record.paired.hidden_names else torch.zeros_like(z) for n, z in Z.items()}
    muon = record.paired.get("muon")
    for scope, z in ((muon.all, Z), (muon.hidden, Zh)):
        gn = gauss_newton_form(loss_fn, W, target.train_batches[0], z, dtype=torch.float64)
        assert scope.nds_gauss_newton == pytest.approx(gn / param_dicts.norm(z) ** 2, rel=1e-8)
    adamw = record.paired.get("adamw")
    assert min(adamw.all.nds_gauss_newton, adamw.hidden.nds_gauss_newton, muon.hidden.nds_gauss_newton) > 0
    assert math.isnan(record.paired.get("sgd").hidden.nds_gauss_newton)
    assert "paired_ndsgn_adamw_hidden" in record.paired.scalars()


def test_cli_directions_approximation_and_bad_input(runs, tmp_path):
    adamw = without_shadow(runs / "adamw" / "ckpt_000004.pt", tmp_path / "adamw.pt")
    result = runner.invoke(app, ["nds", str(adamw), "--directions", "muon,adamw"])
    assert result.exit_code == 0, result.output
    assert "muon: approximation: msign of Adam's first moment" in result.output
    muon = without_shadow(runs / "muon" / "ckpt_000004.pt", tmp_path / "muon.pt")
    result = runner.invoke(app, ["nds", str(muon), "--directions", "sgd,adamw"])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "no shadow Adam" in result.output
    result = runner.invoke(app, ["nds", str(muon), "--directions", "muon,newton"])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "unknown direction 'newton'" in result.output


def test_both_scopes_of_each_direction_equal_the_dense_hessian_where_the_scopes_couple(transformer_problem):
    """Each direction's NDS over all parameters and over the hidden scope (the interactions of its two
    parts: the rest's second backward, then the hidden matrices' on them alone) against the dense float64
    Hessian, on a model whose hidden matrices and the rest are coupled (the cross term is not zero)."""
    loss_fn, params, batch = transformer_problem
    H = dense_hessian(loss_fn, params, batch)
    hidden = [n for n, t in params.items() if t.dim() == 2][1:-1]
    mask = param_dicts.flatten({n: torch.full_like(t, float(n in hidden)) for n, t in params.items()})
    dirs = [Direction(f"d{k}", random_direction(params, 10 + k), "test", "own") for k in range(2)]
    with CurvaturePoint(loss_fn, params, batch) as point:
        measured = measure_directions(point, dirs, hidden)
    for d, m in zip(dirs, measured):
        z = param_dicts.flatten(d.z)
        zs = z * mask
        cross = float(zs @ H @ (z - zs))
        assert abs(cross) > 1e-3 * abs(float(z @ H @ z))  # (the coupling under test is there)
        assert m.all.nds == pytest.approx(float(z @ H @ z / (z @ z)), rel=1e-10)
        assert m.hidden.nds == pytest.approx(float(zs @ H @ zs / (zs @ zs)), rel=1e-10)
