"""The curvature landscape beyond one direction: extreme eigenvalues, trace and spectral density, exact
through :mod:`curvlab.engine.hvp` on any model (Adam's preconditioner is :mod:`curvlab.optim.adam`; what
``curvlab spectrum`` asks for and returns, :mod:`curvlab.analysis.spectrum`).

Every estimator takes a symmetric :class:`~curvlab.engine.operator.Operator` (the Hessian, a block of
it, a preconditioned Hessian, any symmetric matrix) and runs on its device in its dtype: only scalars
and the small tridiagonal matrices go to the host.

Memory. A vector over the parameters takes ``dim × itemsize`` bytes (0.5 GB for GPT-2 in float32);
``memory`` (bytes) bounds the Lanczos basis of such vectors:

* :func:`lanczos` holds at most ``m = memory // vector_bytes`` vectors and thick-restarts (Wu & Simon
  2000) when they are full, keeping the ``(m + k) // 2`` best Ritz vectors: with full
  reorthogonalization the k wanted pairs converge to the same values as without a bound, at the cost
  of more HVPs. ``basis_device="cpu"`` keeps the basis in host memory.
* :func:`spectral_density` (SLQ) fits as many start vectors' whole bases as it can into one batched
  HVP call; when one basis alone doesn't fit it runs the plain three-term recurrence, whose Gauss
  quadrature is still accurate in floating point (Greenbaum 1989, Knizhnerman 1996).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.sparse.linalg import ArpackNoConvergence, eigsh
from torch import Tensor

from curvlab.engine.operator import Operator
from curvlab.errors import CurvlabError
from curvlab.util.codec import Record, meta


def vector_bytes(op: Operator) -> int:
    """Bytes of one flat vector of ``op`` (``dim × itemsize``): the unit of every Lanczos memory budget."""
    return op.dim * torch.finfo(op.dtype).bits // 8


def _generator(op: Operator, seed: int) -> torch.Generator:
    return torch.Generator(device=op.device).manual_seed(seed)


def _gaussian(op: Operator, columns: int, g: torch.Generator) -> Tensor:
    return torch.randn((op.dim, columns), generator=g, device=op.device, dtype=op.dtype)


def _rademacher(op: Operator, columns: int, g: torch.Generator) -> Tensor:
    z = torch.empty((op.dim, columns), device=op.device, dtype=op.dtype).bernoulli_(0.5, generator=g)
    return z.mul_(2).sub_(1)


def _host(x: Tensor) -> np.ndarray:
    """A small tensor (coefficients, per-sample values) as a float64 numpy array on the host."""
    return x.detach().cpu().numpy().astype(np.float64)


def _host_tensor(x: np.ndarray) -> Tensor:
    """Host numbers (eigenvalues, residuals) as a float64 CPU tensor: :class:`EigenResult`'s array type."""
    return torch.from_numpy(np.array(x, dtype=np.float64))


# -- Lanczos ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EigenResult(Record):
    r"""Extreme eigenpairs :math:`(\theta_i, u_i)` of a symmetric operator A, every one with its residual.

    Attributes:
        eigenvalues: the k Ritz values :math:`\theta_i`, wanted end first, float64 on the host.
        eigenvectors: ``(dim, k)``: the unit Ritz vectors :math:`u_i` as columns, on the operator's device
            in its dtype (not written to JSON).
        residuals: the true :math:`\|A u_i - \theta_i u_i\|`, float64 on the host: some eigenvalue of A
            lies within it of :math:`\theta_i` (within :math:`r^2/\delta` when the rest is :math:`\delta` away).
        num_matvecs: the operator's products taken (the final residuals' included).
        iterations: the iterations run.
        converged: whether every residual is within tolerance.
        algorithm: ``"lanczos"`` or ``"eigsh"``.
        which: ``"largest"`` or ``"smallest"``.
        basis_vectors: the most Lanczos vectors held at once.
        restarts: how often the basis was compressed to fit its memory budget.
    """

    # One array type, torch: the eigenvectors stay on the operator's device; the eigenvalues and residuals
    # are float64 on the CPU, so that reading one never waits for a device nor rounds to a float32 operator's
    eigenvalues: Tensor
    eigenvectors: Tensor = field(metadata=meta(skip=True))  # (not written: a JSON keeps the eigenvalues)
    residuals: Tensor
    num_matvecs: int
    iterations: int
    converged: bool
    algorithm: str
    which: str
    basis_vectors: int = 0
    restarts: int = 0


class _Basis:
    """Up to ``capacity`` orthonormal vectors of length ``dim`` on ``device``, stored as rows of blocks
    allocated as they fill (of up to 16 vectors for small models, where one product per block saves time)."""

    CHUNK = 1 << 22  # elements of a temporary in :meth:`rotate`, and of a block of small vectors

    def __init__(self, dim: int, capacity: int, device: torch.device, dtype: torch.dtype):
        self.dim, self.capacity, self.device, self.dtype = dim, capacity, device, dtype
        self.block = max(1, min(16, self.CHUNK // dim))
        self.blocks: list[Tensor] = []
        self.size = 0

    def _used(self) -> list[Tensor]:
        full = -(-self.size // self.block)
        return [b[: min(self.block, self.size - i * self.block)] for i, b in enumerate(self.blocks[:full])]

    def append(self, v: Tensor) -> None:
        i, r = divmod(self.size, self.block)
        if i == len(self.blocks):
            rows = min(self.block, self.capacity - i * self.block)
            self.blocks.append(torch.empty((rows, self.dim), device=self.device, dtype=self.dtype))
        self.blocks[i][r] = v
        self.size += 1

    def row(self, i: int) -> Tensor:
        return self.blocks[i // self.block][i % self.block]

    def orthogonalize(self, w: Tensor) -> tuple[Tensor, np.ndarray]:
        r"""``w`` minus its projection on the basis, by classical Gram–Schmidt applied twice
        ("twice is enough", Kahan–Parlett), and the projection's coefficients :math:`V^\top w`."""
        if self.size == 0:
            return w, np.zeros(0)
        wb = w.to(self.device)
        h = 0.0
        for _ in range(2):
            used = self._used()
            c = [R @ wb for R in used]
            for R, ci in zip(used, c):
                wb.addmv_(R.T, ci, alpha=-1)  # in place: w is this call's own (a fresh product)
            h = h + _host(torch.cat(c))
        return wb.to(w.device), h

    def combine(self, S: np.ndarray, device: torch.device) -> Tensor:
        r""":math:`V^\top S`: the vectors with coefficients the columns of ``S`` (``size × k``), on ``device``."""
        S = torch.as_tensor(S, device=self.device, dtype=self.dtype)
        out = sum(R.T @ S[i * self.block : i * self.block + len(R)] for i, R in enumerate(self._used()))
        return out.to(device)

    def rotate(self, S: np.ndarray) -> None:
        r"""Replace the basis by its first ``l`` combinations :math:`S^\top V` (``S`` is ``size × l``),
        in place, a slab of coordinates at a time (no second basis is ever allocated)."""
        St = torch.as_tensor(S.T.copy(), device=self.device, dtype=self.dtype)
        step = max(1, self.CHUNK // self.size)
        used = self._used()
        for a in range(0, self.dim, step):
            Y = St @ torch.cat([R[:, a : a + step] for R in used])
            for i, rows in enumerate(Y.split(self.block)):
                self.blocks[i][: len(rows), a : a + step] = rows
        self.size = S.shape[1]


def _residuals(op: Operator, U: Tensor, values: np.ndarray) -> np.ndarray:
    r"""The true residuals :math:`\|A u_i - \theta_i u_i\|` of the columns of U, in one batched product."""
    AU = op.matmat(U)
    for i, value in enumerate(values):
        AU[:, i].sub_(U[:, i], alpha=float(value))
    return _host(AU.norm(dim=0))


def _pick(theta: np.ndarray, k: int, which: str) -> np.ndarray:
    order = np.argsort(theta)
    return order[::-1][:k] if which == "largest" else order[:k]


def _check_which(which: str) -> None:
    if which not in ("largest", "smallest"):
        raise CurvlabError(f"which must be 'largest' or 'smallest', got {which!r}")


def _check_memory(memory: float) -> None:
    if not memory > 0:
        raise CurvlabError(f"the memory budget must be a positive number of bytes, got {memory}")


def basis_capacity(op: Operator, memory: int | None, k: int, limit: int) -> int:
    """How many Lanczos vectors fit in ``memory`` bytes (at most ``limit``); ``None`` means ``limit``.

    Raises:
        CurvlabError: a budget below the ``k + 2`` vectors a restart needs.
    """
    if memory is None:
        return limit
    _check_memory(memory)
    m = int(memory) // vector_bytes(op)
    need = min(k + 2, op.dim)
    if m < need:
        raise CurvlabError(
            f"a memory budget of {int(memory)} bytes holds {m} Lanczos vectors of {vector_bytes(op)} bytes; "
            f"k = {k} needs at least {need} ({need * vector_bytes(op)} bytes)"
        )
    return min(m, limit)


def lanczos(
    op: Operator,
    *,
    k: int = 1,
    which: str = "largest",
    max_iter: int = 100,
    tol: float = 1e-6,
    seed: int = 0,
    memory: int | None = None,
    basis_device: torch.device | str | None = None,
    relative_to: str = "spectrum",
) -> EigenResult:
    r"""The k largest (or smallest) eigenpairs by Lanczos with full reorthogonalization, thick-restarted
    to fit a memory budget.

    With basis :math:`V` and :math:`T = V^\top A V` (tridiagonal, with an arrow after a restart),
    :math:`A V = V T + f e_m^\top`, so a Ritz pair :math:`(\theta_i, V s_i)` of T has residual
    :math:`\|f\|\,|e_m^\top s_i|`. It stops when every wanted pair's residual is below ``tol`` times
    :math:`\max|\theta|` (``relative_to="eigenvalue"``: times its own :math:`|\theta_i|`), or after
    ``max_iter`` matvecs, then takes the true residuals (k more matvecs). Relative to the spectrum, a wanted
    end far smaller than the other end is accepted to the other end's scale: a Hessian whose smallest
    eigenvalue is -2533 lets its largest stop at a Ritz value of 0.001 with a residual of 0.4, after 2
    iterations; relative to the eigenvalue it goes on until that value itself is resolved.
    From one start vector it sees one direction per distinct eigenvalue: when that space closes (an
    exact multiplicity) it goes on from a fresh random direction; a multiplicity in a space that never
    closes shows only as far as rounding brings it in.

    Args:
        op: the symmetric operator A.
        k: how many eigenpairs.
        which: ``"largest"`` or ``"smallest"`` (algebraic).
        max_iter: matvecs at most (besides the k of the final residuals).
        tol: the stopping tolerance on each pair's residual, relative to :math:`\max|\theta|`.
        seed: the start vector's seed (drawn on the operator's device).
        memory: bytes the stored Lanczos vectors may take (``None``: no bound); a full basis is
            thick-restarted (see the module docstring).
        basis_device: where the basis lives and is reorthogonalized (default: the operator's device).
        relative_to: what ``tol`` is relative to: ``"spectrum"`` (:math:`\max|\theta|`) or
            ``"eigenvalue"`` (each wanted :math:`|\theta_i|`).

    Returns:
        An :class:`EigenResult`; ``converged`` only when every residual is at most
        :math:`10\,\mathrm{tol}\,\max|\theta|\sqrt{k}` (with ``"eigenvalue"``, :math:`|\theta_i|` for
        :math:`\max|\theta|`).

    Raises:
        CurvlabError: k outside [1, dim], an unknown ``which`` or ``relative_to``, a memory budget below
            k + 2 vectors.
    """
    _check_which(which)
    if relative_to not in ("spectrum", "eigenvalue"):
        raise CurvlabError(f"relative_to must be 'spectrum' or 'eigenvalue', got {relative_to!r}")
    if not 1 <= k <= op.dim:
        raise CurvlabError(f"k = {k} must lie in [1, dim = {op.dim}]")
    m = basis_capacity(op, memory, k, min(max_iter, op.dim))
    start = op.num_matvecs
    basis = _Basis(op.dim, m, torch.device(basis_device) if basis_device else op.device, op.dtype)
    g = _generator(op, seed)

    def fresh() -> Tensor:  # a random unit vector orthogonal to the basis
        v, _ = basis.orthogonalize(_gaussian(op, 1, g)[:, 0])
        return v / v.norm()

    basis.append(fresh())
    T = np.zeros((m, m))
    j, steps, restarts, held = 1, 0, 0, 1
    eps = torch.finfo(op.dtype).eps
    while True:
        w, h = basis.orthogonalize(op.matvec(basis.row(j - 1).to(op.device)))
        steps += 1
        T[:j, j - 1] = T[j - 1, :j] = h
        beta = float(w.norm())
        theta, S = np.linalg.eigh(T[:j, :j])
        idx = _pick(theta, k, which)
        scale = max(float(np.abs(theta).max()), 1e-300)
        closed = beta <= 100 * eps * scale  # an invariant subspace: its Ritz values are exact, maybe not extreme
        wanted = scale if relative_to == "spectrum" else np.abs(theta[idx])
        if not closed and len(idx) == k and np.all(beta * np.abs(S[j - 1, idx]) <= tol * wanted):
            break
        if steps >= max_iter or j == op.dim:
            break
        if j == m:  # the budget is full: keep the best Ritz vectors and go on from the residual
            keep = _pick(theta, (m + k) // 2, which)
            basis.rotate(S[:, keep])
            T[:] = 0.0
            T[np.arange(len(keep)), np.arange(len(keep))] = theta[keep]
            j, restarts = len(keep), restarts + 1
        basis.append(fresh() if closed else w / beta)  # after a closed space, a fresh direction finds the rest
        j += 1
        held = max(held, j)
    idx = _pick(theta, min(k, j), which)
    U = basis.combine(S[:, idx], op.device)
    residuals = _residuals(op, U, theta[idx])
    wanted = scale if relative_to == "spectrum" else np.abs(theta[idx])
    converged = bool(len(idx) == k and np.all(residuals <= 10 * tol * wanted * max(1.0, math.sqrt(k))))
    values = _host_tensor(theta[idx])
    return EigenResult(
        values, U, _host_tensor(residuals), op.num_matvecs - start, steps, converged, "lanczos", which, held, restarts
    )


def eigsh_extremes(
    op: Operator,
    *,
    k: int = 1,
    which: str = "largest",
    tol: float = 1e-6,
    max_iter: int | None = None,
    memory: int | None = None,
) -> EigenResult:
    """The same as :func:`lanczos` through ``scipy.sparse.linalg.eigsh`` on ``op.to_scipy()`` (its basis in
    host memory): ``memory`` bytes set its number of Lanczos vectors ``ncv`` (default scipy's)."""
    _check_which(which)
    if not 1 <= k < op.dim:
        raise CurvlabError(f"eigsh needs 1 <= k < dim = {op.dim}, got k = {k}")
    ncv = None if memory is None else min(basis_capacity(op, memory, k, op.dim), op.dim)
    start = op.num_matvecs
    converged = True
    try:
        vals, vecs = eigsh(
            op.to_scipy(), k=k, which="LA" if which == "largest" else "SA", tol=tol, maxiter=max_iter, ncv=ncv
        )
    except ArpackNoConvergence as e:
        vals, vecs, converged = e.eigenvalues, e.eigenvectors, False
    order = np.argsort(vals)[::-1] if which == "largest" else np.argsort(vals)
    vals = vals[order]
    U = torch.as_tensor(vecs[:, order].copy(), device=op.device, dtype=op.dtype)
    residuals = _residuals(op, U, vals)
    used = op.num_matvecs - start
    ok = converged and len(vals) == k
    held = ncv or min(op.dim, max(2 * k + 1, 20))
    values, residuals = _host_tensor(vals), _host_tensor(residuals)
    return EigenResult(values, U, residuals, used, used - len(vals), ok, "eigsh", which, held)


# -- trace -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceResult(Record):
    """A trace estimate with its standard error (``std_error``) and cost."""

    trace: float
    std_error: float
    num_matvecs: int
    algorithm: str
    samples: int


def hutchinson(op: Operator, *, samples: int = 64, batch: int = 16, seed: int = 0) -> TraceResult:
    r"""Hutchinson's estimator :math:`\operatorname{tr} A \approx \frac1N \sum_i z_i^\top A z_i` with
    Rademacher :math:`z_i`; the standard error is the sample standard deviation over :math:`\sqrt N`.

    Args:
        op: the symmetric operator A (e.g. :func:`~curvlab.engine.operator.hessian_operator`).
        samples: N, the number of Rademacher vectors.
        batch: vectors per batched product (``2 × batch`` vectors in memory).
        seed: the seed of the vectors, drawn on the operator's device.

    Returns:
        The :class:`TraceResult`: the estimate, its standard error, and the products taken.
    """
    if samples < 2:
        raise CurvlabError("Hutchinson needs at least 2 samples for a standard error")
    start = op.num_matvecs
    g = _generator(op, seed)
    values = []
    for first in range(0, samples, batch):
        Z = _rademacher(op, min(batch, samples - first), g)
        values.append(_host((Z * op.matmat(Z)).sum(0)))
    v = np.concatenate(values)
    return TraceResult(
        float(v.mean()), float(v.std(ddof=1) / math.sqrt(len(v))), op.num_matvecs - start, "hutchinson", len(v)
    )


def hutch_plus_plus(op: Operator, *, samples: int = 60, seed: int = 0) -> TraceResult:
    r"""Hutch++ (Meyer, Musco, Musco, Woodruff 2021): with m = samples/3, Q = orth(A S) for m random
    columns, :math:`\operatorname{tr}(Q^\top A Q)` exactly plus Hutchinson on the deflated
    :math:`(I - QQ^\top) A (I - QQ^\top)` with m vectors; the standard error is that of the second
    part. About ``3m`` vectors are in memory at once.

    Args:
        op: the symmetric operator A (e.g. :func:`~curvlab.engine.operator.hessian_operator`).
        samples: the budget of products, split in three equal parts.
        seed: the seed of the random vectors, drawn on the operator's device.

    Returns:
        The :class:`TraceResult`: the estimate, its standard error, and the products taken.
    """
    m = max(2, samples // 3)
    start = op.num_matvecs
    g = _generator(op, seed)
    Q, _ = torch.linalg.qr(op.matmat(_rademacher(op, m, g)))
    exact = float(torch.trace(Q.T @ op.matmat(Q)))
    G = _rademacher(op, m, g)
    G = G - Q @ (Q.T @ G)
    AG = op.matmat(G)
    AG = AG - Q @ (Q.T @ AG)
    v = _host((G * AG).sum(0))
    return TraceResult(
        exact + float(v.mean()), float(v.std(ddof=1) / math.sqrt(m)), op.num_matvecs - start, "hutch++", 3 * m
    )


# -- spectral density ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DensityResult(Record):
    """A spectral density on ``grid`` (integrating to 1), from stochastic Lanczos quadrature nodes and
    weights; ``reorthogonalized``: whether the Lanczos bases were kept."""

    grid: np.ndarray
    density: np.ndarray
    nodes: np.ndarray  # (vectors, steps)
    weights: np.ndarray
    sigma: float
    num_matvecs: int
    reorthogonalized: bool = True


def _independent_lanczos(
    op: Operator, starts: Tensor, steps: int, keep_basis: bool, basis_device: torch.device
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""``steps`` Lanczos steps from each column of ``starts`` (``dim × V``), all V through one matmat per
    step: the tridiagonals' ``alpha`` and ``beta`` (``steps × V``) and each column's length (shorter where
    its Krylov space closed); ``keep_basis``: with full reorthogonalization."""
    V = starts.shape[1]
    q = (starts / starts.norm(dim=0)).T  # (V, dim): one row per start vector
    q_prev = torch.zeros_like(q)
    b_prev = q.new_zeros((V, 1))
    basis = torch.empty((V, steps, op.dim), device=basis_device, dtype=op.dtype) if keep_basis else None
    alphas, betas = [], []
    lengths = np.full(V, steps)
    norm = np.zeros(V)
    tiny = 100 * torch.finfo(op.dtype).eps
    for j in range(steps):
        if basis is not None:
            basis[:, j] = q
        w = op.matmat(q.T).T
        a = (q * w).sum(1, keepdim=True)
        w = w - a * q - b_prev * q_prev
        if basis is not None:
            B, wb = basis[:, : j + 1], w.to(basis_device)
            for _ in range(2):
                wb = wb - torch.bmm(B.transpose(1, 2), torch.bmm(B, wb[:, :, None]))[:, :, 0]
            w = wb.to(op.device)
        b = w.norm(dim=1, keepdim=True)
        a_host, b_host = _host(a[:, 0]), _host(b[:, 0])
        alphas.append(a_host)
        betas.append(b_host)
        norm = np.maximum(norm, np.abs(a_host) + b_host)
        closed = (b_host <= tiny * np.maximum(norm, 1e-300)) & (lengths == steps)
        lengths[closed] = j + 1
        alive = torch.as_tensor(lengths > j + 1, device=op.device)[:, None]
        q_prev, q = q, torch.where(alive, w / torch.where(alive, b, 1.0), 0.0)
        b_prev = torch.where(alive, b, 0.0)
    return np.array(alphas), np.array(betas), lengths


def spectral_density(
    op: Operator,
    *,
    steps: int = 40,
    vectors: int = 4,
    points: int = 1000,
    sigma: float | None = None,
    seed: int = 0,
    memory: int | None = None,
    basis_device: torch.device | str | None = None,
) -> DensityResult:
    r"""Stochastic Lanczos quadrature (Ghorbani et al. 2019): for each random unit vector, ``steps``
    Lanczos steps give nodes :math:`\theta_j` (eigh of the tridiagonal T) and weights
    :math:`\tau_j = (e_1^\top s_j)^2`; the density is their average, each node broadened by a
    Gaussian of width ``sigma`` (default 1% of the spectral range), normalized to integrate to 1.

    The ``vectors`` runs go through one batched matmat per step, as many at a time as ``memory`` holds
    their bases for full reorthogonalization; when not even one run's fit, all run the three-term
    recurrence (``reorthogonalized`` is then False).

    Args:
        op: the symmetric operator A (e.g. :func:`~curvlab.engine.operator.hessian_operator`).
        steps: Lanczos steps per vector, the number of nodes each run gives.
        vectors: random start vectors, the runs averaged.
        points: points of the grid, spanning the nodes' range plus five ``sigma`` on each side.
        sigma: the Gaussian broadening, in eigenvalue units (default ``None``: 1% of the spectral range).
        seed: the seed of the start vectors, drawn on the operator's device.
        memory: bytes the stored Lanczos bases may take (``None``: no bound).
        basis_device: where the bases live and are reorthogonalized (default: the operator's device).

    Returns:
        The :class:`DensityResult`: the density on its grid, the nodes and weights, and the cost.
    """
    steps = min(steps, op.dim)
    start = op.num_matvecs
    g = _generator(op, seed)
    starts = _gaussian(op, vectors, g)
    per_run = steps * vector_bytes(op)
    if memory is not None:
        _check_memory(memory)
    together = vectors if memory is None else min(vectors, int(memory) // per_run)
    keep_basis = together >= 1
    together = together if keep_basis else vectors
    where = torch.device(basis_device) if basis_device else op.device
    nodes, weights = [], []
    for first in range(0, vectors, together):
        alpha, beta, lengths = _independent_lanczos(op, starts[:, first : first + together], steps, keep_basis, where)
        for c, n in enumerate(lengths):
            T = np.diag(alpha[:n, c]) + np.diag(beta[: n - 1, c], 1) + np.diag(beta[: n - 1, c], -1)
            theta, S = np.linalg.eigh(T)
            nodes.append(np.pad(theta, (0, steps - n), constant_values=theta[-1]))  # closed early: zero weights
            weights.append(np.pad(S[0] ** 2, (0, steps - n)))
    nodes, weights = np.array(nodes), np.array(weights) / vectors
    lo, hi = nodes.min(), nodes.max()
    width = max(hi - lo, 1e-12 * max(1.0, abs(hi)))
    sigma = sigma or 0.01 * width
    grid = np.linspace(lo - 5 * sigma, hi + 5 * sigma, points)
    density = (weights.reshape(-1, 1) * np.exp(-0.5 * ((grid - nodes.reshape(-1, 1)) / sigma) ** 2)).sum(0)
    density /= sigma * math.sqrt(2 * math.pi)
    density /= np.trapezoid(density, grid)
    return DensityResult(grid, density, nodes, weights, float(sigma), op.num_matvecs - start, keep_basis)


def overlap_with(U: Tensor, z: Tensor) -> float:
    """The share of ||z||² that lies in the span of U's (orthonormal) columns."""
    z = z.to(device=U.device, dtype=U.dtype)
    coeff = U.T @ z
    return float((coeff @ coeff) / (z @ z))
