r"""The stylized Kronecker quadratic model of the paper's Section 5 (docs/science.md section 7).

.. math::
    Q(Y) = L_0 - \langle G, Y\rangle + \tfrac12 \langle Y, H[Y]\rangle,\qquad
    H[Y] = \sum_{k=1}^r A_k Y B_k,\quad
    A_k = U \operatorname{diag}(a_k) U^\top,\ B_k = V \operatorname{diag}(b_k) V^\top.

H is applied in factored form, :math:`O(r\,d_1 d_2 (d_1 + d_2))`, never as the dense
:math:`d_1 d_2 \times d_1 d_2` matrix. The mode :math:`M_{ij} = u_i v_j^\top` is an eigenvector with
curvature :math:`\sum_k a_{k,i} b_{k,j}`; the theorem uses the paired modes :math:`M_i = u_i v_i^\top`,
i < q, with curvature :math:`w_H` on m of them and :math:`w_L` on the other q - m, and an aligned
gradient :math:`G = \sum_i \sigma_i M_i`. Both methods start at Y = 0 with exact line search
:math:`\eta = \langle R, Z\rangle / \langle Z, H[Z]\rangle`, :math:`R = G - H[Y]`:
GD takes Z = R, Muon Z = msign(R).

Both parts of Theorem 5.5 rest on the gradient's alignment with the sharp modes, σ_H >= σ_L: with
σ_H < σ_L, GD's first step already has the lower NDS, and Muon's loss stays above GD's even where
the inequalities of part (ii) hold (see :func:`theorem_condition`).

Two realizations: :class:`KroneckerQuadratic`, the matrix model (which :func:`curvlab.hvp` and
:func:`curvlab.taylor_split` run on unchanged through :meth:`KroneckerQuadratic.loss_fn`), and
:func:`scalar_two_level`, the separable model of the two mode groups that the matrix dynamics reduce to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from curvlab.curvature.taylor import nds
from curvlab.engine.hvp import CurvaturePoint
from curvlab.errors import CurvlabError
from curvlab.optim.polar import msign
from curvlab.util.codec import Record, meta

LINE_SEARCH_METHODS = ("gd", "muon")
FIXED_LR_METHODS = ("gd", "muon", "adam", "sign")


@dataclass(frozen=True)
class KroneckerQuadratic:
    """``Q(Y) = L0 - <G, Y> + ½ <Y, Σ_k A_k Y B_k>`` with A ``(r, d1, d1)`` and B ``(r, d2, d2)`` symmetric."""

    A: Tensor
    B: Tensor
    G: Tensor
    L0: float = 0.0

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.G.shape)

    def hvp(self, Y: Tensor) -> Tensor:
        r""":math:`H[Y] = \sum_k A_k Y B_k` (batched over leading dimensions of Y)."""
        return (self.A @ Y.unsqueeze(-3) @ self.B).sum(-3)

    def value(self, Y: Tensor) -> Tensor:
        return self.L0 - (self.G * Y).sum() + 0.5 * (Y * self.hvp(Y)).sum()

    def residual(self, Y: Tensor) -> Tensor:
        """R = G - H[Y], the negative gradient."""
        return self.G - self.hvp(Y)

    def loss_fn(self, params: dict[str, Tensor], batch: Any = None) -> Tensor:
        """curvlab's loss convention: ``params = {"Y": Y}``; the batch is ignored."""
        return self.value(params["Y"])

    def nds(self, Y: Tensor, Z: Tensor) -> float:
        r""":math:`\langle Z, H[Z]\rangle / \|Z\|^2` at Y, by the curvature functions every model goes through."""
        return nds(self.loss_fn, {"Y": Y}, None, {"Y": Z}, dtype=Y.dtype)

    def nds_along(self, Zs: list[Tensor]) -> list[float]:
        """The NDS of each direction of a trajectory, at one :class:`~curvlab.engine.hvp.CurvaturePoint`: the
        Hessian of a quadratic is the same at every Y, so one point serves every step."""
        if not Zs:
            return []
        with CurvaturePoint(self.loss_fn, {"Y": torch.zeros_like(self.G)}, None, dtype=self.G.dtype) as point:
            stacked = torch.stack(Zs)
            _, zhz = point.quadratic_forms({"Y": stacked})
        zz = stacked.double().flatten(1).pow(2).sum(1).cpu()
        return [float(a / b) if b > 0 else float("nan") for a, b in zip(zhz, zz)]

    def dense_hessian(self) -> Tensor:
        """The dense ``d1 d2 x d1 d2`` Hessian (row-major vec of Y): for tests on small sizes only."""
        return sum(torch.kron(a, b) for a, b in zip(self.A, self.B))


@dataclass(frozen=True)
class TwoLevelSpec:
    """The theorem's setting: q paired modes, m of them with curvature w_H and gradient σ_H, the rest
    with w_L and σ_L (α = m/q, ρ = w_H/w_L)."""

    d1: int = 128
    d2: int = 128
    q: int = 88
    m: int = 8
    w_H: float = 100.0
    w_L: float = 1.0
    sigma_H: float = 3.0
    sigma_L: float = 1.0
    seed: int = 0

    @property
    def alpha(self) -> float:
        return self.m / self.q

    @property
    def rho(self) -> float:
        return self.w_H / self.w_L

    def validate(self, outside_theorem: bool = False) -> None:
        """Raise ``CurvlabError`` naming the assumption that fails (sizes always; the theorem's
        assumptions unless ``outside_theorem``)."""
        if not 1 <= self.m < self.q:
            raise CurvlabError(f"need 1 <= m < q, got m={self.m}, q={self.q}")
        if self.q > min(self.d1, self.d2):
            raise CurvlabError(f"q={self.q} > min(d1, d2)={min(self.d1, self.d2)}: not enough paired modes")
        if self.w_L <= 0 or self.w_H <= 0:
            raise CurvlabError(f"curvatures must be positive, got w_H={self.w_H}, w_L={self.w_L}")
        if self.sigma_H <= 0 or self.sigma_L <= 0:
            raise CurvlabError(f"gradient coefficients must be positive, got σ_H={self.sigma_H}, σ_L={self.sigma_L}")
        if outside_theorem:
            return
        if self.alpha >= 0.5:
            raise CurvlabError(f"the theorem needs α = m/q < 1/2, got {self.alpha:.3f}")
        if self.w_H <= self.w_L:
            raise CurvlabError(f"the theorem needs w_H > w_L (heterogeneous curvature), got {self.w_H} <= {self.w_L}")


def _orthogonal(n: int, generator: torch.Generator) -> Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def _kronecker_model(
    a: list[Tensor], b: list[Tensor], sigma: Tensor, seed: int, d1: int, d2: int
) -> KroneckerQuadratic:
    g = torch.Generator().manual_seed(seed)
    U, V = _orthogonal(d1, g), _orthogonal(d2, g)
    A = torch.stack([U @ torch.diag(x) @ U.T for x in a])
    B = torch.stack([V @ torch.diag(x) @ V.T for x in b])
    q = sigma.numel()
    G = U[:, :q] @ torch.diag(sigma) @ V[:, :q].T
    return KroneckerQuadratic(A, B, G)


def two_level(spec: TwoLevelSpec, outside_theorem: bool = False) -> KroneckerQuadratic:
    """The matrix model of the theorem: Kronecker rank 2 with shared eigenbases U, V (random orthogonal).

    a_1 = a_2 = (w_H x m, w_L x (d1 - m)), b_1 = 1, b_2 = 1[j >= q]: mode (i, j) has curvature
    a_i (1 + [j >= q]), so the paired modes have w_i and every curvature is positive.
    """
    spec.validate(outside_theorem)
    d1, d2, q, m = spec.d1, spec.d2, spec.q, spec.m
    a = torch.full((d1,), spec.w_L, dtype=torch.float64)
    a[:m] = spec.w_H
    b2 = (torch.arange(d2) >= q).to(torch.float64)
    sigma = torch.full((q,), spec.sigma_L, dtype=torch.float64)
    sigma[:m] = spec.sigma_H
    return _kronecker_model([a, a], [torch.ones(d2, dtype=torch.float64), b2], sigma, spec.seed, d1, d2)


def power_law(
    d1: int = 128,
    d2: int = 128,
    q: int = 64,
    exponent: float = 1.0,
    alignment: float = 1.0,
    w_max: float = 100.0,
    seed: int = 0,
) -> KroneckerQuadratic:
    r"""A long-tailed spectrum: paired-mode curvature :math:`w_i = w_\max (i+1)^{-\text{exponent}}` and an
    aligned gradient :math:`\sigma_i \propto w_i^{\text{alignment}}` (0: isotropic, larger: more
    aligned with the sharp modes). Kronecker rank 1 (B = I); unpaired modes take the smallest curvature."""
    if q > min(d1, d2):
        raise CurvlabError(f"q={q} > min(d1, d2)={min(d1, d2)}")
    w = w_max * (torch.arange(q, dtype=torch.float64) + 1) ** (-exponent)
    a = torch.full((d1,), float(w[-1]), dtype=torch.float64)
    a[:q] = w
    sigma = w**alignment
    sigma = sigma / sigma.norm() * math.sqrt(q)
    return _kronecker_model([a], [torch.ones(d2, dtype=torch.float64)], sigma, seed, d1, d2)


@dataclass
class Trajectory(Record):
    """Per-step records of one method on one quadratic; index t is the step taken from Y_t.

    Mutable on purpose: the runs below append to its lists step by step (a diverged run's loss ends in
    ``inf``; an NDS of a zero direction is ``nan``)."""

    method: str
    # Q(Y_t), t = 0..T; in strict JSON a null loss is a diverged run's inf (the only non-finite loss the runs
    # record), any other null NaN
    loss: list[float] = field(default_factory=list, metadata=meta(null=math.inf))
    nds: list[float] = field(default_factory=list)  # <Z,H Z>/||Z||² of the direction
    step_norm: list[float] = field(default_factory=list)  # ||η Z||
    first_order: list[float] = field(default_factory=list)  # <R, η Z>
    lr: float | None = None


def _direction(method: str, R: Tensor, polar: str) -> Tensor:
    if method == "gd":
        return R
    return msign(R, polar=polar, dtype=torch.float64 if polar != "newton_schulz" else torch.float32).to(R.dtype)


def run_line_search(problem: KroneckerQuadratic, method: str, steps: int, polar: str = "svd") -> Trajectory:
    """GD (Z = R) or Muon (Z = msign(R), no momentum) from Y = 0 with exact line search."""
    if method not in LINE_SEARCH_METHODS:
        raise CurvlabError(f"unknown method {method!r}; choose one of {', '.join(LINE_SEARCH_METHODS)}")
    Y = torch.zeros_like(problem.G)
    traj = Trajectory(method if method == "gd" or polar == "svd" else f"muon-{polar}")
    traj.loss.append(float(problem.value(Y)))
    for _ in range(steps):
        R = problem.residual(Y)
        Z = _direction(method, R, polar)
        zz, rz = float((Z * Z).sum()), float((R * Z).sum())
        if zz == 0:
            break  # at the optimum: nothing left to do
        sharpness = problem.nds(Y, Z)
        if sharpness <= 0:
            break  # no descent curvature
        eta = rz / (sharpness * zz)
        Y = Y + eta * Z
        traj.nds.append(sharpness)
        traj.step_norm.append(abs(eta) * math.sqrt(zz))
        traj.first_order.append(eta * rz)
        traj.loss.append(float(problem.value(Y)))
    return traj


def run_fixed_lr(
    problem: KroneckerQuadratic,
    method: str,
    lr: float,
    steps: int,
    momentum: float = 0.9,
    betas=(0.9, 0.999),
    eps=1e-8,
    with_nds: bool = True,
) -> Trajectory:
    """A fixed learning rate, beyond the theorem: GD and Muon with heavy-ball momentum, Adam (bias
    corrected, in the coordinates of Y), and sign descent. ``with_nds=False`` leaves ``nds`` empty
    (a learning-rate search needs only the losses)."""
    if method not in FIXED_LR_METHODS:
        raise CurvlabError(f"unknown method {method!r}; choose one of {', '.join(FIXED_LR_METHODS)}")
    Y = torch.zeros_like(problem.G)
    buf, m1, m2 = torch.zeros_like(Y), torch.zeros_like(Y), torch.zeros_like(Y)
    traj = Trajectory(method, lr=lr)
    traj.loss.append(float(problem.value(Y)))
    directions = []
    for t in range(1, steps + 1):
        R = problem.residual(Y)
        if method == "adam":
            m1 = betas[0] * m1 + (1 - betas[0]) * R
            m2 = betas[1] * m2 + (1 - betas[1]) * R * R
            Z = (m1 / (1 - betas[0] ** t)) / ((m2 / (1 - betas[1] ** t)).sqrt() + eps)
        elif method == "sign":
            Z = torch.sign(R)
        else:
            buf = momentum * buf + R
            Z = _direction(method, buf, "svd")
        step = lr * Z
        directions.append(Z)
        traj.step_norm.append(float(step.norm()))
        traj.first_order.append(float((R * step).sum()))
        Y = Y + step
        value = float(problem.value(Y))
        traj.loss.append(value if math.isfinite(value) else float("inf"))
        if not math.isfinite(value):
            break
    if with_nds:
        traj.nds = problem.nds_along(directions)
    return traj


def best_fixed_lr(problem: KroneckerQuadratic, method: str, grid, steps: int, **kwargs) -> Trajectory:
    """The run with the lowest final loss over a learning-rate grid (each method gets its best, for fairness)."""
    runs = [run_fixed_lr(problem, method, lr, steps, with_nds=False, **kwargs) for lr in grid]
    best = min(runs, key=lambda tr: tr.loss[-1] if len(tr.loss) == steps + 1 else float("inf"))
    return run_fixed_lr(problem, method, best.lr, steps, **kwargs)  # the winner again, now with its NDS


# -- the separable two-level model and the theorem's closed forms --------------------------------


def scalar_two_level(spec: TwoLevelSpec, method: str, steps: int) -> Trajectory:
    """The dynamics of :func:`run_line_search` on :func:`two_level`, reduced to one coefficient per
    group: Y = y_H Σ_{i<m} M_i + y_L Σ_{m<=i<q} M_i (exact polar factor for Muon)."""
    if method not in LINE_SEARCH_METHODS:
        raise CurvlabError(f"unknown method {method!r}")
    n = np.array([spec.m, spec.q - spec.m], dtype=float)
    w = np.array([spec.w_H, spec.w_L])
    s = np.array([spec.sigma_H, spec.sigma_L])
    y = np.zeros(2)
    traj = Trajectory(method)

    def value(y):
        return float((n * (-s * y + 0.5 * w * y * y)).sum())

    traj.loss.append(value(y))
    for _ in range(steps):
        r = s - w * y
        z = r if method == "gd" else np.sign(r)
        zz, zhz, rz = (n * z * z).sum(), (n * w * z * z).sum(), (n * r * z).sum()
        if zz == 0:
            break
        eta = rz / zhz
        y = y + eta * z
        traj.nds.append(zhz / zz)
        traj.step_norm.append(abs(eta) * math.sqrt(zz))
        traj.first_order.append(eta * rz)
        traj.loss.append(value(y))
    return traj


def optimal_loss(spec: TwoLevelSpec) -> float:
    """min Q = -½ Σ σ_i² / w_i over the paired modes."""
    return -0.5 * (spec.m * spec.sigma_H**2 / spec.w_H + (spec.q - spec.m) * spec.sigma_L**2 / spec.w_L)


def muon_nds(spec: TwoLevelSpec) -> float:
    """Muon's NDS at every step: α w_H + (1 - α) w_L."""
    return spec.alpha * spec.w_H + (1 - spec.alpha) * spec.w_L


def muon_contraction(spec: TwoLevelSpec) -> float:
    """Γ², Muon's per-step suboptimality ratio, Γ = |m w_H - (q-m) w_L| / (m w_H + (q-m) w_L)."""
    num = abs(spec.m * spec.w_H - (spec.q - spec.m) * spec.w_L)
    return (num / (spec.m * spec.w_H + (spec.q - spec.m) * spec.w_L)) ** 2


def gd_contraction(spec: TwoLevelSpec, P: float) -> float:
    """C(P) = (w_H - w_L)² P (1 - P) / (w_L + (w_H - w_L) P)², with P the high-curvature share of
    ||G||²: GD's suboptimality contracts by C(P) C(1 - P) every two steps (docs/science.md section 7).

    C(P) alone is not a one-step ratio (it can exceed 1); each single step contracts by
    (w_H - w_L)² P(1 - P) / ((w_L + (w_H - w_L) P)(w_H - (w_H - w_L) P)) (Kantorovich), which is the
    same for P and 1 - P, so the two forms agree over every two steps."""
    d = spec.w_H - spec.w_L
    return d * d * P * (1 - P) / (spec.w_L + d * P) ** 2


def gd_initial_share(spec: TwoLevelSpec) -> float:
    """P_0: the high-curvature share of ||G||² (the first GD direction is G)."""
    hi = spec.m * spec.sigma_H**2
    return hi / (hi + (spec.q - spec.m) * spec.sigma_L**2)


def theorem_condition(spec: TwoLevelSpec) -> bool:
    """Theorem 5.5 (ii)'s sufficient condition for Muon's loss to stay below GD's at every step:
    ρ + 1 > 1/α > 1 + σ_H/σ_L, under the theorem's alignment assumption σ_H >= σ_L.

    The alignment is part of it: with σ_H < σ_L the inequalities often hold while Muon stays above
    GD (a random sweep found that in every such case; with σ_H >= σ_L, in none of 4035)."""
    inv = 1 / spec.alpha
    return spec.sigma_H >= spec.sigma_L and spec.rho + 1 > inv > 1 + spec.sigma_H / spec.sigma_L
