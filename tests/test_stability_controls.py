"""The stability context's eigenvalues at one point (curvlab.analysis.controls.stability_controls) carry their
residuals and converged flags, against dense float64 references on a tiny MLP; a run cut short says so; a
preconditioned sharpness under the Rayleigh bound v1'Hv1 / v1'Pv1 is unconverged; the aggregates leave
unconverged values out and count them; AdamW's threshold with decoupled weight decay, against the spectral
radius of the iteration as torch codes it."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import curvlab.steps.stability_point as stability_module
from curvlab import stability_point
from curvlab.analysis.controls import LANCZOS_TOL, PointControls, stability_controls
from curvlab.analysis.directions import Direction
from curvlab.curvature.spectral import lanczos
from curvlab.engine.operator import Operator
from curvlab.errors import CurvlabError
from curvlab.optim.adam import adam_edge_of_stability
from curvlab.steps.stability_point import decoupled_weight_decay
from curvlab.studies.controls import StabilityEntry, stability
from tests.reference import ADAM_BETAS, ADAM_EPS, ADAM_LR, adam_trained_mlp, dense_hessian
from tests.synthetic import level_data, record

LR, BETAS, EPS = ADAM_LR, ADAM_BETAS, ADAM_EPS


def trained(steps=3, seed=0, weight_decay=0.0, optimizer=torch.optim.Adam, width=7):
    """A float64 MLP after ``steps`` full-batch Adam(W) steps; its optimizer, loss, parameters and batch."""
    return adam_trained_mlp(steps, seed, optimizer=optimizer, width=width, weight_decay=weight_decay)


def preconditioner(model, opt, steps=3):
    """Adam's P = (1 - β1^t)(sqrt(v / (1 - β2^t)) + ε), flat, written out from the state."""
    pieces = [(opt.state[p]["exp_avg_sq"] / (1 - BETAS[1] ** steps)).sqrt() + EPS for p in model.parameters()]
    return (1 - BETAS[0] ** steps) * torch.cat([d.reshape(-1) for d in pieces])


def muon_direction(params, seed=1):
    g = torch.Generator().manual_seed(seed)
    return Direction("muon", {n: torch.randn(p.shape, generator=g, dtype=p.dtype) for n, p in params.items()}, "", "")


def controls_at(iterations, **kw):
    model, opt, loss_fn, params, batch = trained(**kw)
    G = {n: torch.zeros_like(p) for n, p in params.items()}
    c = stability_controls(
        loss_fn, model, opt, params, batch, muon_direction(params), G, iterations, method="rev_rev", dtype=None
    )
    return c, model, opt, loss_fn, params, batch


def test_every_eigenvalue_of_the_controls_carries_its_residual_and_flag_against_dense_float64():
    c, model, opt, loss_fn, params, batch = controls_at(200)
    H = dense_hessian(loss_fn, params, batch)
    P = preconditioner(model, opt)
    A = P.rsqrt()[:, None] * H * P.rsqrt()[None, :]
    lam, vecs = torch.linalg.eigh(H)
    top_a = float(torch.linalg.eigvalsh(A)[-1])
    # at LANCZOS_TOL: the top eigenvalue within the true residual (recomputed from the dense matrices)
    assert abs(c.lambda_max - float(lam[-1])) <= c.lambda_residual
    assert abs(c.preconditioned_sharpness - top_a) <= c.preconditioned_residual
    assert c.lambda_max == pytest.approx(float(lam[-1]), rel=1e-6)
    assert c.preconditioned_sharpness == pytest.approx(top_a, rel=1e-6)
    assert c.lambda_converged is True and c.preconditioned_converged is True
    assert c.lambda_residual <= LANCZOS_TOL * abs(c.lambda_max)
    assert c.preconditioned_residual <= LANCZOS_TOL * abs(c.preconditioned_sharpness)
    v1 = vecs[:, -1]
    # (of the Ritz vector: to the exact v1's within what LANCZOS_TOL leaves of it)
    assert c.preconditioned_bound == pytest.approx(float(v1 @ H @ v1) / float(v1 @ (P * v1)), rel=1e-3)
    assert c.preconditioned_bound <= c.preconditioned_sharpness
    assert c.weight_decay == 0.0 and c.edge_of_stability == adam_edge_of_stability(LR, BETAS[0])
    scalars = c.scalars()
    assert scalars["control_lambda_converged"] == scalars["control_preconditioned_converged"] == 1.0
    assert scalars["control_preconditioned_residual"] == c.preconditioned_residual
    d = json.loads(json.dumps(c.to_dict()))
    assert {"lambda_residual", "lambda_converged", "preconditioned_residual", "preconditioned_converged"} <= set(d)
    assert PointControls.from_dict(d) == c
    # a report written before the flags reads, with them as None, and gives no flag scalars
    old = {k: v for k, v in d.items() if k not in {"lambda_converged", "preconditioned_residual",
                                                   "preconditioned_converged", "preconditioned_bound", "weight_decay"}}  # fmt: skip
    before = PointControls.from_dict(old)
    assert before.lambda_converged is None and before.preconditioned_residual is None
    assert "control_lambda_converged" not in before.scalars() and "control_lambda_residual" in before.scalars()


def test_a_truncated_lanczos_run_is_flagged_unconverged_through_the_controls():
    """Two iterations on a 56-parameter MLP whose spectrum needs more: both eigenvalues unconverged, their
    residuals the true ones, the note says so, and the scalars carry the flags as 0."""
    c, _, _, loss_fn, params, batch = controls_at(2)
    H = dense_hessian(loss_fn, params, batch)
    lam = torch.linalg.eigvalsh(H)
    assert c.lambda_converged is False and c.preconditioned_converged is False
    assert c.lambda_residual > 10 * LANCZOS_TOL * abs(c.lambda_max)
    assert float((lam - c.lambda_max).abs().min()) <= c.lambda_residual  # an eigenvalue lies within it
    assert c.lambda_max < float(lam[-1])
    assert "lambda_max unconverged in 2 iterations" in c.note
    assert "preconditioned sharpness" in c.note
    s = c.scalars()
    assert s["control_lambda_converged"] == 0.0 and s["control_preconditioned_converged"] == 0.0


def _dominated_by_its_negative_end(dim=200, seed=0):
    """A symmetric matrix with top eigenvalue 1, the rest in [-0.5, 0.9] but one at -1e5: the shape of the
    preconditioned Hessians whose Lanczos stopped at 0.18 and 0.0011 (quick, s = 1)."""
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    values = torch.cat([torch.tensor([1.0, -1e5], dtype=torch.float64), torch.linspace(-0.5, 0.9, dim - 2).double()])
    A = (Q * values) @ Q.T
    return Operator(dim, lambda X: A @ X, device="cpu", dtype=torch.float64), A


def test_a_tolerance_relative_to_the_eigenvalue_resolves_a_top_end_the_spectrum_dwarfs():
    """Relative to max|θ| (-1e5 here) Lanczos accepts a top Ritz value far from 1 after a few iterations and
    calls it converged; relative to the eigenvalue it runs on to 1 within the tolerance, or says it didn't."""
    op, A = _dominated_by_its_negative_end()
    loose = lanczos(op, max_iter=100, tol=LANCZOS_TOL)
    assert loose.converged and loose.iterations < 10 and float(loose.eigenvalues[0]) < 0.9
    tight = lanczos(op, max_iter=200, tol=LANCZOS_TOL, relative_to="eigenvalue")
    assert tight.converged and float(tight.residuals[0]) <= 10 * LANCZOS_TOL * abs(float(tight.eigenvalues[0]))
    assert float(tight.eigenvalues[0]) == pytest.approx(1.0, rel=1e-3)
    u = tight.eigenvectors[:, 0]
    assert float(tight.residuals[0]) == pytest.approx(
        float(torch.linalg.norm(A @ u - tight.eigenvalues[0] * u)), rel=1e-8
    )
    short = lanczos(op, max_iter=5, tol=LANCZOS_TOL, relative_to="eigenvalue")
    assert not short.converged
    with pytest.raises(CurvlabError, match="relative_to"):
        lanczos(op, relative_to="max")


def test_a_preconditioned_value_under_the_rayleigh_bound_is_unconverged(monkeypatch):
    """A Lanczos run that stops on a Ritz value far below the top (as one whose tolerance is relative to a
    large negative end can) but calls itself converged: the bound v1'Hv1 / v1'Pv1 catches it."""
    real = lanczos
    calls = []

    def low(op, **kw):
        out = real(op, **kw)
        calls.append(1)
        if len(calls) == 2:  # the preconditioned problem: a tiny value, "converged"
            return replace(out, eigenvalues=out.eigenvalues * 1e-4, converged=True)
        return out

    monkeypatch.setattr(stability_module, "lanczos", low)
    model, opt, loss_fn, params, batch = trained()
    point = stability_point(loss_fn, params, batch, model, opt, max_iter=200, tol=LANCZOS_TOL)
    assert point.lambda_converged and point.preconditioned_sharpness < point.preconditioned_bound
    assert point.preconditioned_converged is False
    G = {n: torch.zeros_like(p) for n, p in params.items()}
    calls.clear()
    c = stability_controls(
        loss_fn, model, opt, params, batch, muon_direction(params), G, 200, method="rev_rev", dtype=None
    )
    assert c.preconditioned_converged is False and "below its bound" in c.note


def test_the_preconditioned_sharpness_can_lie_below_lambda_max_only_where_p_exceeds_one():
    """With P's entries above 1 (a large second moment) P^{-1/2} H P^{-1/2} is smaller than H: its top
    eigenvalue lies below lambda_max(H), at or above the Rayleigh bound, and Lanczos converges to it."""
    model, opt, loss_fn, params, batch = trained()
    for p in model.parameters():  # gradients of RMS 1e3: P about 270 per entry at t = 3
        opt.state[p]["exp_avg_sq"].fill_(1e6 * (1 - BETAS[1] ** 3))
    point = stability_point(loss_fn, params, batch, model, opt, max_iter=200, tol=1e-10)
    H = dense_hessian(loss_fn, params, batch)
    P = preconditioner(model, opt)
    assert float(P.min()) > 1
    dense = float(torch.linalg.eigvalsh(P.rsqrt()[:, None] * H * P.rsqrt()[None, :])[-1])
    assert point.preconditioned_sharpness == pytest.approx(dense, rel=1e-9)
    assert point.preconditioned_sharpness < point.lambda_max
    v = point.eigenvector
    assert point.preconditioned_bound == pytest.approx(float(v @ H @ v) / float(v @ (P * v)), rel=1e-10)
    assert point.preconditioned_bound <= point.preconditioned_sharpness * (1 + 1e-12)
    assert point.preconditioned_sharpness >= point.lambda_max / float(P.max()) * (1 - 1e-12)
    assert point.preconditioned_converged


def test_with_typical_adam_state_the_preconditioned_sharpness_exceeds_lambda_max():
    """P below 1 (gradients of RMS below 1): the bound alone puts it above lambda_max(H)."""
    model, opt, loss_fn, params, batch = trained()
    point = stability_point(loss_fn, params, batch, model, opt, max_iter=200, tol=1e-10)
    P = preconditioner(model, opt)
    assert float(P.max()) < 1
    assert point.preconditioned_sharpness >= point.preconditioned_bound > point.lambda_max > 0


# -- decoupled weight decay ----------------------------------------------------------------------------


def adamw_radius(a, lr, beta1, gamma):
    """The spectral radius of AdamW's step on a 1-D quadratic of preconditioned curvature a (frozen P = 1),
    read off by stepping the basis states (x, m) as torch's AdamW codes it: decay first, then the step."""

    def step(x, m):
        m = beta1 * m + (1 - beta1) * a * x
        return (1 - lr * gamma) * x - lr * m, m

    M = np.array([step(1.0, 0.0), step(0.0, 1.0)]).T
    return max(abs(np.linalg.eigvals(M)))


@pytest.mark.parametrize("gamma", [0.0, 0.1, 1.0, 10.0])
@pytest.mark.parametrize("lr", [0.008, 0.05])
@pytest.mark.parametrize("beta1", [0.0, 0.9])
def test_adamw_threshold_with_decoupled_weight_decay_against_the_spectral_radius(gamma, lr, beta1):
    edge = adam_edge_of_stability(lr, beta1) - (1 + beta1) / (1 - beta1) * gamma
    assert adamw_radius(edge * (1 - 1e-6), lr, beta1, gamma) < 1 < adamw_radius(edge * (1 + 1e-6), lr, beta1, gamma)
    assert all(adamw_radius(edge * f, lr, beta1, gamma) < 1 for f in np.linspace(0.01, 0.999, 40))


def test_stability_point_takes_adamws_decoupled_weight_decay_and_records_it():
    """torch's AdamW step is (1 - ηγ)W - η P^{-1} m (checked against the optimizer itself), and the point's
    threshold is 38/η - 19γ with γ recorded; Adam's coupled decay leaves the threshold as it was."""
    model, opt, loss_fn, params, batch = trained(weight_decay=0.1, optimizer=torch.optim.AdamW)
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    for p, w in zip(model.parameters(), before.values()):
        s = opt.state[p]
        P = (1 - BETAS[0] ** 4) * ((s["exp_avg_sq"] / (1 - BETAS[1] ** 4)).sqrt() + EPS)
        assert torch.allclose(p.detach(), (1 - LR * 0.1) * w - LR * s["exp_avg"] / P, rtol=1e-12, atol=1e-15)
    point = stability_point(loss_fn, params, batch, model, opt, max_iter=200, tol=1e-10)
    assert point.weight_decay == 0.1 and decoupled_weight_decay(opt) == 0.1
    assert point.edge_of_stability == pytest.approx(38 / LR - 19 * 0.1, rel=1e-12)
    model, opt, loss_fn, params, batch = trained(weight_decay=0.1, optimizer=torch.optim.Adam)
    point = stability_point(loss_fn, params, batch, model, opt, max_iter=200, tol=1e-10)
    assert point.weight_decay == 0.0 and point.edge_of_stability == adam_edge_of_stability(LR, BETAS[0])
    mixed = torch.optim.AdamW(
        [{"params": [model.fc1.weight], "weight_decay": 0.1}, {"params": [model.fc1.bias, *model.fc2.parameters()]}],
        weight_decay=0.0,
    )
    assert decoupled_weight_decay(mixed) is None  # no scalar threshold: the point keeps the one without γ


def test_groups_at_two_lrs_share_a_decoupled_decay_where_their_lr_times_decay_is_one():
    """AdamW's group g decays by η_g γ_g a step: with η_g γ_g the same in both groups, the real step is
    (1 - ηγ)W - η P'^{-1} m at the largest lr η, with γ the largest-lr group's and P' each group's P times
    η/η_g; with equal γ at different lrs there is no one γ."""
    model, _, loss_fn, params, batch = trained(steps=0)
    halves = [list(model.fc1.parameters()), list(model.fc2.parameters())]
    opt = torch.optim.AdamW(
        [{"params": halves[0], "lr": 0.02, "weight_decay": 0.25}, {"params": halves[1], "lr": 0.05, "weight_decay": 0.1}],
        betas=BETAS, eps=EPS,
    )  # fmt: skip
    x, y = batch
    for _ in range(4):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
    assert decoupled_weight_decay(opt) == 0.1
    P = stability_module.adam_preconditioner(opt, model, scale_by_lr=True)
    for n, p in model.named_parameters():
        predicted = (1 - 0.05 * 0.1) * before[n] - 0.05 * opt.state[p]["exp_avg"] / P[n]
        assert torch.allclose(p.detach(), predicted, rtol=1e-12, atol=1e-15), n
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    point = stability_point(loss_fn, params, batch, model, opt, max_iter=40, tol=1e-10)
    assert point.lr == 0.05 and point.weight_decay == 0.1
    assert point.edge_of_stability == pytest.approx(38 / 0.05 - 19 * 0.1, rel=1e-12)
    opt.param_groups[0]["weight_decay"] = 0.1
    assert decoupled_weight_decay(opt) is None


# -- the aggregates ------------------------------------------------------------------------------------


def _point(lam=50.0, residual=0.01, sharp=30.0, **flags):
    x = {"paired_nds_adamw_hidden": 6.0, "paired_nds_muon_hidden": 1.0, "paired_nds_adamw_all": 6.0}
    x |= {"paired_nds_muon_all": 1.0, "control_lambda_max": lam, "control_lambda_residual": residual}
    x |= {"control_preconditioned_sharpness": sharp, "control_edge_of_stability": 38 / 0.004}
    x |= {"control_two_over_lr": 2 / 0.004} | {f"control_{k}": float(v) for k, v in flags.items()}
    return x


def _entries(adamw_points, seeds=3):
    muon = [_point(lambda_converged=True, preconditioned_converged=True)] * len(adamw_points)
    data = level_data([record("adamw/muon", s, adamw_points, muon) for s in range(seeds)], s_values=(0.0,))
    return {(e.arm, e.quantity): e for e in stability(data)}


def test_unconverged_eigenvalues_are_left_out_of_the_aggregates_and_counted():
    good = _point(lambda_converged=True, preconditioned_converged=True)
    bad_lam = _point(lam=1e-4, residual=0.03, sharp=30.0, lambda_converged=False, preconditioned_converged=True)
    bad_pre = _point(sharp=0.5, lambda_converged=True, preconditioned_converged=False)
    e = _entries([good, bad_lam, bad_pre])
    lam = e[("adamw", "lambda_max")]
    assert lam.value == pytest.approx(50.0) and lam.n_unconverged == 3 and lam.n_points == 6
    assert "3 points with an unconverged lambda eigenvalue (left out)" in lam.note
    pre = e[("adamw", "preconditioned_sharpness")]
    assert pre.value == pytest.approx(30.0) and pre.n_unconverged == 3 and pre.n_points == 6
    assert e[("adamw", "sharpness_over_edge")].n_unconverged == 3
    assert e[("adamw", "nds_adamw_over_lambda_max")].value == pytest.approx(6 / 50)
    assert e[("adamw", "edge_of_stability")].n_unconverged == 0 and e[("adamw", "edge_of_stability")].n_points == 9
    residual = e[("adamw", "lambda_residual_over_lambda_max")]
    assert residual.n_points == 9 and residual.n_unconverged == 3 and "kept" in residual.note
    assert e[("muon", "lambda_max")].n_unconverged == 0 and e[("muon", "lambda_max")].note == ""
    # every eigenvalue entry says how far Lanczos got: the median relative residual over all its points, and
    # whether every one converged
    assert lam.residual == pytest.approx(0.01 / 50) and lam.converged is False  # (medians of 0.0002, 300, 0.0002)
    assert e[("muon", "lambda_max")].converged is True and e[("muon", "lambda_max")].residual == pytest.approx(2e-4)
    assert e[("adamw", "edge_of_stability")].residual is None and e[("adamw", "edge_of_stability")].converged is None


def test_lambda_min_over_lambda_max_where_measured():
    """lambda_min / lambda_max per arm, over the points whose lambda_min converged (its own flag), negative with a
    log-t interval of its magnitude, its residual relative to lambda_max (the scale it converged to); no entry
    where no point measured it (level files from before issue 52)."""
    flags = {"lambda_converged": True, "preconditioned_converged": True}
    good = _point(**flags) | {"control_lambda_min": -2.0, "control_lambda_min_residual": 0.02}
    good |= {"control_lambda_min_converged": 1.0}
    bad = good | {"control_lambda_min": -40.0, "control_lambda_min_converged": 0.0}
    e = _entries([good, bad])
    bottom = e[("adamw", "lambda_min_over_lambda_max")]
    assert bottom.value == pytest.approx(-2.0 / 50) and bottom.n_unconverged == 3 and bottom.n_points == 3
    assert bottom.ci95 == pytest.approx([-2.0 / 50, -2.0 / 50])  # (every seed the same: a zero-width interval)
    assert "<= 0" not in bottom.note and bottom.residual == pytest.approx(0.02 / 50)
    varied = [good | {"control_lambda_min": -x} for x in (1.0, 2.0, 4.0)]
    spread = _entries(varied, seeds=1) | {}
    ci = _entries([varied[0]], seeds=1)[("adamw", "lambda_min_over_lambda_max")].ci95
    assert spread[("adamw", "lambda_min_over_lambda_max")].value == pytest.approx(-2.0 / 50) and ci is None
    assert ("adamw", "lambda_min_over_lambda_max") not in _entries([_point(**flags)])


def test_points_written_before_the_flags_judge_lambda_max_by_its_residual():
    """A level file of before: lambda_max converged where its residual is within lanczos' slack (quick's
    two AdamW values at relative residuals 96 and 280 are not); the preconditioned one can't be told."""
    old = [_point(residual=0.01), _point(lam=7e-5, residual=7e-5 * 280)]
    e = _entries(old)
    lam = e[("adamw", "lambda_max")]
    assert lam.value == pytest.approx(50.0) and lam.n_unconverged == 3
    pre = e[("adamw", "preconditioned_sharpness")]
    assert pre.n_unconverged == 0 and pre.n_points == 6
    assert "6 points without a converged flag (written before it): kept" in pre.note
    assert pre.converged is None and pre.residual is None  # (no residual stored, convergence untold)
    assert StabilityEntry.from_dict({k: v for k, v in lam.to_dict().items() if k != "n_unconverged"}).n_unconverged == 0
