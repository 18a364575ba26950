r"""The curvature landscape beyond one direction: extreme eigenvalues, trace, spectral density, and
Adam's preconditioned sharpness, exact through :mod:`curvlab.hvp` on any model.

Every estimator takes a symmetric :class:`Operator` (a matvec on flat vectors), so it works on the
Hessian, a block of it, a preconditioned Hessian, or any symmetric matrix (the tests use diagonal and
low-rank ones with known spectra). :func:`hessian_operator_flat` makes the Hessian one:
``matmat`` batches columns through one vectorized HVP call, which shares the primal forward and
backward pass between the columns (what is reused when several HVPs are taken at one point).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from curvlab import params as P
from curvlab.errors import CurvlabError
from curvlab.hvp import flat_hvp, working_dtype
from curvlab.loss import LossFn


class Operator:
    """A symmetric linear operator on flat vectors of length ``dim``; counts its products in ``num_matvecs``."""

    def __init__(
        self,
        dim: int,
        matvec: Callable[[Tensor], Tensor],
        dtype: torch.dtype = torch.float64,
        matmat: Callable[[Tensor], Tensor] | None = None,
    ):
        if dim < 1:
            raise CurvlabError("the operator has no dimensions (an empty block?)")
        self.dim, self.dtype, self._matvec, self._matmat = dim, dtype, matvec, matmat
        self.num_matvecs = 0

    def matvec(self, x: Tensor) -> Tensor:
        self.num_matvecs += 1
        return self._matvec(x)

    def matmat(self, X: Tensor) -> Tensor:
        """Columns of X at once (one vectorized call when the operator has one)."""
        self.num_matvecs += X.shape[1]
        if self._matmat is not None:
            return self._matmat(X)
        return torch.stack([self._matvec(x) for x in X.T], dim=1)

    @classmethod
    def from_matrix(cls, A: Tensor) -> Operator:
        return cls(A.shape[0], lambda x: A @ x, A.dtype, lambda X: A @ X)


def hessian_operator_flat(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    subset: Sequence[str] | None = None,
    dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
) -> Operator:
    """The Hessian (or its principal block over ``subset``) as an :class:`Operator` on flat vectors in
    the order of ``subset`` (default: all parameters in ``params`` order)."""
    dt = working_dtype(params, dtype)
    p = P.cast(params, dt)
    matmat, dim = flat_hvp(loss_fn, p, batch, list(p) if subset is None else list(subset), dt, chunk_size)
    return Operator(dim, lambda x: matmat(x[:, None])[:, 0], dt, matmat)


# -- Lanczos ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EigenResult:
    """Extreme eigenpairs. ``eigenvectors`` is ``(dim, k)`` (columns, flat), ``residuals`` the true
    ``||A u - θ u||`` of each pair, ``converged`` whether every residual is within tolerance."""

    eigenvalues: np.ndarray
    eigenvectors: Tensor
    residuals: np.ndarray
    num_matvecs: int
    iterations: int
    converged: bool
    method: str
    which: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "eigenvalues": self.eigenvalues.tolist(),
            "residuals": self.residuals.tolist(),
            "num_matvecs": self.num_matvecs,
            "iterations": self.iterations,
            "converged": self.converged,
            "method": self.method,
            "which": self.which,
        }


def _lanczos(op: Operator, steps: int, v0: Tensor, stop: Callable[[np.ndarray, np.ndarray, float], bool] | None = None):
    """Lanczos with full reorthogonalization: basis Q (kept, as Ritz vectors and reorthogonalization
    need it, and no longer than the iterations taken), tridiagonal (alpha, beta)."""
    q = v0 / v0.norm()
    basis, alpha, beta = [q], [], []
    for j in range(steps):
        w = op.matvec(basis[-1])
        a = float(w @ basis[-1])
        alpha.append(a)
        Q = torch.stack(basis, dim=1)
        w = w - Q @ (Q.T @ w)
        w = w - Q @ (Q.T @ w)  # twice is enough (Kahan–Parlett)
        b = float(w.norm())
        if j == steps - 1 or b < 1e-12 * max(1.0, abs(a)):
            break
        beta.append(b)
        if stop is not None and j >= 2 and j % 2 == 0:
            theta, S = _tridiagonal_eigh(alpha, beta[:-1])
            if stop(theta, S, b):
                break
        basis.append(w / b)
    beta = beta[: len(alpha) - 1]
    return torch.stack(basis[: len(alpha)], dim=1), np.array(alpha), np.array(beta)


def _tridiagonal_eigh(alpha, beta) -> tuple[np.ndarray, np.ndarray]:
    T = np.diag(alpha) + np.diag(beta, 1) + np.diag(beta, -1)
    return np.linalg.eigh(T)


def _pick(theta: np.ndarray, k: int, which: str) -> np.ndarray:
    order = np.argsort(theta)
    return order[::-1][:k] if which == "largest" else order[:k]


def lanczos(
    op: Operator,
    k: int = 1,
    which: str = "largest",
    max_iter: int = 100,
    tol: float = 1e-6,
    seed: int = 0,
) -> EigenResult:
    r"""The k largest (or smallest) eigenpairs by Lanczos with full reorthogonalization.

    Stops when every wanted Ritz pair's residual bound :math:`|\beta_m s_{m,i}|` is below
    ``tol`` times :math:`|\theta_1|`, or after ``max_iter`` matvecs; then reports the true residuals
    (k more matvecs, batched) and ``converged`` from them. Never a silent wrong number: an unconverged
    result says so.
    """
    if which not in ("largest", "smallest"):
        raise CurvlabError(f"which must be 'largest' or 'smallest', got {which!r}")
    if not 1 <= k <= op.dim:
        raise CurvlabError(f"k = {k} must lie in [1, dim = {op.dim}]")
    g = torch.Generator().manual_seed(seed)
    v0 = torch.randn(op.dim, generator=g, dtype=op.dtype)

    def stop(theta, S, b):
        idx = _pick(theta, k, which)
        if len(theta) < k:
            return False
        scale = max(abs(theta).max(), 1e-300)
        return bool(np.all(np.abs(b * S[-1, idx]) <= tol * scale))

    Q, alpha, beta = _lanczos(op, min(max_iter, op.dim), v0, stop)
    theta, S = _tridiagonal_eigh(alpha, beta)
    idx = _pick(theta, min(k, len(theta)), which)
    U = Q @ torch.as_tensor(S[:, idx], dtype=op.dtype)
    AU = op.matmat(U)
    residuals = (AU - U * torch.as_tensor(theta[idx], dtype=op.dtype)).norm(dim=0).numpy()
    scale = max(abs(theta).max(), 1e-300)
    converged = bool(len(idx) == k and np.all(residuals <= 10 * tol * scale * max(1.0, math.sqrt(k))))
    return EigenResult(theta[idx], U, residuals, op.num_matvecs, len(alpha), converged, "lanczos", which)


def eigsh_extremes(
    op: Operator, k: int = 1, which: str = "largest", tol: float = 1e-6, max_iter: int | None = None
) -> EigenResult:
    """The same as :func:`lanczos` through ``scipy.sparse.linalg.eigsh`` (implicitly restarted Lanczos)."""
    from scipy.sparse.linalg import ArpackNoConvergence, LinearOperator, eigsh

    if not 1 <= k < op.dim:
        raise CurvlabError(f"eigsh needs 1 <= k < dim = {op.dim}, got k = {k}")
    lin = LinearOperator(
        (op.dim, op.dim),
        matvec=lambda x: op.matvec(torch.as_tensor(np.asarray(x).reshape(-1), dtype=op.dtype)).numpy(),
        matmat=lambda X: op.matmat(torch.as_tensor(np.asarray(X), dtype=op.dtype)).numpy(),
        dtype=np.float64,
    )
    converged = True
    try:
        vals, vecs = eigsh(lin, k=k, which="LA" if which == "largest" else "SA", tol=tol, maxiter=max_iter)
    except ArpackNoConvergence as e:
        vals, vecs, converged = e.eigenvalues, e.eigenvectors, False
    order = np.argsort(vals)[::-1] if which == "largest" else np.argsort(vals)
    vals, U = vals[order], torch.as_tensor(vecs[:, order], dtype=op.dtype)
    residuals = (op.matmat(U) - U * torch.as_tensor(vals, dtype=op.dtype)).norm(dim=0).numpy()
    return EigenResult(
        vals, U, residuals, op.num_matvecs, op.num_matvecs - k, converged and len(vals) == k, "eigsh", which
    )


# -- trace -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceResult:
    """A trace estimate with its standard error (``std_error``) and cost."""

    trace: float
    std_error: float
    num_matvecs: int
    method: str
    samples: int

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


def _rademacher(dim: int, k: int, g: torch.Generator, dtype) -> Tensor:
    return (torch.randint(0, 2, (dim, k), generator=g) * 2 - 1).to(dtype)


def hutchinson(op: Operator, samples: int = 64, batch: int = 16, seed: int = 0) -> TraceResult:
    r"""Hutchinson's estimator :math:`\operatorname{tr} A \approx \frac1N \sum_i z_i^\top A z_i` with
    Rademacher :math:`z_i`; the standard error is the sample standard deviation over :math:`\sqrt N`.
    Products are taken ``batch`` at a time."""
    if samples < 2:
        raise CurvlabError("Hutchinson needs at least 2 samples for a standard error")
    g = torch.Generator().manual_seed(seed)
    values = []
    for start in range(0, samples, batch):
        Z = _rademacher(op.dim, min(batch, samples - start), g, op.dtype)
        values.append((Z * op.matmat(Z)).sum(0))
    v = torch.cat(values).double().numpy()
    return TraceResult(float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))), op.num_matvecs, "hutchinson", len(v))


def hutch_plus_plus(op: Operator, samples: int = 60, seed: int = 0) -> TraceResult:
    r"""Hutch++ (Meyer, Musco, Musco, Woodruff 2021): with m = samples/3, Q = orth(A S) for m random
    columns, :math:`\operatorname{tr}(Q^\top A Q)` exactly plus Hutchinson on the deflated
    :math:`(I - QQ^\top) A (I - QQ^\top)` with m vectors; the standard error is that of the second part."""
    m = max(2, samples // 3)
    g = torch.Generator().manual_seed(seed)
    S = _rademacher(op.dim, m, g, op.dtype)
    Q, _ = torch.linalg.qr(op.matmat(S))
    exact = float(torch.trace(Q.T @ op.matmat(Q)))
    G = _rademacher(op.dim, m, g, op.dtype)
    G = G - Q @ (Q.T @ G)
    AG = op.matmat(G)
    AG = AG - Q @ (Q.T @ AG)
    v = (G * AG).sum(0).double().numpy()
    return TraceResult(exact + float(v.mean()), float(v.std(ddof=1) / math.sqrt(m)), op.num_matvecs, "hutch++", 3 * m)


# -- spectral density ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DensityResult:
    """A spectral density on ``grid`` (integrating to 1), from stochastic Lanczos quadrature nodes and weights."""

    grid: np.ndarray
    density: np.ndarray
    nodes: np.ndarray  # (vectors, steps)
    weights: np.ndarray
    sigma: float
    num_matvecs: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "grid": self.grid.tolist(),
            "density": self.density.tolist(),
            "nodes": self.nodes.tolist(),
            "weights": self.weights.tolist(),
            "sigma": self.sigma,
            "num_matvecs": self.num_matvecs,
        }


def spectral_density(
    op: Operator, steps: int = 40, vectors: int = 4, points: int = 1000, sigma: float | None = None, seed: int = 0
) -> DensityResult:
    r"""Stochastic Lanczos quadrature (Ghorbani et al. 2019): for each random unit vector, ``steps``
    Lanczos steps give nodes :math:`\theta_j` (eigh of the tridiagonal T) and weights
    :math:`\tau_j = (e_1^\top s_j)^2`; the density is their average, each node broadened by a
    Gaussian of width ``sigma`` (default 1% of the spectral range), normalized to integrate to 1."""
    g = torch.Generator().manual_seed(seed)
    steps = min(steps, op.dim)
    nodes, weights = [], []
    for _ in range(vectors):
        _, alpha, beta = _lanczos(op, steps, torch.randn(op.dim, generator=g, dtype=op.dtype))
        theta, S = _tridiagonal_eigh(alpha, beta)
        pad = steps - len(theta)  # an invariant subspace reached early: pad with zero weights
        nodes.append(np.pad(theta, (0, pad), constant_values=theta[-1]))
        weights.append(np.pad(S[0] ** 2, (0, pad)))
    nodes, weights = np.array(nodes), np.array(weights) / vectors
    lo, hi = nodes.min(), nodes.max()
    width = max(hi - lo, 1e-12 * max(1.0, abs(hi)))
    sigma = sigma or 0.01 * width
    grid = np.linspace(lo - 5 * sigma, hi + 5 * sigma, points)
    density = (weights.reshape(-1, 1) * np.exp(-0.5 * ((grid - nodes.reshape(-1, 1)) / sigma) ** 2)).sum(0)
    density /= sigma * math.sqrt(2 * math.pi)
    density /= np.trapezoid(density, grid)
    return DensityResult(grid, density, nodes, weights, float(sigma), op.num_matvecs)


# -- preconditioned sharpness ------------------------------------------------------------------------


def preconditioned_operator(op: Operator, diagonal: Tensor) -> Operator:
    r""":math:`P^{-1/2} A P^{-1/2}` for a positive diagonal P (flat, in the operator's order)."""
    if diagonal.numel() != op.dim:
        raise CurvlabError(f"the preconditioner has {diagonal.numel()} entries, the operator {op.dim}")
    if not (diagonal > 0).all():
        raise CurvlabError("the preconditioner must be positive")
    s = diagonal.to(op.dtype).rsqrt()
    return Operator(
        op.dim, lambda x: s * op._matvec(s * x), op.dtype, lambda X: s[:, None] * op._matmat(s[:, None] * X)
    )


def adam_preconditioner(optimizer: torch.optim.Optimizer, model: torch.nn.Module, names: Sequence[str]) -> Tensor:
    r"""Adam's diagonal :math:`P = \sqrt{\hat v} + \epsilon`, :math:`\hat v = v / (1 - \beta_2^t)`, from an
    optimizer's state, flattened in the order of ``names``.

    Raises:
        CurvlabError: a parameter without Adam state (``exp_avg_sq``), e.g. Muon's matrices.
    """
    table = dict(model.named_parameters())
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    pieces = []
    for n in names:
        p = table[n]
        state = optimizer.state.get(p, {})
        if "exp_avg_sq" not in state:
            raise CurvlabError(
                f"{n} has no Adam state (exp_avg_sq): the preconditioned sharpness needs an Adam checkpoint"
            )
        group = group_of[id(p)]
        beta2, eps = group["betas"][1], group["eps"]
        step = float(state["step"])
        v_hat = state["exp_avg_sq"].double() / (1 - beta2**step)
        pieces.append((v_hat.sqrt() + eps).reshape(-1))
    return torch.cat(pieces)


@dataclass(frozen=True)
class Spectrum:
    """A checkpoint's spectrum summary: top/bottom eigenpairs, trace, density, and the update's overlap."""

    top: EigenResult | None = None
    bottom: EigenResult | None = None
    trace: TraceResult | None = None
    density: DensityResult | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {
            k: (getattr(self, k).to_dict() if getattr(self, k) is not None else None)
            for k in ("top", "bottom", "trace", "density")
        }
        return {**out, **self.extra}


def overlap_with(U: Tensor, z: Tensor) -> float:
    """The share of ||z||² that lies in the span of U's (orthonormal) columns."""
    coeff = U.T @ z
    return float((coeff @ coeff) / (z @ z))
