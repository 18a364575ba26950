r"""Polar factors :math:`\operatorname{msign}(X) = U V^\top` for :math:`X = U S V^\top`, exact and approximate.

Muon orthogonalizes its momentum with a few steps of an odd matrix polynomial,
:math:`X \leftarrow a X + (b A + c A^2) X` with :math:`A = X X^\top`, which maps each singular value
:math:`\sigma` through :math:`p(\sigma) = a\sigma + b\sigma^3 + c\sigma^5` and leaves U, V alone.

* ``"svd"``: the exact polar factor (computed in float64); on a rank-deficient matrix, the partial
  isometry :math:`U_r V_r^\top` of its nonzero singular values.
* ``"newton_schulz"``: Keller Jordan's quintic (3.4445, -4.7750, 2.0315), 5 steps, after dividing by
  the Frobenius norm; singular values land in roughly [0.7, 1.1], not at 1 (docs/science.md section 9).
* ``"polar_express"``: Amsel et al. (2025): a different minimax-optimal quintic at every step, for a
  composition that lands closer to 1 in the same number of steps; input divided by 1.02·||X||_F.

Nothing here writes into its input: ``torch.optim.Muon`` (torch 2.13) normalizes in place, which for
bf16 parameters without Nesterov silently rescales the momentum buffer itself.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import Tensor

from curvlab.errors import CurvlabError

POLAR_METHODS = ("svd", "newton_schulz", "polar_express")
NEWTON_SCHULZ_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
POLAR_EXPRESS_NORMALIZATION = 1.02  # divide by 1.02·||X||_F, matching the safety margin below


def _odd_quintic(coefficients: tuple[float, float, float], x: float) -> float:
    a, b, c = coefficients
    return a * x + b * x**3 + c * x**5


def optimal_odd_quintic(lower: float, upper: float, tol: float = 1e-15) -> tuple[float, float, float]:
    r"""The odd quintic :math:`p(x) = ax + bx^3 + cx^5` minimizing :math:`\max_{x\in[l,u]} |1 - p(x)|`.

    Remez exchange: the optimum equioscillates on four points :math:`l < q < r < u` (with signs
    +, -, +, -), so solve the 4x4 linear system for (a, b, c, E) on the current points, move q and r
    to the critical points of p (roots of :math:`a + 3bx^2 + 5cx^4`), repeat until E settles.
    """
    if not 0 < lower <= upper:
        raise CurvlabError(f"need 0 < lower <= upper, got [{lower}, {upper}]")
    if lower / upper >= 1 - 5e-6:  # degenerate interval: the limit of the equioscillating family
        return 15 / 8 / upper, -10 / 8 / upper**3, 3 / 8 / upper**5
    q, r = (3 * lower + upper) / 4, (lower + 3 * upper) / 4
    error = math.inf
    for _ in range(100):
        points = np.array([lower, q, r, upper])
        system = np.stack([points, points**3, points**5, np.array([1.0, -1.0, 1.0, -1.0])], axis=1)
        a, b, c, new_error = np.linalg.solve(system, np.ones(4))
        disc = 9 * b * b - 20 * a * c
        if disc < 0:
            break
        q, r = np.sqrt((-3 * b + np.array([-1.0, 1.0]) * math.sqrt(disc)) / (10 * c))
        done = abs(new_error - error) <= tol
        error = new_error
        if done:
            break
    return float(a), float(b), float(c)


@functools.lru_cache(maxsize=32)
def polar_express_coefficients(
    steps: int = 5, lower: float = 1e-3, safety: float = 2e-2, cushion: float = 0.02
) -> tuple[tuple[float, float, float], ...]:
    r"""Per-step quintic coefficients of Polar Express (Amsel, Persson, Musco, Gower 2025).

    The singular values start in :math:`[l, 1]`. Each step takes the optimal quintic on
    :math:`[\max(l, \text{cushion}\cdot u), u]` (the cushion keeps it from spending its degree on
    tiny singular values), rescales it so that :math:`p(l)` and :math:`p(u)` sit symmetrically
    around 1, and, on all but the last step, divides its argument by :math:`1 + \text{safety}`
    so that bf16 rounding can't push values past the interval. The new interval is
    :math:`[p(l), 2 - p(l)]`. The defaults are the 5-step design used by modded-nanogpt and Dion.
    """
    if steps < 1:
        raise CurvlabError(f"steps must be >= 1, got {steps}")
    lo, hi = lower, 1.0
    out = []
    for step in range(steps):
        coeffs = optimal_odd_quintic(max(lo, cushion * hi), hi)
        if cushion * hi > lo:
            k = 2 / (_odd_quintic(coeffs, lo) + _odd_quintic(coeffs, hi))
            coeffs = tuple(k * x for x in coeffs)
        if step < steps - 1:
            s = 1 + safety
            coeffs = (coeffs[0] / s, coeffs[1] / s**3, coeffs[2] / s**5)
        out.append(coeffs)
        lo = _odd_quintic(coeffs, lo)
        hi = 2 - lo
    return tuple(out)


def _polynomial_steps(x: Tensor, schedule) -> Tensor:
    """Apply ``X <- aX + (bA + cA²)X``, A = XXᵀ, for each (a, b, c); x has rows <= cols."""
    for a, b, c in schedule:
        if x.dim() == 2:  # addmm: the same kernels, so the same bits, as torch.optim.Muon
            gram = x @ x.T
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
        else:
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def msign(
    X: Tensor,
    *,
    polar: str = "newton_schulz",
    steps: int | None = None,
    dtype: torch.dtype | None = None,
    coefficients: tuple[float, float, float] | None = None,
    eps: float = 1e-7,
) -> Tensor:
    r"""The (approximate) polar factor :math:`U V^\top` of a matrix, or of each matrix in a batch.

    Args:
        X: ``(..., rows, cols)``; never modified.
        polar: the polar method (:data:`POLAR_METHODS`), ``"svd"`` (exact), ``"newton_schulz"`` or
            ``"polar_express"`` (the name Muon's ``polar`` option and the shadow settings give it).
        steps: iterations (default 5; ignored by ``"svd"``).
        dtype: dtype of the iteration (default bfloat16, as Muon runs it); ``"svd"`` always uses float64.
        coefficients: a fixed (a, b, c) for ``"newton_schulz"`` (default Keller Jordan's quintic).
        eps: floor of the Frobenius norm that the input is divided by.

    Returns:
        A tensor shaped like ``X``, in ``X``'s dtype when that is float32/float64, else float32
        (a bf16 result is upcast, which is exact).
    """
    if polar not in POLAR_METHODS:
        raise CurvlabError(f"unknown polar method {polar!r}; choose one of {', '.join(POLAR_METHODS)}")
    if X.dim() < 2:
        raise CurvlabError(f"msign needs a matrix or a batch of matrices, got shape {tuple(X.shape)}")
    if X.shape[-1] == 0 or X.shape[-2] == 0:
        raise CurvlabError(f"msign of an empty matrix (shape {tuple(X.shape)})")
    out_dtype = X.dtype if X.dtype in (torch.float32, torch.float64) else torch.float32
    if polar == "svd":
        U, S, Vh = torch.linalg.svd(X.double(), full_matrices=False)
        # Zero singular values map to 0 (as any odd polynomial maps them): their singular vectors are
        # arbitrary. "Zero" is below numpy's matrix_rank tolerance in the input's precision.
        eps = torch.finfo(X.dtype if X.is_floating_point() else torch.float64).eps
        keep = S.amax(dim=-1, keepdim=True) * max(X.shape[-2:]) * eps < S
        return ((U * keep.unsqueeze(-2)) @ Vh).to(out_dtype)
    steps = 5 if steps is None else steps
    if polar == "newton_schulz":
        schedule = [coefficients or NEWTON_SCHULZ_COEFFICIENTS] * steps
    else:
        schedule = polar_express_coefficients(steps)
    dtype = torch.bfloat16 if dtype is None else dtype
    shape = X.shape
    x = X.to(dtype).reshape(-1, *shape[-2:]) if X.dim() > 3 else X.to(dtype)
    tall = shape[-2] > shape[-1]
    if tall:
        x = x.mT
    norm = x.norm(dim=(-2, -1), keepdim=True) if x.dim() > 2 else x.norm()
    x = x / (norm.clamp(min=eps) if polar == "newton_schulz" else norm * POLAR_EXPRESS_NORMALIZATION + eps)
    x = _polynomial_steps(x, schedule)
    if tall:
        x = x.mT
    return x.reshape(shape).to(out_dtype)
