import json

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from curvlab import make_loss_fn
from curvlab.curvature.spectral import (
    eigsh_extremes,
    hutch_plus_plus,
    hutchinson,
    lanczos,
    overlap_with,
    spectral_density,
    vector_bytes,
)
from curvlab.engine.operator import Operator, hessian_operator, preconditioned_operator
from curvlab.optim.adam import adam_edge_of_stability, adam_preconditioner, adam_step_settings
from tests.reference import MLP, dense_hessian


def diagonal(values):
    return Operator.from_matrix(torch.diag(torch.as_tensor(values, dtype=torch.float64)))


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
    assert bool((top.residuals < 1e-7).all())
    bottom = lanczos(Operator.from_matrix(A), k=2, which="smallest", max_iter=120, tol=1e-10)
    np.testing.assert_allclose(bottom.eigenvalues, [-30, -7], rtol=1e-9)
    U = top.eigenvectors
    assert torch.allclose(U.T @ U, torch.eye(3, dtype=torch.float64), atol=1e-8)
    assert top.num_matvecs <= 120 + 3


def test_unconverged_results_say_so():
    A, _ = random_symmetric(200, spectrum=np.linspace(1.0, 1.1, 200))  # a flat spectrum: no gap
    result = lanczos(Operator.from_matrix(A), k=1, max_iter=5, tol=1e-12)
    assert not result.converged and result.residuals[0] > 1e-6
    # the residual is the true ||A u - θ u||, recomputed here from the dense matrix
    u, theta = result.eigenvectors[:, 0], float(result.eigenvalues[0])
    assert float(result.residuals[0]) == pytest.approx(float(torch.linalg.norm(A @ u - theta * u)), rel=1e-10)


def test_an_eigen_result_holds_torch_tensors_and_writes_plain_json():
    A, _ = random_symmetric(30, seed=5)
    for result in (lanczos(Operator.from_matrix(A.float()), k=2), eigsh_extremes(Operator.from_matrix(A.float()), k=2)):
        assert all(isinstance(t, torch.Tensor) for t in (result.eigenvalues, result.residuals, result.eigenvectors))
        assert result.eigenvalues.dtype == result.residuals.dtype == torch.float64  # host numbers, in float64
        assert result.eigenvalues.device == result.residuals.device == torch.device("cpu")
        assert result.eigenvectors.dtype == torch.float32 and result.eigenvectors.shape == (30, 2)
        d = json.loads(json.dumps(result.to_dict()))
        assert d["eigenvalues"] == result.eigenvalues.tolist() and d["residuals"] == result.residuals.tolist()
        assert "eigenvectors" not in d and all(isinstance(x, float) for x in d["eigenvalues"])


@pytest.mark.parametrize(
    ("algorithm", "vectors", "method"),
    [
        pytest.param("lanczos", None, "fwd_rev", marks=pytest.mark.heavy),
        ("lanczos", 8, "rev_rev"),
        pytest.param("eigsh", None, "fwd_rev", marks=pytest.mark.heavy),
    ],
)
def test_hessian_eigenvalues_match_dense_float64_through_layernorm(transformer_problem, algorithm, vectors, method):
    loss_fn, params, batch = transformer_problem
    H = dense_hessian(loss_fn, params, batch)
    exact = torch.linalg.eigvalsh(H).numpy()
    op = hessian_operator(loss_fn, params, batch, method=method)
    if algorithm == "lanczos":  # vectors: a memory budget of that many Lanczos vectors (thick restarts)
        memory = None if vectors is None else vectors * vector_bytes(op)
        top = lanczos(op, k=2, max_iter=300, tol=1e-10, memory=memory)
        bottom = lanczos(op, k=1, which="smallest", max_iter=300, tol=1e-10, memory=memory)
        assert (top.restarts > 0) == (vectors is not None) and top.basis_vectors <= (vectors or 300)
    else:
        top = eigsh_extremes(op, k=2, tol=1e-12)
        bottom = eigsh_extremes(op, k=1, which="smallest", tol=1e-12)
    assert top.converged and bottom.converged
    np.testing.assert_allclose(top.eigenvalues, exact[::-1][:2], rtol=1e-8)
    np.testing.assert_allclose(bottom.eigenvalues, exact[:1], rtol=1e-8)
    assert top.num_matvecs + bottom.num_matvecs == op.num_matvecs  # each result counts its own HVPs


def test_lanczos_under_a_memory_budget_converges_to_the_same_eigenpairs(monkeypatch):
    lam = np.concatenate([[50.0, 20.0, 10.0, 9.5], np.linspace(-1, 1, 300), [-7.0, -30.0]])
    A, _ = random_symmetric(len(lam), spectrum=lam)
    free = lanczos(Operator.from_matrix(A), k=4, max_iter=300, tol=1e-10)
    vb = vector_bytes(Operator.from_matrix(A))
    assert vb == len(lam) * 8
    for vectors in (6, 8, 12):
        op = Operator.from_matrix(A)
        bounded = lanczos(op, k=4, max_iter=300, tol=1e-10, memory=vectors * vb + vb // 2)
        assert bounded.converged and bounded.restarts > 0 and bounded.basis_vectors == vectors
        np.testing.assert_allclose(bounded.eigenvalues, [50, 20, 10, 9.5], rtol=1e-9)
        assert bool((bounded.residuals < 1e-7).all())
        U = bounded.eigenvectors
        assert torch.allclose(U.T @ U, torch.eye(4, dtype=torch.float64), atol=1e-8)
        assert (U.T @ free.eigenvectors).abs().diagonal().min() > 1 - 1e-8  # the same eigenvectors, up to sign
        assert free.num_matvecs <= bounded.num_matvecs <= 300 + 4
    smallest = lanczos(Operator.from_matrix(A), k=2, which="smallest", max_iter=300, tol=1e-10, memory=5 * vb)
    assert smallest.converged
    np.testing.assert_allclose(smallest.eigenvalues, [-30, -7], rtol=1e-9)
    # as a large model stores it: one vector per block, and restarts that rotate the basis in slabs
    monkeypatch.setattr("curvlab.curvature.spectral._Basis.CHUNK", 50)
    slabs = lanczos(Operator.from_matrix(A), k=2, which="smallest", max_iter=300, tol=1e-10, memory=5 * vb)
    np.testing.assert_allclose(slabs.eigenvalues, smallest.eigenvalues, rtol=1e-13)
    assert slabs.num_matvecs == smallest.num_matvecs and slabs.restarts == smallest.restarts > 0
    with pytest.raises(
        ValueError, match=r"memory budget of 3200 bytes holds 1 Lanczos vectors.*k = 4 needs at least 6"
    ):
        lanczos(Operator.from_matrix(A), k=4, memory=3200)
    with pytest.raises(ValueError, match="positive number of bytes"):
        spectral_density(Operator.from_matrix(A), memory=-1)


def test_lanczos_finds_a_repeated_eigenvalue_after_its_krylov_space_closes():
    # the Krylov space of diag(3, 3, 3, 1, 1) holds one direction per distinct eigenvalue: after two
    # steps it is invariant, and only a fresh start direction reveals the multiplicity
    result = lanczos(diagonal([3.0, 3.0, 3.0, 1.0, 1.0]), k=3, max_iter=20, tol=1e-12)
    assert result.converged
    np.testing.assert_allclose(result.eigenvalues, [3, 3, 3], rtol=1e-12)
    pair = lanczos(diagonal([1.0, 5.0, 5.0]), k=2, tol=1e-12)
    np.testing.assert_allclose(pair.eigenvalues, [5, 5], rtol=1e-12)
    assert torch.allclose(pair.eigenvectors[0], torch.zeros(2, dtype=torch.float64), atol=1e-12)


def test_block_operator_is_the_principal_submatrix(transformer_problem):
    loss_fn, params, batch = transformer_problem
    names = ["h.1.mlp_fc.weight", "h.1.mlp_fc.bias"]
    H = dense_hessian(loss_fn, params, batch)
    offsets = np.cumsum([0] + [t.numel() for t in params.values()])
    index = {n: i for i, n in enumerate(params)}
    rows = np.concatenate([np.arange(offsets[index[n]], offsets[index[n] + 1]) for n in names])
    sub = H[rows][:, rows]
    op = hessian_operator(loss_fn, params, batch, scope=names)
    x = torch.randn(op.dim, dtype=torch.float64)
    assert torch.allclose(op @ x, sub @ x, atol=1e-12)
    top = lanczos(op, k=1, max_iter=200, tol=1e-10)
    assert top.eigenvalues[0] == pytest.approx(float(torch.linalg.eigvalsh(sub)[-1]), rel=1e-8)
    with pytest.raises(ValueError, match="names no parameter"):
        hessian_operator(loss_fn, params, batch, scope=[])


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
    assert d.reorthogonalized and d.num_matvecs == 30 * 8
    assert np.trapezoid(d.density, d.grid) == pytest.approx(1.0, rel=1e-9)
    near1 = np.trapezoid(d.density * (np.abs(d.grid - 1) < 0.5), d.grid)
    near5 = np.trapezoid(d.density * (np.abs(d.grid - 5) < 0.5), d.grid)
    assert near1 + near5 > 0.98
    assert near1 / near5 == pytest.approx(3.0, rel=0.3)
    assert d.weights.sum() == pytest.approx(1.0, rel=1e-9)


def test_density_under_a_memory_budget_keeps_its_quadrature():
    """SLQ's budget: all runs at once, a few at a time (the same nodes), or no basis at all (ghost
    copies of the outliers appear, yet every moment of the quadrature stays that of the full run)."""
    lam = np.concatenate([np.full(150, 1.0), np.full(50, 5.0)]) + np.random.default_rng(0).normal(0, 0.01, 200)
    A, _ = random_symmetric(202, seed=2, spectrum=np.concatenate([lam, [30.0, 20.0]]))
    vb = vector_bytes(Operator.from_matrix(A))
    full, grouped, bare = (
        spectral_density(Operator.from_matrix(A), steps=30, vectors=8, sigma=0.1, memory=memory)
        for memory in (None, 3 * 30 * vb, 29 * vb)
    )
    assert full.reorthogonalized and grouped.reorthogonalized and not bare.reorthogonalized
    np.testing.assert_allclose(grouped.nodes, full.nodes, rtol=0, atol=1e-11)
    np.testing.assert_allclose(grouped.weights, full.weights, rtol=0, atol=1e-13)
    assert np.sum(np.abs(bare.nodes - 30) < 1e-8) > np.sum(np.abs(full.nodes - 30) < 1e-8)  # ghosts
    for p in range(12):
        moment = np.sum(full.weights * full.nodes**p)
        assert np.sum(bare.weights * bare.nodes**p) == pytest.approx(moment, rel=1e-12)
    assert bare.num_matvecs == grouped.num_matvecs == full.num_matvecs


def test_preconditioned_sharpness_matches_the_dense_matrix(mlp_problem):
    loss_fn, params, batch = mlp_problem
    H = dense_hessian(loss_fn, params, batch)
    p = torch.linspace(0.5, 2.0, H.shape[0], dtype=torch.float64)
    dense = torch.diag(p.rsqrt()) @ H @ torch.diag(p.rsqrt())
    op = preconditioned_operator(hessian_operator(loss_fn, params, batch), p)
    top = lanczos(op, k=1, max_iter=100, tol=1e-12)
    assert top.eigenvalues[0] == pytest.approx(float(torch.linalg.eigvalsh(dense)[-1]), rel=1e-8)
    with pytest.raises(ValueError, match="positive"):
        preconditioned_operator(hessian_operator(loss_fn, params, batch), -p)


def test_adam_preconditioner_from_a_real_optimizer():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        model(torch.randn(4, 3)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    P = adam_preconditioner(opt, model, ["weight", "bias"], bias_correction=False)
    v = opt.state[model.weight]["exp_avg_sq"].double()
    assert list(P) == ["weight", "bias"] and P["weight"].dtype == torch.float64
    assert torch.allclose(P["weight"], (v / (1 - 0.95**3)).sqrt() + 1e-8)
    corrected = adam_preconditioner(opt, model)  # (every parameter, with the first moment's 1 - beta1^t)
    assert torch.allclose(corrected["weight"], (1 - 0.9**3) * P["weight"], rtol=1e-14)
    with pytest.raises(ValueError, match="no Adam state"):
        adam_preconditioner(torch.optim.SGD(model.parameters(), lr=0.1), model, ["weight"])


def test_overlap_and_bad_k():
    U = torch.eye(4, dtype=torch.float64)[:, :2]
    assert overlap_with(U, torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="k = 5"):
        lanczos(diagonal([1.0, 2.0, 3.0, 4.0]), k=5)
    with pytest.raises(ValueError, match="eigsh needs"):
        eigsh_extremes(diagonal([1.0, 2.0]), k=2)


FACTORIES = {"randn", "rand", "randint", "randperm", "normal", "zeros", "ones", "empty", "empty_strided", "full",
             "eye", "arange", "linspace", "logspace", "tensor", "as_tensor", "scalar_tensor"}  # fmt: skip


class OnlyOn(TorchFunctionMode):
    """Fails the moment a tensor is made off the operator's device or dtype.

    On a CPU-only machine a tensor made without ``device=`` lands on the right device by luck, so every
    factory call must name the device; generators must live there; and every floating-point tensor
    that any torch function returns must be in ``dtype`` (so no random vector or result slips into
    another precision).
    """

    def __init__(self, device, dtype):
        super().__init__()
        self.device, self.dtype, self.made = torch.device(device), dtype, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in FACTORIES:
            where = kwargs.get("device")
            assert where is not None and torch.device(where) == self.device, f"torch.{name} made without device"
        g = kwargs.get("generator")
        assert g is None or g.device == self.device, f"torch.{name} drew from a generator on {g.device}"
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                assert t.dtype == self.dtype and t.device == self.device, f"torch.{name} gave {t.dtype} on {t.device}"
                if name in FACTORIES or name == "bernoulli_":
                    self.made.append((name, t.dtype))
        return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_spectral_path_keeps_the_operators_device_and_dtype(dtype):
    torch.manual_seed(0)
    model = MLP().to(dtype)
    batch = (torch.randn(9, 5, dtype=dtype), torch.randint(0, 3, (9,)))
    loss_fn = make_loss_fn(model, criterion=torch.nn.functional.cross_entropy)
    params = {k: v.detach() for k, v in model.named_parameters()}
    op = hessian_operator(loss_fn, params, batch)
    x, diag = torch.ones(op.dim, dtype=dtype), torch.linspace(1, 2, op.dim, dtype=dtype)
    with OnlyOn("cpu", dtype) as guard:
        results = [
            lanczos(op, k=2, max_iter=30),
            lanczos(op, k=2, max_iter=30, memory=5 * vector_bytes(op), basis_device="cpu"),
            eigsh_extremes(op, k=1, tol=1e-4),
            lanczos(preconditioned_operator(op, diag), k=1, max_iter=10),
        ]
        traces = [hutchinson(op, samples=4, batch=2), hutch_plus_plus(op, samples=6)]
        densities = [spectral_density(op, steps=6, vectors=2), spectral_density(op, steps=6, vectors=2, memory=1)]
        overlap = overlap_with(results[0].eigenvectors, x)
        hv = op @ x
    assert {"randn", "bernoulli_", "as_tensor"} <= {name for name, _ in guard.made}
    assert {t for _, t in guard.made} == {dtype}  # random vectors included
    assert all(r.eigenvectors.dtype == dtype and r.eigenvectors.device == op.device for r in results)
    # the eigenvalues and residuals are the host's float64 numbers of the small tridiagonal problem (wrapped by
    # torch.from_numpy, which the guard does not see), whatever the operator's dtype
    assert all(r.eigenvalues.dtype == r.residuals.dtype == torch.float64 for r in results)
    assert hv.dtype == dtype and 0 <= overlap <= 1 + 1e-6
    assert all(np.isfinite(t.trace) for t in traces) and all(np.isfinite(d.density).all() for d in densities)
    assert op.dtype == dtype and op.device == torch.device("cpu")


def test_the_guard_catches_a_tensor_made_without_device():
    with OnlyOn("cpu", torch.float64), pytest.raises(AssertionError, match="without device"):
        torch.zeros(3, dtype=torch.float64)
    with OnlyOn("cpu", torch.float64), pytest.raises(AssertionError, match="float32"):
        torch.ones(3, device="cpu")


def test_the_method_reaches_the_engine():
    """A function with a backward but no forward-mode rule: double backward works, jvp of grad can't."""

    class Sin(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return x.sin()

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x.cos()

    w, b = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64), torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)

    def loss_fn(p, batch):
        return Sin.apply(p["w"] * batch).sum()

    op = hessian_operator(loss_fn, {"w": w}, b, method="rev_rev")
    assert torch.allclose(op @ torch.eye(3, dtype=torch.float64), torch.diag(-(w * b).sin() * b**2), atol=1e-14)
    top = lanczos(op, k=1, tol=1e-12)
    assert top.eigenvalues[0] == pytest.approx(float((-(w * b).sin() * b**2).max()), rel=1e-10)
    with pytest.raises(NotImplementedError, match="jvp"):
        hessian_operator(loss_fn, {"w": w}, b, method="fwd_rev") @ w
    with pytest.raises(ValueError, match="unknown HVP method 'magic'"):
        hessian_operator(loss_fn, {"w": w}, b, method="magic")


def test_operator_products_shapes_and_scipy():
    A, _ = random_symmetric(7, seed=4)
    op = Operator.from_matrix(A)
    X = torch.randn(7, 3, dtype=torch.float64)
    assert torch.equal(op @ X, A @ X) and torch.equal(op @ X[:, 0], A @ X[:, 0])
    assert op.matmat(X.float()).dtype == torch.float64  # inputs are moved to the operator's dtype
    assert op.num_matvecs == 3 + 1 + 3 and op.shape == (7, 7)
    lin = op.to_scipy()
    assert lin.shape == (7, 7) and lin.dtype == np.float64
    np.testing.assert_allclose(lin @ X.numpy(), (A @ X).numpy(), rtol=1e-14)
    np.testing.assert_allclose(lin.T @ X[:, 0].numpy(), (A @ X[:, 0]).numpy(), rtol=1e-14)
    assert Operator.from_matrix(A.float()).to_scipy().dtype == np.float32
    with pytest.raises(ValueError, match=r"takes \(7, K\) columns"):
        op @ torch.ones(6, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="square matrix"):
        Operator.from_matrix(torch.ones(2, 3))


def heavy_ball_grows(curvature, lr, beta1, steps=400):
    """Adam's update with a frozen preconditioner on a 1-D quadratic of curvature λ (in P's metric):
    m ← β1 m + (1 − β1) λ x, x ← x − η m. Does |x| grow?"""
    x, m = 1.0, 0.0
    for _ in range(steps):
        m = beta1 * m + (1 - beta1) * curvature * x
        x = x - lr * m
    return abs(x) > 1.0


@pytest.mark.parametrize("beta1", [0.0, 0.5, 0.9, 0.95])
def test_adam_edge_of_stability_is_where_its_momentum_diverges(beta1):
    lr = 1e-3
    edge = adam_edge_of_stability(lr, beta1)
    assert not heavy_ball_grows(0.99 * edge, lr, beta1) and heavy_ball_grows(1.01 * edge, lr, beta1)
    if beta1 == 0.9:
        assert edge == pytest.approx(38 / lr, rel=1e-12)
    with pytest.raises(ValueError, match="beta1"):
        adam_edge_of_stability(lr, 1.0)


def test_adam_step_settings_need_one_beta1_and_give_the_largest_lr():
    """Groups may differ in lr when the caller says it scales their P to the largest (curvlab.optim.adam), never
    in beta1."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    assert adam_step_settings(opt) == (0.01, 0.8)
    two = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "lr": 0.1}], lr=0.01)
    with pytest.raises(ValueError, match="2 learning rates: pass mixed_lrs=True"):
        adam_step_settings(two)
    assert adam_step_settings(two, mixed_lrs=True) == (0.1, 0.9)
    betas = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "betas": (0.5, 0.9)}], lr=0.01)
    with pytest.raises(ValueError, match="one Adam beta1, found 2"):
        adam_step_settings(betas)
    with pytest.raises(ValueError, match="found 0"):
        adam_step_settings(torch.optim.SGD(model.parameters(), lr=0.1))
