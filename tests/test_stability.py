"""curvlab.steps.stability against independent references: injected directions against dense float64
Hessians from double-backward rows (a Kronecker quadratic and a tiny GPT), Muon's preconditioner against
msign, a real Muon step and a Gram-matrix / matrix-polynomial construction, its preconditioned sharpness
against a dense eigendecomposition, the thresholds against companion-matrix spectral radii."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from curvlab import make_loss_fn
from curvlab.curvature.groupings import hidden_matrices
from curvlab.engine import params as param_dicts
from curvlab.engine.operator import Operator, hessian_operator
from curvlab.errors import CurvlabError
from curvlab.models.gpt import GPT, MICRO_OVERRIDES, get_config
from curvlab.optim.adam import adam_edge_of_stability
from curvlab.optim.model_optimizer import build_model_optimizer
from curvlab.optim.muon import Muon, muon_scale
from curvlab.optim.polar import NEWTON_SCHULZ_COEFFICIENTS, msign
from curvlab.steps.stability import (
    InjectionScalars,
    inject,
    injected_nds,
    injection_coefficient,
    injection_scalars,
    muon_edge_of_stability,
    muon_factor,
    muon_preconditioned_operator,
    muon_preconditioned_sharpness,
    muon_preconditioner,
    muon_sharpness,
    nesterov_momenta,
)
from curvlab.steps.stability_point import StabilityPoint, stability_point
from curvlab.theory.quadratic_model import KroneckerQuadratic
from tests.reference import dense_gradient, dense_hessian

RATIOS = (1.2, 1.5, 2.0)
# the micro GPT shrunk until its dense Hessian (484 double-backward rows) takes a second
TINY = {**MICRO_OVERRIDES, "n_embd": 4, "vocab_size": 8, "block_size": 4}


def tiny_gpt(seed=0):
    torch.manual_seed(seed)
    model = GPT(get_config("tiny", **TINY)).double()
    g = torch.Generator().manual_seed(seed)
    batch = (torch.randint(0, 8, (3, 4), generator=g), torch.randint(0, 8, (3, 4), generator=g))
    return model, make_loss_fn(model), batch


def detached(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def kronecker_quadratic(d1=3, d2=4, rank=2, seed=0):
    g = torch.Generator().manual_seed(seed)

    def spd(n):
        X = torch.randn(n, n, generator=g, dtype=torch.float64)
        return X @ X.T + 0.1 * torch.eye(n, dtype=torch.float64)

    A = torch.stack([spd(d1) for _ in range(rank)])
    B = torch.stack([spd(d2) for _ in range(rank)])
    return KroneckerQuadratic(A, B, torch.randn(d1, d2, generator=g, dtype=torch.float64))


def dense_nds(H, z):
    return float(z @ H @ z / (z @ z))


# -- injected sharp direction ------------------------------------------------------------------------------


def check_injection(loss_fn, params, batch, H, z):
    """Scalars by HVPs against the dense H; the closed form against the dense NDS at any c; the chosen c
    hits every ratio; Z' the same for both signs of v1; c the smaller root."""
    lam, V = torch.linalg.eigh(H)
    lam1, v = float(lam[-1]), V[:, -1]
    z0 = dense_nds(H, z)
    assert 0 < z0 < lam1 / 2  # (the setting: every ratio reachable)
    zd = param_dicts.unflatten(z, params)
    for sign in (1.0, -1.0):
        v1 = sign * v
        s = injection_scalars(loss_fn, params, batch, zd, param_dicts.unflatten(v1, params))
        hz = H @ z
        reference = (float(z @ hz), float(z @ z), float(v1 @ z), float(v1 @ hz), float(v1 @ H @ v1))
        np.testing.assert_allclose([s.zhz, s.zz, s.vz, s.vhz, s.vhv], reference, rtol=1e-10, atol=1e-12)
        assert s.vhv == pytest.approx(lam1, rel=1e-10)
        for c in (-0.7, 0.3, 2.5):  # the closed form at any c
            zc = z + c * v1
            assert injected_nds(s.zhz, s.zz, s.vz, s.vhz, lam1, c) == pytest.approx(dense_nds(H, zc), rel=1e-10)
        for r in RATIOS:
            c = injection_coefficient(s.zhz, s.zz, s.vz, s.vhz, lam1, r)
            assert c == s.coefficient(r) or c == pytest.approx(s.coefficient(r), rel=1e-9)
            zp = param_dicts.flatten(inject(zd, param_dicts.unflatten(v1, params), c))
            assert dense_nds(H, zp) / z0 == pytest.approx(r, abs=1e-10)
            assert s.nds_at(c) / s.nds == pytest.approx(r, abs=1e-10)
            # the other root, by numpy on the dense quadratic: also reaches r, and is at least as large
            t = r * z0
            roots = np.roots([lam1 - t, 2 * float(v1 @ hz - t * (v1 @ z)), float(z @ hz - t * (z @ z))])
            assert np.isreal(roots).all() and min(abs(roots)) == pytest.approx(abs(c), rel=1e-9)
            other = float(roots[np.argmax(abs(roots))].real)
            assert np.sign(other) == -np.sign(c) and dense_nds(H, z + other * v1) / z0 == pytest.approx(r, abs=1e-10)
            # the sign convention: Z' does not depend on v1's sign
            cm = injection_coefficient(s.zhz, s.zz, -s.vz, -s.vhz, lam1, r)
            assert cm == pytest.approx(-c, rel=1e-12)
            torch.testing.assert_close(zp, z + cm * (-v1), rtol=0, atol=1e-12)
            # for an exact eigenvector beta = <v1,Z>(lambda_1 - t): c has the sign of <v1, Z>
            assert np.sign(c) == np.sign(float(v1 @ z))


def test_injected_direction_on_a_kronecker_quadratic():
    q = kronecker_quadratic()
    H = q.dense_hessian()
    params = {"Y": torch.zeros_like(q.G)}
    z = torch.randn(H.shape[0], generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    z = z - 0.3 * torch.linalg.eigh(H)[1][:, -1] * float(z.norm())  # some alignment with v1, of either sign
    check_injection(q.loss_fn, params, None, H, z)
    # H from the Kronecker factors is the one the HVPs see
    e = torch.zeros(H.shape[0], dtype=torch.float64)
    e[5] = 1.0
    torch.testing.assert_close(q.hvp(e.view(q.shape)).reshape(-1), H[5], rtol=1e-12, atol=1e-12)


@pytest.mark.heavy
def test_injected_direction_on_a_tiny_gpt():
    model, loss_fn, batch = tiny_gpt()
    params = detached(model)
    H = dense_hessian(loss_fn, params, batch)
    z = torch.randn(H.shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64)  # NDS(Z) > 0
    check_injection(loss_fn, params, batch, H, z)


def test_a_direction_orthogonal_to_v1_takes_the_non_negative_root():
    lam1, r = 5.0, 1.5
    c = injection_coefficient(2.0, 1.0, 0.0, 0.0, lam1, r)  # NDS(Z) = 2, Z ⟂ v1
    assert c > 0 and c == pytest.approx(math.sqrt((3.0 - 2.0) / (lam1 - 3.0)))  # (λ-t)c² = t - NDS
    assert injected_nds(2.0, 1.0, 0.0, 0.0, lam1, c) == pytest.approx(3.0, rel=1e-14)
    assert injection_coefficient(2.0, 1.0, 0.3, 0.9, lam1, 1.0) == 0.0  # ratio 1: Z itself


def test_injection_errors():
    with pytest.raises(CurvlabError, match="zero"):
        injection_coefficient(0.0, 0.0, 0.0, 0.0, 5.0, 1.5)
    with pytest.raises(CurvlabError, match="<= 0"):
        injection_coefficient(-1.0, 1.0, 0.1, 0.5, 5.0, 1.5)
    with pytest.raises(CurvlabError, match="lambda_1"):
        injection_coefficient(3.0, 1.0, 0.1, 0.3, 4.0, 1.5)  # t = 4.5 > lambda_1
    with pytest.raises(CurvlabError, match="lambda_1"):
        injection_coefficient(3.0, 1.0, 0.1, 0.3, 4.5, 1.5)  # t = lambda_1: only reached at c = ∞
    with pytest.raises(CurvlabError, match=">= 1"):
        injection_coefficient(3.0, 1.0, 0.1, 0.3, 10.0, 0.5)
    with pytest.raises(CurvlabError, match="non-finite"):
        injection_coefficient(float("nan"), 1.0, 0.1, 0.3, 10.0, 1.5)
    with pytest.raises(CurvlabError, match="zero"):
        injected_nds(1.0, 1.0, -1.0, 0.5, 3.0, 1.0)  # Z = -v1, c = 1: Z' = 0
    q = kronecker_quadratic()
    params = {"Y": torch.zeros_like(q.G)}
    v1 = {"Y": torch.zeros_like(q.G)}
    v1["Y"][0, 0] = 1.0
    with pytest.raises(CurvlabError, match="zero"):
        injection_scalars(q.loss_fn, params, None, {"Y": torch.zeros_like(q.G)}, v1)
    with pytest.raises(CurvlabError, match="unit"):
        injection_scalars(q.loss_fn, params, None, {"Y": torch.ones_like(q.G)}, {"Y": 2 * v1["Y"]})
    with pytest.raises(CurvlabError, match="does not match"):
        inject({"Y": q.G}, {"X": q.G}, 1.0)
    assert inject({"Y": q.G.float()}, {"Y": q.G}, 1.0)["Y"].dtype == torch.float32
    assert isinstance(InjectionScalars(1.0, 2.0, 0.0, 0.0, 3.0).to_dict()["vhv"], float)


# -- Muon's preconditioner ------------------------------------------------------------------------------------


def reference_inverse(B, s, polar):
    """P^{-1} on the short side, independently of the SVD: ``"svd"`` by eigh of the Gram matrix,
    ``"newton_schulz"`` by running the matrix iteration X <- (aI + bXXᵀ + c(XXᵀ)²) X and multiplying
    its factors (X_final = L B, L a polynomial in BBᵀ)."""
    X = B.numpy() if B.shape[0] <= B.shape[1] else B.numpy().T
    if polar == "svd":
        mu, Q = np.linalg.eigh(X @ X.T)
        return s * (Q / np.sqrt(mu)) @ Q.T
    norm = max(np.linalg.norm(X), 1e-7)
    L, X = np.eye(X.shape[0]) / norm, X / norm
    a, b, c = NEWTON_SCHULZ_COEFFICIENTS
    for _ in range(5):
        G = X @ X.T
        Fk = a * np.eye(len(G)) + b * G + c * G @ G
        X, L = Fk @ X, Fk @ L
    return s * (L + L.T) / 2


def sqrtm_psd(M):
    w, Q = np.linalg.eigh(M)
    return (Q * np.sqrt(np.clip(w, 0, None))) @ Q.T


@pytest.mark.parametrize("polar", ["svd", "newton_schulz", "polar_express"])
@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (4, 4), (2, 3, 2)])
def test_the_frozen_preconditioner_maps_the_momentum_to_the_step(polar, shape):
    B = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    f = muon_factor(B, 1.7, polar)
    flat = B.reshape(shape[0], -1)
    expected = 1.7 * msign(flat, polar=polar, dtype=torch.float64)
    torch.testing.assert_close(f.apply(B).reshape(flat.shape), expected, rtol=0, atol=1e-12)
    assert f.side == ("left" if flat.shape[0] <= flat.shape[1] else "right")
    M = f.matrix()
    torch.testing.assert_close(M, M.T, rtol=0, atol=1e-14)
    assert bool((f.gains > 0).all())
    torch.testing.assert_close(f.matrix(0.5) @ f.matrix(0.5), M, rtol=0, atol=1e-12)
    if polar != "polar_express":
        np.testing.assert_allclose(M.numpy(), reference_inverse(flat, 1.7, polar), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("polar", ["svd", "newton_schulz", "polar_express"])
def test_a_stack_of_matrices_has_one_preconditioner_per_matrix(polar):
    # an MoE's fused experts (experts x out x in): block-diagonal, each block its own matrix's factor
    g = torch.Generator().manual_seed(3)
    B = torch.randn(3, 4, 6, generator=g, dtype=torch.float64)
    B[1] *= 50.0  # (each matrix normalized by its own norm, not the stack's)
    stack = muon_factor(B, 1.3, polar, stacked=True)
    each = [muon_factor(B[e], 1.3, polar) for e in range(3)]
    X = torch.randn(2, 3, 4, 6, generator=g, dtype=torch.float64)
    expected = torch.stack([each[e].apply(X[:, e]) for e in range(3)], dim=1)
    torch.testing.assert_close(stack.apply(X), expected, rtol=0, atol=1e-12)
    for power in (1.0, 0.5):
        torch.testing.assert_close(
            stack.matrix(power), torch.stack([f.matrix(power) for f in each]), rtol=0, atol=1e-13
        )
    steps = torch.stack([msign(B[e], polar=polar, dtype=torch.float64) for e in range(3)])
    torch.testing.assert_close(stack.apply(B), 1.3 * steps, rtol=0, atol=1e-12)
    # in the preconditioned operator (here of H = I, so P^-1), the stack is its matrices side by side
    identity = Operator(B.numel(), lambda V: V, device=B.device, dtype=B.dtype)
    V = torch.randn(B.numel(), 2, generator=g, dtype=torch.float64)
    joint = muon_preconditioned_operator(identity, {"experts": stack}) @ V
    apart = muon_preconditioned_operator(identity, {f"expert{e}": f for e, f in enumerate(each)}) @ V
    torch.testing.assert_close(joint, apart, rtol=0, atol=1e-12)
    shaped = muon_preconditioner({"experts": B}, "original", shapes={"experts": (3, 4, 6)}, polar=polar)["experts"]
    assert shaped.stacked and shaped.scale == muon_scale((4, 6), "original")
    with pytest.raises(CurvlabError, match="a stack of matrices is 3-D"):
        muon_factor(B[0], 1.0, polar, stacked=True)


def test_tiny_singular_values_are_not_inverted():
    g = torch.Generator().manual_seed(2)
    U, _ = torch.linalg.qr(torch.randn(4, 4, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(6, 4, generator=g, dtype=torch.float64))
    B = (U * torch.tensor([3.0, 1.0, 1e-20, 0.0], dtype=torch.float64)) @ V.T  # rank 2
    exact = muon_factor(B, 1.0, "svd")
    assert exact.gains.sort().values[:2].tolist() == [0.0, 0.0]  # a pseudo-inverse: msign's rank floor
    torch.testing.assert_close(exact.apply(B), msign(B, polar="svd"), rtol=0, atol=1e-13)
    ns = muon_factor(B, 1.0, "newton_schulz")
    # Newton–Schulz amplifies a vanishing singular value by the product of its linear coefficients, / ||B||_F
    limit = NEWTON_SCHULZ_COEFFICIENTS[0] ** 5 / math.sqrt(10.0)
    assert sorted(ns.gains.tolist())[-1] == pytest.approx(limit, rel=1e-12)
    torch.testing.assert_close(ns.apply(B), msign(B, polar="newton_schulz", dtype=torch.float64), rtol=0, atol=1e-12)


@pytest.mark.parametrize("polar", ["svd", "newton_schulz"])
def test_a_real_muon_step_is_the_frozen_preconditioner_on_the_nesterov_momentum(polar):
    g = torch.Generator().manual_seed(4)
    W = [torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_() for s in [(3, 5), (6, 2)]]
    opt = Muon(W, lr=0.05, momentum=0.9, polar=polar, polar_dtype=torch.float64)
    for step in range(3):
        grads = [torch.randn(w.shape, generator=g, dtype=torch.float64) for w in W]
        buffers = {str(i): opt.state[w]["momentum_buffer"].clone() if step else None for i, w in enumerate(W)}
        momenta = nesterov_momenta(buffers, {str(i): gr for i, gr in enumerate(grads)}, 0.9)
        factors = muon_preconditioner(momenta, "original", polar=polar)
        before = [w.detach().clone() for w in W]
        for w, gr in zip(W, grads):
            w.grad = gr
        opt.step()
        for i, w in enumerate(W):
            predicted = -0.05 * factors[str(i)].apply(momenta[str(i)])
            torch.testing.assert_close(w.detach() - before[i], predicted, rtol=0, atol=1e-13)
            # (the momentum by hand: b <- 0.9 b + 0.1 g, then 0.1 g + 0.9 b)
            b = 0.1 * grads[i] + (0.9 * buffers[str(i)] if step else 0)
            torch.testing.assert_close(momenta[str(i)], 0.1 * grads[i] + 0.9 * b, rtol=0, atol=1e-14)
    assert factors["1"].scale == muon_scale((6, 2), "original") == math.sqrt(3)


def dense_muon_sharpness(H, params, momenta, polar, shapes=None):
    """lambda_max(P^{-1/2} H_hh P^{-1/2}) from the dense Hessian, P^{-1/2} block diagonal from
    :func:`reference_inverse` (Kronecker products in row-major order)."""
    offsets, at = {}, 0
    for n, p in params.items():
        offsets[n], at = at, at + p.numel()
    idx = torch.cat([torch.arange(offsets[n], offsets[n] + params[n].numel()) for n in momenta])
    blocks = []
    for n, B in momenta.items():
        r, c = B.shape
        s = muon_scale(shapes[n] if shapes else (r, c), "original")
        R = torch.as_tensor(sqrtm_psd(reference_inverse(B, s, polar)))
        blocks.append(
            torch.kron(R, torch.eye(c, dtype=R.dtype)) if r <= c else torch.kron(torch.eye(r, dtype=R.dtype), R)
        )
    root = torch.block_diag(*blocks)
    return float(torch.linalg.eigvalsh(root @ H[idx][:, idx] @ root)[-1])


@pytest.mark.heavy
@pytest.mark.parametrize("polar", ["svd", "newton_schulz"])
def test_muon_preconditioned_sharpness_against_a_dense_eigendecomposition(polar):
    model, loss_fn, batch = tiny_gpt()
    params = detached(model)
    hidden = hidden_matrices(params, model=model)
    assert {tuple(params[n].shape) for n in hidden} == {(4, 4), (16, 4), (4, 16)}  # square, tall and wide
    g = torch.Generator().manual_seed(5)
    momenta = {n: torch.randn(params[n].shape, generator=g, dtype=torch.float64) for n in hidden}
    H = dense_hessian(loss_fn, params, batch)
    dense = dense_muon_sharpness(H, params, momenta, polar)
    dim = sum(params[n].numel() for n in hidden)
    top = muon_preconditioned_sharpness(loss_fn, params, batch, momenta, polar=polar, max_iter=dim, tol=1e-10)
    assert top.converged and top.eigenvalues[0] == pytest.approx(dense, rel=1e-8)
    assert top.eigenvectors.dtype == torch.float64 and top.eigenvectors.shape == (dim, 1)
    # the operator is symmetric: <x, A y> = <A x, y>
    op = muon_preconditioned_operator(
        hessian_operator(loss_fn, params, batch, scope=hidden), muon_preconditioner(momenta, polar=polar)
    )
    X = torch.randn(dim, 2, generator=g, dtype=torch.float64)
    AX = op @ X
    assert float(X[:, 0] @ AX[:, 1]) == pytest.approx(float(X[:, 1] @ AX[:, 0]), rel=1e-10)


def train(model, opt, batch, steps=2):
    x, y = batch
    for _ in range(steps):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.heavy
def test_stability_point_of_a_muon_state_against_dense_references():
    model, loss_fn, batch = tiny_gpt(seed=1)
    opt = build_model_optimizer("muon", model, lr=0.02, momentum=0.95)
    train(model, opt, batch)
    params = detached(model)
    H = dense_hessian(loss_fn, params, batch)
    G = param_dicts.unflatten(dense_gradient(loss_fn, params, batch), params)
    table = dict(model.named_parameters())
    hidden = hidden_matrices(params, model=model)
    momenta = {}
    for n in hidden:  # the next step's momentum by hand
        b = 0.95 * opt.state[table[n]]["momentum_buffer"] + 0.05 * G[n]
        momenta[n] = 0.05 * G[n] + 0.95 * b
    dense = dense_muon_sharpness(H, params, momenta, "newton_schulz")
    point = stability_point(loss_fn, params, batch, model, opt, G, max_iter=H.shape[0], tol=1e-10)
    assert isinstance(point, StabilityPoint) and point.arm == "muon" and point.lr == 0.02
    lam, V = torch.linalg.eigh(H)
    assert point.lambda_max == pytest.approx(float(lam[-1]), rel=1e-9)
    assert abs(float(point.eigenvector @ V[:, -1])) == pytest.approx(1.0, abs=1e-8)
    assert point.preconditioned_sharpness == pytest.approx(dense, rel=1e-8)
    assert point.lambda_converged and point.preconditioned_converged and point.bias_correction is None
    assert 0 < point.preconditioned_residual <= 1e-8 * dense
    assert point.edge_of_stability == pytest.approx(2 * 1.95 / (0.05 * 2.9 * 0.02), rel=1e-14)
    assert point.two_over_lr == pytest.approx(100.0)
    d = json.loads(json.dumps(point.to_dict()))
    assert "eigenvector" not in d and d["preconditioned_sharpness"] == point.preconditioned_sharpness
    # the gradient computed at the point gives the same
    again = stability_point(loss_fn, params, batch, model, opt, max_iter=H.shape[0], tol=1e-10)
    assert again.preconditioned_sharpness == pytest.approx(point.preconditioned_sharpness, rel=1e-9)
    # and muon_sharpness on a given operator, as the analysis pipeline calls it
    op = hessian_operator(loss_fn, params, batch)
    sharp, edge, lr, residual, converged = muon_sharpness(
        op, model, opt, hidden, list(params), G, max_iter=400, tol=1e-10
    )
    assert sharp == pytest.approx(dense, rel=1e-8) and edge == point.edge_of_stability and lr == 0.02
    assert converged and residual <= 1e-8 * dense
    short = muon_sharpness(op, model, opt, hidden, list(params), G, max_iter=3, tol=1e-10)
    assert not short.converged and short.residual > 1e-6 * dense


@pytest.mark.heavy
def test_stability_point_of_an_adam_state_against_dense_references():
    model, loss_fn, batch = tiny_gpt(seed=2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.004, betas=(0.9, 0.95), eps=1e-8)
    train(model, opt, batch, steps=3)
    params = detached(model)
    H = dense_hessian(loss_fn, params, batch)
    table = dict(model.named_parameters())
    diag = torch.cat([(opt.state[table[n]]["exp_avg_sq"] / (1 - 0.95**3)).sqrt().reshape(-1) + 1e-8 for n in params])
    diag = (1 - 0.9**3) * diag  # (the first moment's bias correction, in P by default)
    dense = float(torch.linalg.eigvalsh(diag.rsqrt()[:, None] * H * diag.rsqrt()[None, :])[-1])
    point = stability_point(loss_fn, params, batch, model, opt, max_iter=H.shape[0], tol=1e-10, smallest=True)
    assert point.arm == "adam" and point.lr == 0.004 and point.bias_correction is True
    lam = torch.linalg.eigvalsh(H)
    assert point.lambda_max == pytest.approx(float(lam[-1]), rel=1e-9)
    # lambda_min beside it (negative here: the curvature lambda_max never shows), to the spectrum's scale
    assert float(lam[0]) < 0 and point.lambda_min_converged
    assert point.lambda_min == pytest.approx(float(lam[0]), abs=1e-9 * float(lam.abs().max()))
    assert 0 <= point.lambda_min_residual <= 1e-8 * float(lam.abs().max())
    assert stability_point(loss_fn, params, batch, model, opt, max_iter=5).lambda_min is None  # (not asked for)
    assert point.preconditioned_sharpness == pytest.approx(dense, rel=1e-8)
    # torch's AdamW decouples its default weight decay 0.01: the threshold is 38/η - 19γ (stability_point's docstring)
    assert point.weight_decay == 0.01 and point.edge_of_stability == pytest.approx(38 / 0.004 - 19 * 0.01, rel=1e-14)
    # a float32 point, cut short: its eigenvector is unit to float32 rounding all the same (the closed form
    # of the injected direction assumes ||v1|| = 1)
    short = stability_point(loss_fn, params, batch, model, opt, max_iter=4, tol=1e-3, dtype=torch.float32)
    assert short.eigenvector.dtype == torch.float32
    assert float(torch.linalg.vector_norm(short.eigenvector.double())) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(CurvlabError, match="not in a Muon group"):
        muon_sharpness(
            hessian_operator(loss_fn, params, batch), model, opt, hidden_matrices(params, model=model), list(params),
            param_dicts.zeros_like(params),
        )  # fmt: skip


def test_muon_preconditioner_errors():
    B = torch.randn(3, 4, dtype=torch.float64)
    with pytest.raises(CurvlabError, match="zero"):
        muon_factor(torch.zeros(3, 4), 1.0)
    with pytest.raises(CurvlabError, match="unknown polar"):
        muon_factor(B, 1.0, "qr")
    with pytest.raises(CurvlabError, match="matrices"):
        muon_factor(torch.ones(3), 1.0)
    with pytest.raises(CurvlabError, match="non-finite"):
        muon_factor(torch.full((3, 4), float("nan")), 1.0)
    with pytest.raises(CurvlabError, match="no momentum"):
        muon_preconditioner({})
    with pytest.raises(CurvlabError, match="cover 12 entries, the operator 5"):
        muon_preconditioned_operator(
            Operator.from_matrix(torch.eye(5, dtype=torch.float64)), muon_preconditioner({"w": B})
        )
    with pytest.raises(CurvlabError, match="acts on shape"):
        muon_factor(B, 1.0).apply(torch.ones(4, 3, dtype=torch.float64))
    with pytest.raises(CurvlabError, match="shape"):
        nesterov_momenta({"w": torch.zeros(2, 2)}, {"w": B}, 0.9)
    model, loss_fn, batch = tiny_gpt()
    params = detached(model)
    with pytest.raises(CurvlabError, match="unknown parameters"):
        muon_preconditioned_sharpness(loss_fn, params, batch, {"nope": B})


# -- thresholds ----------------------------------------------------------------------------------------------


def spectral_radius(lam, lr, mu, nesterov):
    """The 1-D iteration as Muon codes it, its 2 x 2 matrix read off by stepping the basis states (x, b)."""

    def step(x, b):
        g = lam * x
        b = mu * b + (1 - mu) * g
        u = (1 - mu) * g + mu * b if nesterov else b
        return x - lr * u, b

    M = np.array([step(1.0, 0.0), step(0.0, 1.0)]).T
    return max(abs(np.linalg.eigvals(M)))


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("mu", [0.0, 0.5, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("lr", [0.02, 0.3])
def test_edges_of_stability_against_companion_spectral_radii(nesterov, mu, lr):
    edge = muon_edge_of_stability(lr, mu, nesterov=nesterov)
    assert (
        spectral_radius(edge * (1 - 1e-6), lr, mu, nesterov) < 1 < spectral_radius(edge * (1 + 1e-6), lr, mu, nesterov)
    )
    assert spectral_radius(edge, lr, mu, nesterov) == pytest.approx(1.0, abs=1e-9)
    assert all(spectral_radius(edge * f, lr, mu, nesterov) < 1 for f in np.linspace(0.01, 0.999, 60))
    if not nesterov:
        assert edge == adam_edge_of_stability(lr, mu)
    if mu == 0.0:
        assert edge == pytest.approx(2 / lr, rel=1e-15)


def test_edge_of_stability_errors():
    with pytest.raises(CurvlabError, match="learning rate"):
        muon_edge_of_stability(0.0, 0.95)
    with pytest.raises(CurvlabError, match="momentum"):
        muon_edge_of_stability(0.02, 1.0)
    with pytest.raises(CurvlabError, match="momentum"):
        nesterov_momenta({}, {}, -0.1)
