import numpy as np
import pytest
import torch

from curvlab.spectral import (
    Operator,
    adam_preconditioner,
    eigsh_extremes,
    hessian_operator_flat,
    hutch_plus_plus,
    hutchinson,
    lanczos,
    overlap_with,
    preconditioned_operator,
    spectral_density,
)
from tests.reference import dense_hessian


def diagonal(values):
    d = torch.as_tensor(values, dtype=torch.float64)
    return Operator(len(d), lambda x: d * x, torch.float64, lambda X: d[:, None] * X)


def random_symmetric(n, seed=0, spectrum=None):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    lam = (
        torch.as_tensor(spectrum, dtype=torch.float64)
        if spectrum is not None
        else torch.randn(n, generator=g, dtype=torch.float64)
    )
    return Q @ torch.diag(lam) @ Q.T, lam


def test_lanczos_on_a_known_spectrum():
    lam = np.concatenate([[50.0, 20.0, 10.0], np.linspace(-1, 1, 300), [-7.0, -30.0]])
    A, _ = random_symmetric(len(lam), spectrum=lam)
    top = lanczos(Operator.from_matrix(A), k=3, which="largest", max_iter=120, tol=1e-10)
    assert top.converged
    np.testing.assert_allclose(top.eigenvalues, [50, 20, 10], rtol=1e-9)
    assert np.all(top.residuals < 1e-7)
    bottom = lanczos(Operator.from_matrix(A), k=2, which="smallest", max_iter=120, tol=1e-10)
    np.testing.assert_allclose(bottom.eigenvalues, [-30, -7], rtol=1e-9)
    U = top.eigenvectors
    assert torch.allclose(U.T @ U, torch.eye(3, dtype=torch.float64), atol=1e-8)
    assert top.num_matvecs <= 120 + 3


def test_unconverged_results_say_so():
    A, _ = random_symmetric(200, spectrum=np.linspace(1.0, 1.1, 200))  # a flat spectrum: no gap
    result = lanczos(Operator.from_matrix(A), k=1, max_iter=5, tol=1e-12)
    assert not result.converged and result.residuals[0] > 1e-6


@pytest.mark.parametrize("method", ["lanczos", "eigsh"])
def test_hessian_eigenvalues_match_dense_float64_through_layernorm(transformer_problem, method):
    loss_fn, params, batch = transformer_problem
    H = dense_hessian(loss_fn, params, batch)
    exact = torch.linalg.eigvalsh(H).numpy()
    op = hessian_operator_flat(loss_fn, params, batch)
    if method == "lanczos":
        top = lanczos(op, k=2, max_iter=300, tol=1e-10)
        bottom = lanczos(hessian_operator_flat(loss_fn, params, batch), k=1, which="smallest", max_iter=300, tol=1e-10)
    else:
        top = eigsh_extremes(op, k=2, tol=1e-12)
        bottom = eigsh_extremes(hessian_operator_flat(loss_fn, params, batch), k=1, which="smallest", tol=1e-12)
    assert top.converged and bottom.converged
    np.testing.assert_allclose(top.eigenvalues, exact[::-1][:2], rtol=1e-8)
    np.testing.assert_allclose(bottom.eigenvalues, exact[:1], rtol=1e-8)


def test_block_operator_is_the_principal_submatrix(transformer_problem):
    loss_fn, params, batch = transformer_problem
    names = ["h.1.mlp_fc.weight", "h.1.mlp_fc.bias"]
    H = dense_hessian(loss_fn, params, batch)
    offsets = np.cumsum([0] + [t.numel() for t in params.values()])
    index = {n: i for i, n in enumerate(params)}
    rows = np.concatenate([np.arange(offsets[index[n]], offsets[index[n] + 1]) for n in names])
    sub = H[rows][:, rows]
    op = hessian_operator_flat(loss_fn, params, batch, subset=names)
    x = torch.randn(op.dim, dtype=torch.float64)
    assert torch.allclose(op.matvec(x), sub @ x, atol=1e-12)
    top = lanczos(op, k=1, max_iter=200, tol=1e-10)
    assert top.eigenvalues[0] == pytest.approx(float(torch.linalg.eigvalsh(sub)[-1]), rel=1e-8)
    with pytest.raises(ValueError, match="names no parameter"):
        hessian_operator_flat(loss_fn, params, batch, subset=[])


def test_hutchinson_standard_error_covers_the_truth():
    A, lam = random_symmetric(60, seed=3)
    truth = float(lam.sum())
    covered = 0
    seeds = 200
    for seed in range(seeds):
        est = hutchinson(Operator.from_matrix(A), samples=30, batch=10, seed=seed)
        covered += abs(est.trace - truth) <= 2 * est.std_error
    assert 0.88 <= covered / seeds <= 0.99  # about 95% at two standard errors


def test_hutch_plus_plus_beats_hutchinson_on_a_low_rank_operator():
    lam = np.concatenate([np.linspace(50, 10, 8), 0.01 * np.ones(192)])
    A, _ = random_symmetric(200, seed=1, spectrum=lam)
    truth = lam.sum()
    errors = {"h": [], "h++": []}
    for seed in range(20):
        errors["h"].append(abs(hutchinson(Operator.from_matrix(A), samples=30, seed=seed).trace - truth))
        errors["h++"].append(abs(hutch_plus_plus(Operator.from_matrix(A), samples=30, seed=seed).trace - truth))
    assert np.mean(errors["h++"]) < 0.2 * np.mean(errors["h"])
    est = hutch_plus_plus(diagonal(np.arange(1.0, 11.0)), samples=30)
    assert est.trace == pytest.approx(55.0, rel=1e-10)  # rank <= m: exact


def test_density_integrates_to_one_and_sits_on_the_spectrum():
    lam = np.concatenate([np.full(150, 1.0), np.full(50, 5.0)]) + np.random.default_rng(0).normal(0, 0.01, 200)
    A, _ = random_symmetric(200, seed=2, spectrum=lam)
    d = spectral_density(Operator.from_matrix(A), steps=30, vectors=8, sigma=0.1)
    assert np.trapezoid(d.density, d.grid) == pytest.approx(1.0, rel=1e-9)
    near1 = np.trapezoid(d.density * (np.abs(d.grid - 1) < 0.5), d.grid)
    near5 = np.trapezoid(d.density * (np.abs(d.grid - 5) < 0.5), d.grid)
    assert near1 + near5 > 0.98
    assert near1 / near5 == pytest.approx(3.0, rel=0.3)
    assert d.weights.sum() == pytest.approx(1.0, rel=1e-9)


def test_preconditioned_sharpness_matches_the_dense_matrix(mlp_problem):
    loss_fn, params, batch = mlp_problem
    H = dense_hessian(loss_fn, params, batch)
    p = torch.linspace(0.5, 2.0, H.shape[0], dtype=torch.float64)
    dense = torch.diag(p.rsqrt()) @ H @ torch.diag(p.rsqrt())
    op = preconditioned_operator(hessian_operator_flat(loss_fn, params, batch), p)
    top = lanczos(op, k=1, max_iter=100, tol=1e-12)
    assert top.eigenvalues[0] == pytest.approx(float(torch.linalg.eigvalsh(dense)[-1]), rel=1e-8)
    with pytest.raises(ValueError, match="positive"):
        preconditioned_operator(hessian_operator_flat(loss_fn, params, batch), -p)


def test_adam_preconditioner_from_a_real_optimizer():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        model(torch.randn(4, 3)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    P = adam_preconditioner(opt, model, ["weight", "bias"])
    v = opt.state[model.weight]["exp_avg_sq"].reshape(-1).double()
    assert torch.allclose(P[:6], (v / (1 - 0.95**3)).sqrt() + 1e-8)
    with pytest.raises(ValueError, match="no Adam state"):
        adam_preconditioner(torch.optim.SGD(model.parameters(), lr=0.1), model, ["weight"])


def test_overlap_and_bad_k():
    U = torch.eye(4, dtype=torch.float64)[:, :2]
    assert overlap_with(U, torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="k = 5"):
        lanczos(diagonal([1.0, 2.0, 3.0, 4.0]), k=5)
    with pytest.raises(ValueError, match="eigsh needs"):
        eigsh_extremes(diagonal([1.0, 2.0]), k=2)
