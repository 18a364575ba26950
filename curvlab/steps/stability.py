r"""Edge-of-stability quantities at one point: injected sharp directions, Muon's preconditioned sharpness
and the momentum methods' stability thresholds (all of them together:
:func:`curvlab.steps.stability_point.stability_point`).

**Injected sharp direction.** For a direction Z and the top eigenpair :math:`(\lambda_1, v_1)` of H
(:math:`\|v_1\| = 1`), :math:`Z' = Z + c\,v_1` has

.. math::
    \operatorname{NDS}(Z') = \frac{\langle Z,HZ\rangle + 2c\,\langle v_1,HZ\rangle + c^2\lambda_1}
                                  {\langle Z,Z\rangle + 2c\,\langle v_1,Z\rangle + c^2}

(with :math:`\langle v_1,Hv_1\rangle = \lambda_1`, which holds for *any* unit :math:`v_1` when
:math:`\lambda_1` is taken as its Rayleigh quotient, :attr:`InjectionScalars.vhv`). Asking for
:math:`\operatorname{NDS}(Z') = t = r\,\operatorname{NDS}(Z)` is the quadratic
:math:`(\lambda_1 - t)c^2 + 2\beta c + (\langle Z,HZ\rangle - t\langle Z,Z\rangle) = 0`,
:math:`\beta = \langle v_1,HZ\rangle - t\langle v_1,Z\rangle`. For :math:`r > 1`,
:math:`\operatorname{NDS}(Z) > 0` and :math:`\lambda_1 > t` the constant term is negative and the leading
one positive: always two real roots, one of each sign. :func:`injection_coefficient` returns the root of
smallest :math:`|c|` (signed): the smallest change of Z that reaches the ratio, and the same :math:`Z'`
whichever sign the eigensolver gave :math:`v_1` (flipping it flips c); for :math:`\beta \ge 0` the
non-negative root (when :math:`\beta = 0`, Z ⟂ v_1, the roots are ±c).

**Muon's preconditioner.** Muon steps :math:`-\eta\,s\,\operatorname{msign}(\tilde B)` on a hidden matrix,
:math:`\tilde B` its Nesterov-averaged momentum (:func:`nesterov_momenta`) and s its shape scale
(:func:`~curvlab.optim.muon.muon_scale`). With :math:`\tilde B = U \Sigma V^\top` and the polar method
mapping each singular value :math:`\sigma \mapsto \varphi(\sigma)`, :math:`\operatorname{msign}(\tilde B)
= U\varphi(\Sigma)V^\top = \bigl(U\,\varphi(\Sigma)\Sigma^{-1}U^\top\bigr)\tilde B` for rows <= cols (and
:math:`\tilde B\,\bigl(V\varphi(\Sigma)\Sigma^{-1}V^\top\bigr)` for a tall matrix). Frozen at the point,
that is the linear, symmetric, positive semi-definite preconditioner

.. math::
    P^{-1}: X \mapsto s\,U g(\Sigma) U^\top X \ \text{(rows <= cols)},\qquad
            X \mapsto s\,X\,V g(\Sigma) V^\top \ \text{(rows > cols)},\qquad g(\sigma) = \varphi(\sigma)/\sigma,

which for the exact polar factor is :math:`s(\tilde B\tilde B^\top)^{-1/2}`, and maps :math:`\tilde B` to
the step's direction exactly: :math:`P^{-1}\tilde B = s\,\operatorname{msign}(\tilde B)`. g is the polar
method's own map, from a float64 SVD of :math:`\tilde B` (an eigendecomposition of :math:`\tilde B\tilde
B^\top` would lose half the digits of the small singular values):

* ``"svd"`` (exact): :math:`g = 1/\sigma` above :func:`~curvlab.optim.polar.msign`'s own rank floor,
  :math:`\sigma > \sigma_{\max}\max(r, c)\,\epsilon`, and 0 below it, as msign: never a huge gain on a
  null direction;
* ``"newton_schulz"`` and ``"polar_express"``: :math:`\varphi` is the composition of the iteration's odd
  quintics on :math:`\sigma/N` (N the Frobenius normalization msign divides by), so
  :math:`g(\sigma) = \prod_k (a_k + b_k y_k^2 + c_k y_k^4) / N` with :math:`y_0 = \sigma/N`,
  :math:`y_{k+1} = p_k(y_k)`: bounded as :math:`\sigma \to 0` (:math:`\prod_k a_k / N`), so no floor is
  needed. The polynomials are evaluated in float64 (Muon's bfloat16 rounding is not linear: left out).

The preconditioned sharpness is :math:`\lambda_{\max}(P^{-1/2} H_{hh} P^{-1/2})` on the hidden matrices
(:func:`muon_preconditioned_operator`), against Muon's own threshold (:func:`muon_edge_of_stability`).

**Thresholds.** On a 1-D quadratic :math:`L = \lambda x^2/2` with :math:`h = \eta\lambda`, Muon's momentum
(:math:`b \leftarrow \mu b + (1-\mu)g`, :math:`u = (1-\mu)g + \mu b`, :math:`x \leftarrow x - \eta u`) is
linear in :math:`(x, \eta b)` with matrix :math:`\begin{psmallmatrix}1-(1-\mu^2)h & -\mu^2\\ (1-\mu)h &
\mu\end{psmallmatrix}`: trace :math:`T = 1 + \mu - (1-\mu^2)h`, determinant :math:`D = \mu - \mu(1-\mu)h`.
Jury's conditions :math:`1 - T + D = (1-\mu)h > 0`, :math:`|D| < 1` (:math:`h < (1+\mu)/(\mu(1-\mu))`) and
:math:`1 + T + D = 2(1+\mu) - (1-\mu)(1+2\mu)h > 0`; the last binds, so it is stable iff

.. math::  \eta\lambda < \frac{2(1+\mu)}{(1-\mu)(1+2\mu)}

(2 at μ = 0, 26.9 at μ = 0.95). Heavy ball with the same EMA (:math:`x \leftarrow x - \eta b`) has
:math:`D = \mu` and threshold :math:`(2+2\mu)/(1-\mu)`: Adam's (:func:`~curvlab.optim.adam.adam_edge_of_stability`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from curvlab.curvature.spectral import EigenResult, lanczos
from curvlab.engine import params as param_dicts
from curvlab.engine.hvp import DEFAULT_METHOD, CurvaturePoint
from curvlab.engine.loss import LossFn
from curvlab.engine.operator import Operator, hessian_operator
from curvlab.errors import CurvlabError
from curvlab.optim.adam import adam_edge_of_stability
from curvlab.optim.muon import as_matrices, matrix_shape, muon_scale
from curvlab.optim.polar import (
    NEWTON_SCHULZ_COEFFICIENTS,
    POLAR_EXPRESS_NORMALIZATION,
    POLAR_METHODS,
    polar_express_coefficients,
)
from curvlab.util.codec import Record

UNIT_TOLERANCE = 1e-4  # |<v1, v1> - 1| accepted as a unit vector (a float32 Lanczos vector is unit to ~1e-7)

# -- injected sharp direction ------------------------------------------------------------------------


def _finite(**values: float) -> None:
    bad = [k for k, v in values.items() if not math.isfinite(v)]
    if bad:
        raise CurvlabError(f"non-finite {', '.join(bad)}: no injected direction")


def injected_nds(zhz: float, zz: float, vz: float, vhz: float, lam1: float, c: float) -> float:
    r"""The NDS of :math:`Z' = Z + c\,v_1` in closed form (module docstring), from
    :math:`\langle Z,HZ\rangle`, :math:`\langle Z,Z\rangle`, :math:`\langle v_1,Z\rangle`,
    :math:`\langle v_1,HZ\rangle` and :math:`\lambda_1 = \langle v_1,Hv_1\rangle`, for a unit :math:`v_1`.

    Raises:
        CurvlabError: non-finite input, or :math:`Z' = 0`.
    """
    _finite(zhz=zhz, zz=zz, vz=vz, vhz=vhz, lam1=lam1, c=c)
    den = zz + 2 * c * vz + c * c
    if not den > 0:
        raise CurvlabError(f"Z + c v1 is zero (||Z'||² = {den:.3g}): its NDS is undefined")
    return (zhz + 2 * c * vhz + c * c * lam1) / den


def injection_coefficient(zhz: float, zz: float, vz: float, vhz: float, lam1: float, ratio: float) -> float:
    r"""The c with :math:`\operatorname{NDS}(Z + c\,v_1) = r\,\operatorname{NDS}(Z)`, r = ``ratio`` >= 1:
    the root of smallest :math:`|c|`, signed (module docstring), by the cancellation-free quadratic formula.

    Raises:
        CurvlabError: a zero direction, ratio < 1, :math:`\operatorname{NDS}(Z) \le 0`, or
            :math:`\lambda_1 \le r\,\operatorname{NDS}(Z)` (no multiple of v_1 reaches it: NDS(Z') < λ_1).
    """
    _finite(zhz=zhz, zz=zz, vz=vz, vhz=vhz, lam1=lam1, ratio=ratio)
    if not zz > 0:
        raise CurvlabError("the direction is zero: NDS = <Z,HZ>/||Z||² is undefined")
    if not ratio >= 1:
        raise CurvlabError(f"the injected ratio must be >= 1, got {ratio}")
    nds = zhz / zz
    if not nds > 0:
        raise CurvlabError(f"NDS(Z) = {nds:.6g} <= 0: no ratio of it can be injected")
    if ratio == 1:
        return 0.0
    t = ratio * nds
    a = lam1 - t
    if not a > 0:
        raise CurvlabError(
            f"lambda_1 = {lam1:.6g} <= {ratio:g} × NDS(Z) = {t:.6g}: no multiple of v1 reaches the ratio"
        )
    beta = vhz - t * vz
    const = zhz - t * zz  # < 0: r > 1 and NDS(Z) > 0
    disc = beta * beta - a * const
    if not disc >= 0:  # (cannot happen when a > 0 > const; kept for rounding)
        raise CurvlabError(f"no real c reaches ratio {ratio:g} (discriminant {disc:.3g})")
    q = -(beta + math.copysign(math.sqrt(disc), beta))  # |q| >= sqrt(disc): no cancellation
    return const / q  # the smaller root in magnitude (the other is q / a)


def inject(z: Mapping[str, Tensor], v1: Mapping[str, Tensor], c: float) -> param_dicts.Params:
    r""":math:`Z + c\,v_1`, key by key, in Z's dtype (summed in float64)."""
    param_dicts.check_like(z, v1, "v1")
    return {k: (t.double() + c * v1[k].double()).to(t.dtype) for k, t in z.items()}


@dataclass(frozen=True)
class InjectionScalars(Record):
    r"""The inner products the injected direction needs: :math:`\langle Z,HZ\rangle`, :math:`\langle Z,Z\rangle`,
    :math:`\langle v_1,Z\rangle`, :math:`\langle v_1,HZ\rangle` and :math:`\langle v_1,Hv_1\rangle`
    (the λ_1 to use: exact for any unit v_1)."""

    zhz: float
    zz: float
    vz: float
    vhz: float
    vhv: float

    @property
    def nds(self) -> float:
        return self.zhz / self.zz

    def coefficient(self, ratio: float) -> float:
        """:func:`injection_coefficient` with λ_1 = ⟨v1, H v1⟩."""
        return injection_coefficient(self.zhz, self.zz, self.vz, self.vhz, self.vhv, ratio)

    def nds_at(self, c: float) -> float:
        """:func:`injected_nds` with λ_1 = ⟨v1, H v1⟩."""
        return injected_nds(self.zhz, self.zz, self.vz, self.vhz, self.vhv, c)


def injection_scalars(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    v1: Mapping[str, Tensor],
    *,
    dtype: torch.dtype | None = None,
    method: str = DEFAULT_METHOD,
) -> InjectionScalars:
    """:class:`InjectionScalars` of a direction ``z`` and a unit vector ``v1`` (dicts like ``params``), by
    two HVPs at one :class:`~curvlab.engine.hvp.CurvaturePoint`.

    Raises:
        CurvlabError: z or v1 mismatched with the parameters or non-finite, z zero, v1 not a unit vector.
    """
    param_dicts.check_like(params, z, "direction")
    param_dicts.check_like(params, v1, "v1")
    with CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype) as point:
        zc, vc = param_dicts.cast(z, point.dtype), param_dicts.cast(v1, point.dtype)
        zz, vv = param_dicts.dot(zc, zc), param_dicts.dot(vc, vc)
        if zz == 0:
            raise CurvlabError("the direction is zero: NDS = <Z,HZ>/||Z||² is undefined")
        if abs(vv - 1) > UNIT_TOLERANCE:
            raise CurvlabError(f"v1 must be a unit vector, ||v1||² = {vv:.6g}")
        hz, hv = point.hvp_each([zc, vc])
        return InjectionScalars(
            param_dicts.dot(zc, hz), zz, param_dicts.dot(vc, zc), param_dicts.dot(vc, hz), param_dicts.dot(vc, hv)
        )


# -- Muon's preconditioner -----------------------------------------------------------------------------


def nesterov_momenta(
    buffers: Mapping[str, Tensor | None], gradients: Mapping[str, Tensor], momentum: float, nesterov: bool = True
) -> param_dicts.Params:
    r"""The matrices Muon's next step orthogonalizes, as :class:`~curvlab.optim.muon.Muon` computes them:
    :math:`B \leftarrow \operatorname{lerp}(B, G, 1-\mu)`, then :math:`\tilde B = \operatorname{lerp}(G, B, \mu)`
    (Nesterov) or B. ``buffers`` are the momentum buffers (``None`` or missing: zeros, as a first step has);
    the result is in each buffer's dtype (the gradient's where there is none), on its device."""
    if not 0 <= momentum < 1:
        raise CurvlabError(f"the momentum must lie in [0, 1), got {momentum}")
    out = {}
    for name, g in gradients.items():
        buf = buffers.get(name)
        buf = torch.zeros_like(g) if buf is None else buf
        if tuple(buf.shape) != tuple(g.shape):
            raise CurvlabError(f"the momentum of {name!r} has shape {tuple(buf.shape)}, its gradient {tuple(g.shape)}")
        g = g.detach().to(device=buf.device, dtype=buf.dtype)
        b = buf.detach().lerp(g, 1 - momentum)
        out[name] = g.lerp(b, momentum) if nesterov else b
    return out


@dataclass(frozen=True)
class MuonFactor:
    r"""Muon's frozen preconditioner on one matrix: :math:`P^{-1} X = Q\,\operatorname{diag}(g)\,Q^\top X`
    (``side="left"``, rows <= cols) or :math:`X\,Q\,\operatorname{diag}(g)\,Q^\top` (``"right"``), with
    ``basis`` Q (n × n orthogonal, n = min(rows, cols), float64) and ``gains`` g >= 0 (the shape scale
    included); ``shape`` is the stored tensor's (acting as rows × rest). A stack (``stacked``: an MoE's
    fused experts, shape (m, rows, ...)) has ``basis`` (m, n, n), ``gains`` (m, n): block-diagonal."""

    shape: tuple[int, ...]
    side: str
    basis: Tensor = field(repr=False, compare=False)
    gains: Tensor = field(repr=False, compare=False)
    scale: float
    stacked: bool = False

    @property
    def lead(self) -> tuple[int, ...]:
        """The stack's count, ``(m,)``, or ``()`` for one matrix."""
        return self.shape[:1] if self.stacked else ()

    @property
    def rows(self) -> int:
        return self.shape[len(self.lead)]

    @property
    def cols(self) -> int:
        return math.prod(self.shape[len(self.lead) + 1 :])

    def matrix(self, power: float = 1.0) -> Tensor:
        r""":math:`Q\,\operatorname{diag}(g^{p})\,Q^\top` (n × n, or m × n × n for a stack; float64):
        :math:`P^{-p}`, e.g. :math:`P^{-1/2}`."""
        return (self.basis * self.gains.pow(power).unsqueeze(-2)) @ self.basis.mT

    def apply(self, X: Tensor, power: float = 1.0) -> Tensor:
        """:math:`P^{-p}` applied to X, a tensor of ``shape`` or a stack of them ``(..., *shape)``, in X's dtype."""
        lead = X.shape[: X.dim() - len(self.shape)]
        if tuple(X.shape[len(lead) :]) != self.shape:
            raise CurvlabError(f"the preconditioner acts on shape {self.shape}, got {tuple(X.shape)}")
        M = X.reshape(-1, *self.lead, self.rows, self.cols)
        R = self.matrix(power).to(device=X.device, dtype=X.dtype)
        return (R @ M if self.side == "left" else M @ R).reshape(X.shape)


def _polar_gains(
    S: Tensor, shape: tuple[int, int], rank_dtype: torch.dtype, polar: str, steps: int, coefficients, eps: float
) -> Tensor:
    r""":math:`g(\sigma) = \varphi(\sigma)/\sigma` of the polar method on the singular values S (float64;
    ``(..., n)``, each row one matrix's)."""
    if polar == "svd":  # msign's own rank floor: below it the singular value goes to 0, so does the gain
        keep = S.amax(dim=-1, keepdim=True) * max(shape) * torch.finfo(rank_dtype).eps < S
        return torch.where(keep, 1 / torch.where(keep, S, 1.0), 0.0)
    frobenius = S.pow(2).sum(dim=-1, keepdim=True).sqrt()
    if polar == "newton_schulz":
        schedule = [tuple(coefficients or NEWTON_SCHULZ_COEFFICIENTS)] * steps
        norm = frobenius.clamp(min=eps)  # msign: x / ||x||_F.clamp(min=eps)
    else:
        schedule = polar_express_coefficients(steps)
        norm = frobenius * POLAR_EXPRESS_NORMALIZATION + eps
    y, gain = S / norm, torch.ones_like(S)
    for a, b, c in schedule:  # p(y) = y (a + b y² + c y⁴): the factor is p(y)/y, defined at y = 0
        f = a + b * y * y + c * y.pow(4)
        gain, y = gain * f, y * f
    if not bool((gain >= 0).all()):
        raise CurvlabError(f"the {polar} polynomials flip a singular value's sign: no positive preconditioner")
    return gain / norm


def muon_factor(
    momentum: Tensor,
    scale: float,
    polar: str = "newton_schulz",
    steps: int = 5,
    coefficients: tuple[float, float, float] | None = None,
    eps: float = 1e-7,
    stacked: bool = False,
) -> MuonFactor:
    r""":class:`MuonFactor` of one momentum matrix :math:`\tilde B` (rows × rest; with ``stacked``, a 3-D
    stack) and its shape scale s (:func:`~curvlab.optim.muon.muon_scale`), for the polar method with
    msign's settings (module docstring).

    Raises:
        CurvlabError: an unknown polar method, a non-matrix, a non-finite or all-zero momentum.
    """
    if polar not in POLAR_METHODS:
        raise CurvlabError(f"unknown polar method {polar!r}; choose one of {', '.join(POLAR_METHODS)}")
    if momentum.dim() < 2:
        raise CurvlabError(f"Muon's preconditioner acts on matrices, got shape {tuple(momentum.shape)}")
    if not bool(torch.isfinite(momentum).all()):
        raise CurvlabError("the momentum holds non-finite values (NaN or inf)")
    if not bool(momentum.any()):
        raise CurvlabError("the momentum is zero: Muon's step is 0 and its preconditioner undefined")
    if stacked and momentum.dim() != 3:
        raise CurvlabError(f"a stack of matrices is 3-D, got shape {tuple(momentum.shape)}")
    B = as_matrices(momentum.detach(), matrix_shape(momentum, stacked=stacked)).double()
    U, S, Vh = torch.linalg.svd(B, full_matrices=False)
    rank_dtype = momentum.dtype if momentum.is_floating_point() else torch.float64
    gains = float(scale) * _polar_gains(S, tuple(B.shape[-2:]), rank_dtype, polar, steps, coefficients, eps)
    left = B.shape[-2] <= B.shape[-1]
    side, basis = ("left", U) if left else ("right", Vh.mT)
    return MuonFactor(tuple(momentum.shape), side, basis, gains, float(scale), stacked)


def muon_preconditioner(
    momenta: Mapping[str, Tensor],
    scale: str = "original",
    *,
    shapes: Mapping[str, tuple[int, int]] | None = None,
    polar: str = "newton_schulz",
    steps: int = 5,
    coefficients: tuple[float, float, float] | None = None,
    eps: float = 1e-7,
) -> dict[str, MuonFactor]:
    r"""Muon's frozen preconditioner on each matrix of ``momenta`` (name -> :math:`\tilde B`), in their order:
    :func:`muon_factor` with the shape scale ``scale`` of each matrix's (out, in) shape, ``shapes[name]``
    (default the stored rows × rest; (m, out, in): a stack of m matrices)."""
    if not momenta:
        raise CurvlabError("no momentum matrices given")
    out = {}
    for name, B in momenta.items():
        shape = tuple(shapes[name]) if shapes is not None and name in shapes else matrix_shape(B)
        out[name] = muon_factor(B, muon_scale(shape, scale), polar, steps, coefficients, eps, len(shape) == 3)
    return out


def muon_preconditioned_operator(h_hidden: Operator, factors: Mapping[str, MuonFactor]) -> Operator:
    r""":math:`P^{-1/2} H P^{-1/2}` for Muon's frozen P on the hidden matrices: ``h_hidden`` is their
    Hessian block (flat in ``names``' order, each tensor row-major) and ``factors`` the :class:`MuonFactor`
    of each, in the same order. Its largest eigenvalue is Muon's preconditioned sharpness."""
    if not factors:
        raise CurvlabError("no Muon factors given")
    sizes = [math.prod(f.shape) for f in factors.values()]
    if sum(sizes) != h_hidden.dim:
        raise CurvlabError(f"the Muon factors cover {sum(sizes)} entries, the operator {h_hidden.dim}")
    roots = [f.matrix(0.5).to(device=h_hidden.device, dtype=h_hidden.dtype) for f in factors.values()]
    layout = [((*f.lead, f.rows, f.cols), f.side == "left") for f in factors.values()]

    def half(X: Tensor) -> Tensor:  # P^{-1/2} on each column, matrix by matrix
        k = X.shape[1]
        pieces = []
        for (shape, left), R, piece in zip(layout, roots, X.split(sizes, dim=0)):
            M = piece.T.reshape(k, *shape)
            pieces.append((R @ M if left else M @ R).reshape(k, -1).T)
        return torch.cat(pieces, dim=0)

    return Operator(
        h_hidden.dim, lambda X: half(h_hidden.matmat(half(X))), device=h_hidden.device, dtype=h_hidden.dtype
    )


def muon_preconditioned_sharpness(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    momenta: Mapping[str, Tensor],
    *,
    scale: str = "original",
    shapes: Mapping[str, tuple[int, int]] | None = None,
    polar: str = "newton_schulz",
    steps: int = 5,
    coefficients: tuple[float, float, float] | None = None,
    eps: float = 1e-7,
    dtype: torch.dtype | None = None,
    method: str = DEFAULT_METHOD,
    max_iter: int = 60,
    tol: float = 1e-6,
    seed: int = 0,
    memory: int | None = None,
) -> EigenResult:
    r""":math:`\lambda_{\max}(P^{-1/2} H_{hh} P^{-1/2})` by :func:`~curvlab.curvature.spectral.lanczos`, over
    the matrices of ``momenta`` (name -> :math:`\tilde B`), with Muon's frozen preconditioner
    (:func:`muon_preconditioner`). The eigenvector is in the preconditioned coordinates.

    Raises:
        CurvlabError: a momentum naming no parameter or shaped unlike it, and :func:`muon_factor`'s errors.
    """
    names = list(momenta)
    unknown = [n for n in names if n not in params]
    if unknown:
        raise CurvlabError(f"the momenta name unknown parameters: {param_dicts.names_text(unknown)}")
    for n in names:
        if tuple(momenta[n].shape) != tuple(params[n].shape):
            shape, want = tuple(momenta[n].shape), tuple(params[n].shape)
            raise CurvlabError(f"the momentum of {n!r} has shape {shape}, the parameter {want}")
    factors = muon_preconditioner(
        momenta, scale, shapes=shapes, polar=polar, steps=steps, coefficients=coefficients, eps=eps
    )
    H = hessian_operator(loss_fn, params, batch, method=method, dtype=dtype, scope=names)
    return lanczos(muon_preconditioned_operator(H, factors), k=1, max_iter=max_iter, tol=tol, seed=seed, memory=memory)


# -- thresholds ----------------------------------------------------------------------------------------


def muon_edge_of_stability(lr: float, momentum: float, *, nesterov: bool = True) -> float:
    r"""The largest sharpness (of :math:`P^{-1/2}HP^{-1/2}`) at which Muon's momentum is stable on a quadratic
    (module docstring): :math:`2(1+\mu)/((1-\mu)(1+2\mu)\eta)` with Nesterov, heavy ball's without
    (:func:`~curvlab.optim.adam.adam_edge_of_stability`)."""
    if not nesterov:
        return adam_edge_of_stability(lr, momentum)
    if not lr > 0:
        raise CurvlabError(f"the learning rate must be positive for an edge of stability, got {lr}")
    if not 0 <= momentum < 1:
        raise CurvlabError(f"the momentum must lie in [0, 1), got {momentum}")
    return 2 * (1 + momentum) / ((1 - momentum) * (1 + 2 * momentum) * lr)


# -- from an optimizer's state --------------------------------------------------------------------------


def _principal_block(op: Operator, sizes: Mapping[str, int], subset: Sequence[str]) -> Operator:
    """The block of ``op`` (flat over ``sizes``' names, in order) on ``subset``: zero-padded products, by
    slices (each parameter is contiguous in the layout: no index vector as long as the block)."""
    offsets, at = {}, 0
    for n, size in sizes.items():
        offsets[n], at = at, at + size
    if at != op.dim:
        raise CurvlabError(f"the parameters named cover {at} entries, the operator {op.dim}")
    spans = [(offsets[n], sizes[n]) for n in subset]

    def matmat(X: Tensor) -> Tensor:
        padded = X.new_zeros((op.dim, X.shape[1]))
        for (start, size), piece in zip(spans, X.split([s for _, s in spans], dim=0)):
            padded[start : start + size] = piece
        out = op.matmat(padded)
        return torch.cat([out[start : start + size] for start, size in spans], dim=0)

    return Operator(sum(size for _, size in spans), matmat, device=op.device, dtype=op.dtype)


def is_muon_group(group: Mapping[str, Any]) -> bool:
    """Whether a param group is Muon's (curvlab's or torch's: it has Newton–Schulz settings)."""
    return "ns_steps" in group and "momentum" in group


class MuonSharpness(NamedTuple):
    r"""Muon's preconditioned sharpness beside its threshold at the group's lr, with the eigenvalue's true
    residual :math:`\|A u - \theta u\|` and whether Lanczos converged."""

    sharpness: float
    edge_of_stability: float
    lr: float
    residual: float
    converged: bool


def muon_sharpness(
    op: Operator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    hidden: Sequence[str],
    names: Sequence[str],
    gradient: Mapping[str, Tensor],
    *,
    max_iter: int = 60,
    tol: float = 1e-6,
    seed: int = 0,
    memory: int | None = None,
    relative_to: str = "spectrum",
) -> MuonSharpness:
    r"""Muon's preconditioned sharpness from an optimizer's state, on the block ``hidden`` of ``op`` (the
    Hessian over ``names``), with :math:`\tilde B` = :func:`nesterov_momenta` of the state's buffers and
    ``gradient``, each group's polar settings, and :func:`muon_edge_of_stability` at the groups' settings;
    ``relative_to`` as for :func:`~curvlab.curvature.spectral.lanczos`.

    Raises:
        CurvlabError: a hidden matrix outside Muon's groups, or groups that disagree on lr, momentum, nesterov.
    """
    table = dict(model.named_parameters())
    missing = [n for n in (*names, *hidden) if n not in table]
    if missing:
        raise CurvlabError(f"the model has no parameters {param_dicts.names_text(missing)}")
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    groups = {n: group_of.get(id(table[n])) for n in hidden}
    outside = [n for n, g in groups.items() if g is None or not is_muon_group(g)]
    if outside:
        raise CurvlabError(f"{param_dicts.names_text(outside)} not in a Muon group: no Muon preconditioner there")
    settings = {(float(g["lr"]), float(g["momentum"]), bool(g["nesterov"])) for g in groups.values()}
    if len(settings) != 1:
        raise CurvlabError(f"Muon's sharpness needs one lr, momentum and nesterov, found {len(settings)} sets")
    lr, mu, nesterov = settings.pop()
    buffers = {n: optimizer.state.get(table[n], {}).get("momentum_buffer") for n in hidden}
    momenta = nesterov_momenta(buffers, {n: gradient[n] for n in hidden}, mu, nesterov)
    factors = {}
    for n in hidden:
        g = groups[n]
        stacked = g.get("stacked", False)
        shape = matrix_shape(table[n], g.get("transposed", False), stacked)
        polar = (g.get("polar", "newton_schulz"), g["ns_steps"], tuple(g["ns_coefficients"]), g["eps"])
        factors[n] = muon_factor(momenta[n], muon_scale(shape, g.get("scale", "original")), *polar, stacked)
    block = _principal_block(op, {n: table[n].numel() for n in names}, hidden)
    eig = {"max_iter": max_iter, "tol": tol, "seed": seed, "memory": memory, "relative_to": relative_to}
    top = lanczos(muon_preconditioned_operator(block, factors), **eig)
    edge = muon_edge_of_stability(lr, mu, nesterov=nesterov)
    return MuonSharpness(float(top.eigenvalues[0]), edge, lr, float(top.residuals[0]), top.converged)
