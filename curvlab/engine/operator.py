r"""One symmetric linear operator on flat vectors, torch-native, on the parameters' device and dtype.

:class:`Operator` is all that the spectral estimators (:mod:`curvlab.curvature.spectral`) see:

* ``op @ x`` or ``op.matvec(x)`` for one vector ``x`` of length ``dim``;
* ``op @ X`` or ``op.matmat(X)`` for the K columns of ``X`` (``dim × K``) in one call (for the
  Hessian, one vectorized HVP call);
* ``op.to_scipy()``: the same operator as a ``scipy.sparse.linalg.LinearOperator``, for ``eigsh``,
  ``lobpcg``, ``cg`` and friends.

The Hessian (:func:`hessian_operator`), its principal block :math:`H_{SS}`, a dense matrix
(:meth:`Operator.from_matrix`) and a diagonally preconditioned operator (:func:`preconditioned_operator`)
are all this one class, living on one device in one dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from scipy.sparse.linalg import LinearOperator
from torch import Tensor

from curvlab.engine import params as param_dicts
from curvlab.engine.dtensors import any_dtensor
from curvlab.engine.hvp import DEFAULT_METHOD, CurvaturePoint, check_method
from curvlab.engine.loss import LossFn
from curvlab.errors import CurvlabError

Matmat = Callable[[Tensor], Tensor]


class Operator:
    r"""A symmetric linear operator :math:`A: \mathbb{R}^{dim} \to \mathbb{R}^{dim}` on ``device`` in ``dtype``.

    Args:
        dim: the length of the flat vectors it acts on.
        matmat: ``X (dim, K) -> A X (dim, K)``, called with ``X`` already on ``device`` in ``dtype``.
        device: where ``matmat`` computes.
        dtype: the precision ``matmat`` computes in.

    ``num_matvecs`` counts the products taken (a matmat of K columns counts K).
    """

    def __init__(self, dim: int, matmat: Matmat, *, device: torch.device | str, dtype: torch.dtype):
        if dim < 1:
            raise CurvlabError("the operator has no dimensions (an empty block?)")
        self.dim, self.device, self.dtype = int(dim), torch.device(device), dtype
        self._matmat = matmat
        self.num_matvecs = 0

    @property
    def shape(self) -> tuple[int, int]:
        return (self.dim, self.dim)

    def matmat(self, X: Tensor) -> Tensor:
        """:math:`A X` for the columns of ``X`` (``dim × K``), in one call."""
        if X.dim() != 2 or X.shape[0] != self.dim:
            raise CurvlabError(f"the operator takes ({self.dim}, K) columns, got shape {tuple(X.shape)}")
        self.num_matvecs += X.shape[1]
        return self._matmat(X.to(device=self.device, dtype=self.dtype))

    def matvec(self, x: Tensor) -> Tensor:
        """:math:`A x` for one flat vector ``x`` of length ``dim``."""
        if x.dim() != 1:
            raise CurvlabError(f"matvec takes a flat vector of length {self.dim}, got shape {tuple(x.shape)}")
        return self.matmat(x[:, None])[:, 0]

    def __matmul__(self, X: Tensor) -> Tensor:
        return self.matvec(X) if X.dim() == 1 else self.matmat(X)

    def to_scipy(self) -> Any:
        """This operator as a ``scipy.sparse.linalg.LinearOperator`` (float64 when the operator is,
        else float32), e.g. ``eigsh(op.to_scipy(), k=1)``. Each product moves its vectors to the
        operator's device and the result back to the host."""

        np_dtype = np.float64 if self.dtype == torch.float64 else np.float32

        def matmat(X: np.ndarray) -> np.ndarray:
            X = torch.as_tensor(np.asarray(X, dtype=np_dtype), device=self.device).reshape(self.dim, -1)
            return self.matmat(X).cpu().numpy().astype(np_dtype, copy=False)

        def matvec(x: np.ndarray) -> np.ndarray:
            return matmat(np.asarray(x).reshape(-1, 1)).reshape(-1)

        return LinearOperator(self.shape, matvec, matvec, matmat, np_dtype, matmat)  # symmetric: A^T = A

    @classmethod
    def from_matrix(cls, A: Tensor) -> Operator:
        """A dense symmetric matrix (symmetry is the caller's promise) as an operator on its device and dtype."""
        if A.dim() != 2 or A.shape[0] != A.shape[1]:
            raise CurvlabError(f"a square matrix is needed, got shape {tuple(A.shape)}")
        return cls(A.shape[0], lambda X: A @ X, device=A.device, dtype=A.dtype)

    def __repr__(self) -> str:
        return f"Operator(dim={self.dim}, device={self.device}, dtype={self.dtype}, num_matvecs={self.num_matvecs})"


def preconditioned_operator(op: Operator, diagonal: Tensor) -> Operator:
    r""":math:`P^{-1/2} A P^{-1/2}` for a positive diagonal P (flat, in the operator's order), whose
    largest eigenvalue is the preconditioned sharpness of a method that steps :math:`-\eta P^{-1} g`.

    Args:
        op: the symmetric operator A (e.g. :func:`hessian_operator`).
        diagonal: P's diagonal, a flat positive tensor of the operator's size, in its parameter order.

    Returns:
        The :class:`Operator` :math:`x \mapsto P^{-1/2} A (P^{-1/2} x)`.
    """
    if diagonal.numel() != op.dim:
        raise CurvlabError(f"the preconditioner has {diagonal.numel()} entries, the operator {op.dim}")
    if not (diagonal > 0).all():
        raise CurvlabError("the preconditioner must be positive")
    s = diagonal.reshape(-1, 1).to(device=op.device, dtype=op.dtype).rsqrt()
    return Operator(op.dim, lambda X: s * op.matmat(s * X), device=op.device, dtype=op.dtype)


def flat_matmat(
    stacked_hvps: Callable[[param_dicts.Params], param_dicts.Params], params: Mapping[str, Tensor], names: Sequence[str]
) -> Matmat:
    r"""Turn HVPs of K stacked directions into the flat ``matmat(X) = H_SS X`` over the parameters ``names``:
    each column of ``X`` (``n_S × K``, in the order of ``names``) is one direction touching only ``names``,
    all K through one ``stacked_hvps`` call."""
    sizes = [params[n].numel() for n in names]

    def matmat(X: Tensor) -> Tensor:
        k = X.shape[1]
        vs = {n: piece.reshape(k, *params[n].shape) for n, piece in zip(names, X.T.split(sizes, dim=1))}
        hv = stacked_hvps(vs)
        return torch.cat([hv[n].reshape(k, -1) for n in names], dim=1).T

    return matmat


def hessian_operator(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    *,
    method: str = DEFAULT_METHOD,
    dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
    scope: str | Sequence[str] = "all",
) -> Operator:
    r"""The Hessian :math:`H = \nabla^2 L(W)` over the flattened parameters as an :class:`Operator`.

    ``op @ x`` is one exact HVP and ``op @ X`` one per column of X, all at one
    :class:`~curvlab.engine.hvp.CurvaturePoint` built here: the forward pass and first backward run once
    for the operator's whole life (with ``"rev_rev"`` its graphs are kept until the operator is dropped).

    Args:
        loss_fn: as for :func:`curvlab.engine.hvp.hvp`.
        params: as for :func:`curvlab.engine.hvp.hvp` (not modified).
        batch: as for :func:`curvlab.engine.hvp.hvp`.
        method: the HVP method, ``"rev_rev"`` (double backward, default) or ``"fwd_rev"`` (jvp of grad).
        dtype: computation dtype (default float32, or float64 when the parameters are).
        chunk_size: columns per vectorized call (bounds memory; ``None`` = all at once).
        scope: ``"all"`` (default: every parameter, in ``params``' order, as
            :func:`curvlab.engine.params.flatten` lays them out) or parameter names S: the principal block
            :math:`H_{SS}`, flattened in their order.

    Returns:
        An operator on the parameters' device, in ``dtype``.
    """
    check_method(method)
    names = _scope_names(params, scope)
    _check_flat(params)
    return hessian_operator_at(
        CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype, chunk_size=chunk_size), scope=names
    )


def hessian_operator_at(point: CurvaturePoint, *, scope: str | Sequence[str] = "all") -> Operator:
    r""":func:`hessian_operator` at a :class:`~curvlab.engine.hvp.CurvaturePoint`: its HVPs as an
    :class:`Operator`, answering products only while the point is open.

    Args:
        point: the point (its parameters, batch, HVP method, dtype and chunk size).
        scope: ``"all"`` or parameter names, as for :func:`hessian_operator`.

    Returns:
        An operator on the parameters' device, in the point's dtype.

    Raises:
        CurvlabError: unknown names, sharded parameters, or parameters on several devices.
    """
    p = point.params
    names, device = _scope_names(p, scope), _check_flat(p)
    dim = sum(p[n].numel() for n in names)
    return Operator(dim, flat_matmat(point.hvps, p, names), device=device, dtype=point.dtype)


def _scope_names(params: Mapping[str, Tensor], scope: str | Sequence[str]) -> list[str]:
    if isinstance(scope, str) and scope != "all":
        raise CurvlabError(
            f"hessian_operator takes scope 'all' or parameter names, got {scope!r} (the hidden matrices: "
            "scope=curvlab.hidden_matrices(params, model=model))"
        )
    names = list(params) if scope == "all" else list(scope)
    unknown = [n for n in names if n not in params]
    if unknown:
        raise CurvlabError(f"the block names unknown parameters: {param_dicts.names_text(unknown)}")
    if not names:
        raise CurvlabError("the block names no parameter")
    return names


def _check_flat(params: Mapping[str, Tensor]) -> torch.device:
    """The one device of unsharded ``params``, where a flat operator over them lives."""
    if any_dtensor(params.values()):
        raise CurvlabError(
            "hessian_operator works on flat vectors of unsharded parameters; for sharded ones use "
            "CurvaturePoint.hvps, or curvlab.curvature.sharded_spectral's sharded_lanczos and sharded_hutchinson"
        )
    devices = {t.device for t in params.values()}
    if len(devices) != 1:
        raise CurvlabError(f"the parameters lie on {len(devices)} devices; the operator needs them on one")
    return devices.pop()
