"""Adam's preconditioned sharpness (curvlab.curvature.preconditioned, curvlab.optim.adam, stability_point) on a
small MLP trained by torch's Adam, against independent references: P written out by hand from the state (and
checked against the step torch's Adam takes), the eigenvalue against dense float64 eigendecompositions of
P^{-1/2} H P^{-1/2} and of the generalized problem H x = λ P x, the residual recomputed from the dense matrix,
and the converged flag of a run cut short."""

import json
import math

import numpy as np
import pytest
import scipy.linalg
import torch
import torch.nn.functional as F

import curvlab
from curvlab import (
    CurvaturePoint,
    adam_edge_of_stability,
    adam_preconditioner,
    hessian_operator_at,
    lanczos,
    preconditioned_sharpness,
    preconditioned_sharpness_at,
    stability_point,
)
from curvlab.errors import CurvlabError
from tests.reference import ADAM_BETAS, ADAM_EPS, ADAM_LR, adam_trained_mlp, dense_hessian

LR, BETAS, EPS = ADAM_LR, ADAM_BETAS, ADAM_EPS
STEPS = 3  # early: 1 - 0.9^3 = 0.271, so P with and without the first moment's correction differ 3.7x


def trained_mlp(steps=STEPS, amsgrad=False, seed=0):
    """A float64 MLP after ``steps`` full-batch steps of torch's Adam, its optimizer and its problem."""
    return adam_trained_mlp(steps, seed, amsgrad=amsgrad)


def hand_preconditioner(model, opt, bias_correction):
    """P written out from the state: (1 - β1^t)(sqrt(v / (1 - β2^t)) + ε), flat in the parameters' order."""
    pieces = []
    for p in model.parameters():
        state = opt.state[p]
        t = int(state["step"])
        v = state["max_exp_avg_sq"] if "max_exp_avg_sq" in state else state["exp_avg_sq"]
        d = (v / (1 - BETAS[1] ** t)).sqrt() + EPS
        pieces.append((d * (1 - BETAS[0] ** t) if bias_correction else d).reshape(-1))
    return torch.cat(pieces)


def dense_preconditioned(H, p):
    s = p.rsqrt()
    return s[:, None] * H * s[None, :]


@pytest.mark.parametrize("bias_correction", [True, False])
def test_adam_preconditioned_sharpness_against_dense_float64(bias_correction):
    model, opt, loss_fn, params, batch = trained_mlp()
    H = dense_hessian(loss_fn, params, batch)
    p = hand_preconditioner(model, opt, bias_correction)
    A = dense_preconditioned(H, p)
    dense = float(torch.linalg.eigvalsh(A)[-1])
    generalized = float(scipy.linalg.eigh(H.numpy(), np.diag(p.numpy()), eigvals_only=True)[-1])  # H x = λ P x
    assert generalized == pytest.approx(dense, rel=1e-10)
    P = adam_preconditioner(opt, model, bias_correction=bias_correction)
    assert list(P) == list(params) and all(P[n].shape == params[n].shape for n in params)
    torch.testing.assert_close(torch.cat([d.reshape(-1) for d in P.values()]), p, rtol=1e-14, atol=0)
    top = preconditioned_sharpness(loss_fn, params, batch, P, max_iter=H.shape[0], tol=1e-10)
    assert top.converged and top.eigenvalues[0] == pytest.approx(dense, rel=1e-10)
    assert float(top.residuals[0]) <= 1e-8 * dense
    # the eigenvector, in the preconditioned coordinates, is the dense one; x = P^{-1/2} u solves H x = λ P x
    u = top.eigenvectors[:, 0]
    assert abs(float(u @ torch.linalg.eigh(A)[1][:, -1])) == pytest.approx(1.0, abs=1e-8)
    x = p.rsqrt() * u
    torch.testing.assert_close(H @ x, float(top.eigenvalues[0]) * p * x, rtol=0, atol=1e-8 * dense)
    # at a point already open, with λ_max(H) from the same point
    with CurvaturePoint(loss_fn, params, batch) as point:
        again = preconditioned_sharpness_at(point, P, max_iter=H.shape[0], tol=1e-10)
        lam = lanczos(hessian_operator_at(point), max_iter=H.shape[0], tol=1e-10)
    assert again.eigenvalues[0] == pytest.approx(dense, rel=1e-10)
    assert lam.eigenvalues[0] == pytest.approx(float(torch.linalg.eigvalsh(H)[-1]), rel=1e-10)


def test_the_first_moments_correction_scales_the_sharpness_by_one_minus_beta1_to_the_t():
    model, opt, loss_fn, params, batch = trained_mlp()
    kept, left_out = (
        preconditioned_sharpness(loss_fn, params, batch, adam_preconditioner(opt, model, bias_correction=bc), tol=1e-10)
        for bc in (True, False)
    )
    factor = 1 - BETAS[0] ** STEPS
    assert float(left_out.eigenvalues[0]) == pytest.approx(factor * float(kept.eigenvalues[0]), rel=1e-9)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adams_step_is_minus_lr_times_the_preconditioner_inverse_on_its_momentum(amsgrad):
    """P is the preconditioner torch's Adam steps with: W_{t+1} - W_t = -η P_{t+1}^{-1} m_{t+1}, with the
    first moment's correction only."""
    model, opt, _, _, (x, y) = trained_mlp(amsgrad=amsgrad)
    F.cross_entropy(model(x), y).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    for bias_correction in (True, False):
        P = adam_preconditioner(opt, model, bias_correction=bias_correction)
        for n, p in model.named_parameters():
            predicted = -LR * opt.state[p]["exp_avg"] / P[n]
            close = torch.allclose(p.detach() - before[n], predicted, rtol=1e-12, atol=0)
            assert close == bias_correction, (n, bias_correction)


def test_the_residual_is_the_true_one_and_a_short_run_says_it_did_not_converge():
    model, opt, loss_fn, params, batch = trained_mlp()
    H = dense_hessian(loss_fn, params, batch)
    A = dense_preconditioned(H, hand_preconditioner(model, opt, True))
    spectrum = torch.linalg.eigvalsh(A)
    P = adam_preconditioner(opt, model)
    for max_iter in (2, 4, 8):
        short = preconditioned_sharpness(loss_fn, params, batch, P, max_iter=max_iter, tol=1e-10)
        theta, u, r = float(short.eigenvalues[0]), short.eigenvectors[:, 0], float(short.residuals[0])
        recomputed = float(torch.linalg.vector_norm(A @ u - theta * u))
        assert r == pytest.approx(recomputed, rel=1e-9) and r > 1e-6 * float(spectrum[-1])
        assert not short.converged
        assert float((spectrum - theta).abs().min()) <= r  # an eigenvalue lies within the residual of θ
    full = preconditioned_sharpness(loss_fn, params, batch, P, max_iter=H.shape[0], tol=1e-10)
    assert full.converged


def test_stability_point_of_an_adam_mlp_carries_each_eigenvalues_residual():
    model, opt, loss_fn, params, batch = trained_mlp()
    H = dense_hessian(loss_fn, params, batch)
    lam = torch.linalg.eigvalsh(H)
    A = dense_preconditioned(H, hand_preconditioner(model, opt, True))
    point = stability_point(loss_fn, params, batch, model, opt, max_iter=H.shape[0], tol=1e-10)
    assert point.arm == "adam" and point.bias_correction is True and point.lr == LR
    assert point.lambda_converged and point.preconditioned_converged
    assert point.lambda_max == pytest.approx(float(lam[-1]), rel=1e-10)
    assert point.preconditioned_sharpness == pytest.approx(float(torch.linalg.eigvalsh(A)[-1]), rel=1e-10)
    assert point.edge_of_stability == adam_edge_of_stability(LR, 0.9) == pytest.approx(38 / LR)
    v = point.eigenvector
    assert point.lambda_residual == pytest.approx(float(torch.linalg.norm(H @ v - point.lambda_max * v)), abs=1e-12)
    # the integrator's budget: every residual and flag comes back, and agrees with the dense problem
    quick = stability_point(loss_fn, params, batch, model, opt, max_iter=3, bias_correction=False)
    assert quick.bias_correction is False and not quick.lambda_converged and not quick.preconditioned_converged
    v = quick.eigenvector
    assert quick.lambda_residual == pytest.approx(float(torch.linalg.norm(H @ v - quick.lambda_max * v)), rel=1e-9)
    assert float((lam - quick.lambda_max).abs().min()) <= quick.lambda_residual
    left_out = torch.linalg.eigvalsh(dense_preconditioned(H, hand_preconditioner(model, opt, False)))
    assert float((left_out - quick.preconditioned_sharpness).abs().min()) <= quick.preconditioned_residual
    d = json.loads(json.dumps(quick.to_dict()))
    assert d["bias_correction"] is False and d["preconditioned_converged"] is False and "eigenvector" not in d
    assert d["preconditioned_residual"] == quick.preconditioned_residual > 0
    assert d["two_over_lr"] == pytest.approx(2 / LR)


def test_the_stability_instruments_are_public():
    for name in ("preconditioned_sharpness", "preconditioned_sharpness_at", "adam_preconditioner",
                 "adam_edge_of_stability", "stability_point", "StabilityPoint", "EigenResult"):  # fmt: skip
        assert name in curvlab.__all__, name


def test_preconditioner_errors():
    model, opt, loss_fn, params, batch = trained_mlp(steps=1)
    P = adam_preconditioner(opt, model)
    with pytest.raises(CurvlabError, match="preconditioner does not match the parameters: missing 'fc2.bias'"):
        preconditioned_sharpness(loss_fn, params, batch, {n: P[n] for n in list(P)[:3]})
    with pytest.raises(CurvlabError, match="must be positive"):
        preconditioned_sharpness(loss_fn, params, batch, {n: -d for n, d in P.items()})
    with pytest.raises(CurvlabError, match="non-finite"):
        preconditioned_sharpness(loss_fn, params, batch, {n: d * math.inf for n, d in P.items()})
    with pytest.raises(CurvlabError, match="no parameters 'nope'"):
        adam_preconditioner(opt, model, ["nope"])
    with pytest.raises(CurvlabError, match="no Adam state"):
        adam_preconditioner(torch.optim.SGD(model.parameters(), lr=0.1), model)
    fresh = torch.optim.Adam(model.parameters())
    fresh.state[model.fc1.weight] = {"step": torch.tensor(0.0), "exp_avg_sq": torch.zeros_like(model.fc1.weight)}
    with pytest.raises(CurvlabError, match="taken no step"):
        adam_preconditioner(fresh, model, ["fc1.weight"])


def two_lr_mlp(lrs, steps=STEPS, seed=0):
    """adam_trained_mlp's float64 MLP, data and Adam, with fc1 in a group at ``lrs[0]`` and fc2 at ``lrs[1]``."""
    return adam_trained_mlp(steps, seed, group_lrs=lrs)


def lr_scaled_inverse(model, opt):
    """D = diag((η_g / η_max) / ((1 - β1^t)(sqrt(v / (1 - β2^t)) + ε))), flat, written out from the state and groups."""
    top = max(g["lr"] for g in opt.param_groups)
    pieces = []
    for group in opt.param_groups:
        for p in group["params"]:
            t = int(opt.state[p]["step"])
            P = (1 - BETAS[0] ** t) * ((opt.state[p]["exp_avg_sq"] / (1 - BETAS[1] ** t)).sqrt() + EPS)
            pieces.append((group["lr"] / top / P).reshape(-1))
    return torch.cat(pieces)


def test_the_stability_point_of_two_adam_lrs_against_dense_float64():
    """Group g steps -η_g P_g^{-1} m = -η (η_g/η) P_g^{-1} m at the largest lr η: the preconditioned sharpness is
    λ_max(D^{1/2} H D^{1/2}) with D = diag((η_g/η) / P), compared with Adam's threshold at η; the next real step
    is -η P'^{-1} m with P' = adam_preconditioner(..., scale_by_lr=True)."""
    lrs = (0.02, 0.05)
    model, opt, loss_fn, params, batch = two_lr_mlp(lrs)
    H = dense_hessian(loss_fn, params, batch)
    d = lr_scaled_inverse(model, opt)
    dense = float(torch.linalg.eigvalsh(d.sqrt()[:, None] * H * d.sqrt()[None, :])[-1])
    unscaled = float(torch.linalg.eigvalsh(dense_preconditioned(H, hand_preconditioner(model, opt, True)))[-1])
    assert abs(dense / unscaled - 1) > 0.05  # (the lrs' ratio matters here: a test that can fail)
    point = stability_point(loss_fn, params, batch, model, opt, max_iter=H.shape[0], tol=1e-10)
    assert point.arm == "adam" and point.lr == 0.05 and point.weight_decay == 0.0
    assert point.preconditioned_converged and point.preconditioned_sharpness == pytest.approx(dense, rel=1e-10)
    assert point.edge_of_stability == adam_edge_of_stability(0.05, BETAS[0])
    P = adam_preconditioner(opt, model, scale_by_lr=True)
    torch.testing.assert_close(torch.cat([q.reshape(-1) for q in P.values()]), 1 / d, rtol=1e-14, atol=0)
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    P = adam_preconditioner(opt, model, scale_by_lr=True)
    for n, p in model.named_parameters():
        predicted = -0.05 * opt.state[p]["exp_avg"] / P[n]
        assert torch.allclose(p.detach() - before[n], predicted, rtol=1e-12, atol=0), n
    opt.param_groups[0]["lr"] = 0.0
    with pytest.raises(CurvlabError, match="lr 0.0 beside groups"):
        adam_preconditioner(opt, model, scale_by_lr=True)


def test_two_groups_at_one_lr_give_the_stability_point_of_one():
    model, opt, loss_fn, params, batch = trained_mlp()
    model2, opt2, _, params2, _ = two_lr_mlp((LR, LR))
    for n in params:
        assert torch.equal(params[n], params2[n]), n
    plain, scaled = adam_preconditioner(opt, model), adam_preconditioner(opt2, model2, scale_by_lr=True)
    assert all(torch.equal(plain[n], scaled[n]) for n in plain)
    one = stability_point(loss_fn, params, batch, model, opt, max_iter=40, tol=1e-10)
    two = stability_point(loss_fn, params, batch, model2, opt2, max_iter=40, tol=1e-10)
    assert (two.lr, two.preconditioned_sharpness, two.edge_of_stability) == (
        one.lr,
        one.preconditioned_sharpness,
        one.edge_of_stability,
    )
