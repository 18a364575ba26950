r"""NDS, the second-order Taylor split and the layer-block interaction matrix (SCIENCE.md sections 1-2).

For parameters W, a step Z (so that :math:`W_\text{next} = W - Z`), gradient G and Hessian H on a batch:

.. math::
    I_1 = \langle G, Z\rangle,\qquad I_2 = \tfrac12 \langle Z, H[Z]\rangle,\qquad
    \Delta_D = L(W) - L(W - Z) \approx I_1 - I_2,\qquad
    \mathrm{NDS} = \frac{\langle Z, H[Z]\rangle}{\|Z\|_F^2}.

Blocks :math:`Z = (Z_1, \dots, Z_L)` give the interaction matrix
:math:`M_{lm} = \langle Z_l, H_{lm}[Z_m]\rangle / \|Z\|^2`, symmetric with entries summing to NDS;
its trace is the within-layer NDS and its off-diagonal sum the cross-layer NDS.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.func import grad_and_value, jvp, vmap

from curvlab import params as P
from curvlab.blocks import group_parameters, hidden_matrices, model_of
from curvlab.distributed import all_reduce_sum
from curvlab.errors import CurvlabError
from curvlab.exact_ops import exact_second_order
from curvlab.hvp import (
    _check_finite_loss,
    _scalar_loss,
    evaluate_loss,
    gradient_and_hvps,
    shared_batches,
    working_dtype,
)
from curvlab.loss import LossFn

BLOCK_METHODS = ("hvp", "alpha")


@dataclass(frozen=True)
class TaylorScope:
    """The Taylor split of one step over one set of parameters (all, or a subset S with Z_S = Z on S, 0 elsewhere).

    Attributes:
        first_order: :math:`I_1 = \\langle G_S, Z_S\\rangle`.
        curvature_penalty: :math:`I_2 = \\tfrac12\\langle Z_S, H[Z_S]\\rangle`.
        predicted: :math:`I_1 - I_2`.
        realized: :math:`L(W) - L(W - Z_S)`.
        nds: :math:`\\langle Z_S, H[Z_S]\\rangle / \\|Z_S\\|^2`.
        update_norm, grad_norm: :math:`\\|Z_S\\|_F`, :math:`\\|G_S\\|_F`.
        cosine: :math:`I_1 / (\\|G_S\\|\\,\\|Z_S\\|)`.
    """

    first_order: float
    curvature_penalty: float
    predicted: float
    realized: float
    nds: float
    update_norm: float
    grad_norm: float
    cosine: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


@dataclass(frozen=True)
class TaylorSplit(TaylorScope):
    """:class:`TaylorScope` over all parameters, plus ``loss`` = L(W) and the same split over ``subset``
    (by default the hidden 2-D matrices; ``None`` when the model has none)."""

    loss: float = float("nan")
    subset: TaylorScope | None = None
    subset_names: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in TaylorScope.__dataclass_fields__}
        out["loss"] = self.loss
        out["subset"] = None if self.subset is None else self.subset.to_dict()
        out["subset_names"] = list(self.subset_names)
        return out


def _check_direction(params: Mapping[str, Tensor], z: Mapping[str, Tensor], what: str = "direction") -> float:
    P.check_like(params, z, what)
    norm = P.norm(z)
    if norm == 0.0:
        raise CurvlabError(f"the {what} is zero: NDS = <Z,HZ>/||Z||² is undefined")
    return norm


def _subset_direction(
    params: Mapping[str, Tensor], z: P.Params, subset: Sequence[str] | None, model=None
) -> tuple[list[str], P.Params | None]:
    """The subset's names (default: the hidden matrices) and Z_S (Z there, 0 elsewhere), or ``None``
    for Z_S when the subset is empty or is every parameter (the full scope already covers it)."""
    names = hidden_matrices(params, model) if subset is None else list(subset)
    unknown = [n for n in names if n not in params]
    if unknown:
        raise CurvlabError(f"subset names unknown parameters: {unknown[:3]}")
    if not names or set(names) == set(params):
        return names, None
    z_sub = P.restrict(z, names)
    if P.norm(z_sub) == 0.0:
        raise CurvlabError("the update direction is zero on the subset: its NDS is undefined")
    return names, z_sub


def _scope(loss: float, g: P.Params, z: P.Params, hz: P.Params, stepped_loss: float, keys) -> TaylorScope:
    keys = list(keys)
    gz = P.dot(g, z, keys)
    zhz = P.dot(z, hz, keys)
    zz = P.dot(z, z, keys)
    gnorm = P.norm(g, keys)
    znorm = zz**0.5
    return TaylorScope(
        first_order=gz,
        curvature_penalty=0.5 * zhz,
        predicted=gz - 0.5 * zhz,
        realized=loss - stepped_loss,
        nds=zhz / zz,
        update_norm=znorm,
        grad_norm=gnorm,
        cosine=gz / (gnorm * znorm) if gnorm > 0 else float("nan"),
    )


def taylor_split(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    subset: Sequence[str] | None = None,
    dtype: torch.dtype | None = None,
) -> TaylorSplit:
    r"""The second-order Taylor split of the step :math:`W \to W - Z`, over all parameters and over ``subset``.

    One vectorized call gives L(W), G, H[Z] and H[Z_S] (two HVPs sharing the primal pass); two more
    loss evaluations give :math:`L(W - Z)` and :math:`L(W - Z_S)`.

    Args:
        z: the step Z, a dict like ``params`` (e.g. from :func:`~curvlab.optim.next_update`).
        subset: parameter names of the second scope; default the hidden matrices
            (:func:`~curvlab.blocks.hidden_matrices`: by role when ``loss_fn`` has a ``.model``). Pass
            ``[]`` to skip it.
        batch: one batch, or several (accumulated with loss-term weights).

    Raises:
        CurvlabError: Z mismatched with the parameters, non-finite, or zero (NDS undefined).
    """
    _check_direction(params, z, "update direction")
    dt = working_dtype(params, dtype)
    z = P.cast(z, dt)
    names, z_sub = _subset_direction(params, z, subset, model_of(loss_fn))
    use_subset = z_sub is not None
    directions = [z] + ([z_sub] if use_subset else [])
    stacked = {n: torch.stack([d[n] for d in directions]) for n in params}
    loss, g, hv = gradient_and_hvps(loss_fn, params, batch, stacked, dtype=dt)
    p = P.cast(params, dt)
    full = _scope(
        loss, g, z, {n: t[0] for n, t in hv.items()}, evaluate_loss(loss_fn, P.add(p, z, -1.0), batch), params
    )
    sub = None
    if use_subset:
        stepped = evaluate_loss(loss_fn, P.add(p, z_sub, -1.0), batch)
        sub = _scope(loss, g, z_sub, {n: t[1] for n, t in hv.items()}, stepped, names)
    elif names:
        sub = full
    return TaylorSplit(**full.to_dict(), loss=loss, subset=sub, subset_names=tuple(names))


@dataclass(frozen=True)
class BlockMatrix:
    r"""The block interaction matrix of a step and what follows from it.

    Attributes:
        names: block names, in order.
        matrix: :math:`M_{lm} = \langle Z_l, H_{lm}[Z_m]\rangle / \|Z\|^2`, L x L, symmetrized.
        within: :math:`\operatorname{tr} M` (within-layer NDS, over the full :math:`\|Z\|^2`).
        cross: sum of the off-diagonal entries (cross-layer NDS).
        nds: sum of all entries, the NDS of Z.
        rho_within: within / nds.
        first_order: per block :math:`\langle G_l, Z_l\rangle`.
        norm: per block :math:`\|Z_l\|_F`.
        block_nds: per block :math:`\langle Z_l, H_{ll} Z_l\rangle / \|Z_l\|^2` (NaN where Z_l = 0).
        asymmetry: :math:`\max|M - M^\top| / \max|M|` before symmetrizing (a rounding diagnostic).
        members: the parameter names of each block.
    """

    names: tuple[str, ...]
    matrix: np.ndarray
    within: float
    cross: float
    nds: float
    rho_within: float
    first_order: np.ndarray
    norm: np.ndarray
    block_nds: np.ndarray
    asymmetry: float
    members: dict[str, list[str]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "names": list(self.names),
            "matrix": self.matrix.tolist(),
            "within": self.within,
            "cross": self.cross,
            "nds": self.nds,
            "rho_within": self.rho_within,
            "first_order": self.first_order.tolist(),
            "norm": self.norm.tolist(),
            "block_nds": [None if np.isnan(x) else float(x) for x in self.block_nds],
            "asymmetry": self.asymmetry,
            "members": self.members,
        }


def _block_hessian_by_hvps(loss_fn, params, batch, z, members, chunk_size, dt):
    """(G, R) with R[l, m] = <Z_l, H[Z_m]_l>: one HVP per block, Z_m padded with zeros, vmapped in chunks."""
    blocks = list(members.values())
    L = len(blocks)
    step = L if chunk_size is None else max(1, chunk_size)
    R = np.zeros((L, L))
    g = None
    for start in range(0, L, step):
        chunk = blocks[start : start + step]
        stacked = {n: torch.stack([z[n] if n in set(b) else torch.zeros_like(z[n]) for b in chunk]) for n in params}
        _, g, hv = gradient_and_hvps(loss_fn, params, batch, stacked, dtype=dt)
        for j in range(len(chunk)):
            hz = {n: t[j] for n, t in hv.items()}
            for lidx, b in enumerate(blocks):
                R[lidx, start + j] = P.dot(z, hz, b)
    return g, R


def _block_hessian_by_alpha(loss_fn, params, batch, z, members, chunk_size, dt):
    r"""(G·Z per block, R) from the Hessian in :math:`\alpha` of :math:`L(W + \sum_l \alpha_l Z_l)` at 0,
    by forward-over-reverse (``jvp`` of ``grad`` in the L-dimensional :math:`\alpha`), vmapped over the
    basis vectors. Exact through LayerNorm, unlike ``torch.func.hessian`` (jacrev of jacrev) on torch 2.13."""
    block_of = {n: i for i, b in enumerate(members.values()) for n in b}
    L = len(members)
    index = {n: block_of[n] for n in params}
    eye = torch.eye(L, dtype=dt)
    step = L if chunk_size is None else max(1, chunk_size)
    R = torch.zeros(L, L, dtype=torch.float64)
    gz = torch.zeros(L, dtype=torch.float64)
    pairs, reduce = shared_batches(batch, loss_fn)
    with exact_second_order():
        for b, w in pairs:
            f = _scalar_loss(loss_fn, b)

            def f_alpha(alpha, f=f):
                return f({n: params[n] + alpha[index[n]] * z[n] for n in params})

            def column(e, f_alpha=f_alpha):
                (grad_a, loss), (hess_col, _) = jvp(grad_and_value(f_alpha), (torch.zeros(L, dtype=dt),), (e,))
                return loss, grad_a, hess_col

            cols = []
            for s in range(0, L, step):
                loss, grad_a, part = vmap(column, out_dims=(None, None, 0))(eye[s : s + step])
                cols.append(part)
            _check_finite_loss(loss)
            R += w * torch.cat(cols).double().T
            gz += w * grad_a.double()
    if reduce:  # in place
        all_reduce_sum(R), all_reduce_sum(gz)
    return gz.numpy(), R.numpy()


def block_matrix(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    blocks: str | Mapping[str, Sequence[str]] = "layer",
    method: str = "hvp",
    chunk_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> BlockMatrix:
    r"""The block interaction matrix :math:`M_{lm} = \langle Z_l, H_{lm}[Z_m]\rangle / \|Z\|^2`, exactly.

    Args:
        z: the step Z.
        blocks: ``"layer"``, ``"tensor"``, ``"kind"``, or ``{block: [parameter names or globs]}``
            (see :func:`~curvlab.blocks.group_parameters`).
        method: ``"hvp"`` (one HVP per block, H applied to Z_m padded with zeros, vmapped) or
            ``"alpha"`` (the Hessian in α of :math:`L(W + \sum_l \alpha_l Z_l)`, which is
            :math:`M\|Z\|^2`, by forward-over-reverse). Both are exact; ``"hvp"`` is the default.
        chunk_size: blocks per vectorized call (bounds memory).

    Raises:
        CurvlabError: Z mismatched, non-finite or zero; a grouping that leaves a parameter out or
            claims one twice; an unknown method.
    """
    if method not in BLOCK_METHODS:
        raise CurvlabError(f"unknown block-matrix method {method!r}; choose one of {', '.join(BLOCK_METHODS)}")
    _check_direction(params, z, "update direction")
    members = group_parameters(params.keys(), blocks, model_of(loss_fn))
    dt = working_dtype(params, dtype)
    p = P.cast(params, dt)
    zc = P.cast(z, dt)
    if method == "hvp":
        g, R = _block_hessian_by_hvps(loss_fn, p, batch, zc, members, chunk_size, dt)
        first = np.array([P.dot(g, zc, b) for b in members.values()])
    else:
        first, R = _block_hessian_by_alpha(loss_fn, p, batch, zc, members, chunk_size, dt)
    return _assemble(members, zc, first, R)


def _assemble(members: dict[str, list[str]], z: P.Params, first: np.ndarray, R: np.ndarray) -> BlockMatrix:
    """A :class:`BlockMatrix` from R[l, m] = <Z_l, H[Z_m]_l> and the per-block first-order terms."""
    zz = P.dot(z, z)
    scale = max(np.abs(R).max(), np.finfo(float).tiny)
    asymmetry = float(np.abs(R - R.T).max() / scale)
    M = 0.5 * (R + R.T) / zz
    norms = np.array([P.norm(z, b) for b in members.values()])
    with np.errstate(divide="ignore", invalid="ignore"):
        own = np.where(norms > 0, np.diag(M) * zz / norms**2, np.nan)
    nds = float(M.sum())
    within = float(np.trace(M))
    return BlockMatrix(
        names=tuple(members),
        matrix=M,
        within=within,
        cross=nds - within,
        nds=nds,
        rho_within=within / nds if nds != 0 else float("nan"),
        first_order=first,
        norm=norms,
        block_nds=own,
        asymmetry=asymmetry,
        members=members,
    )


def taylor_split_and_block_matrix(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    blocks: str | Mapping[str, Sequence[str]] = "layer",
    subset: Sequence[str] | None = None,
    chunk_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[TaylorSplit, BlockMatrix]:
    r""":func:`taylor_split` and :func:`block_matrix` (method ``"hvp"``) of one step, sharing one
    vectorized call: the L padded block directions and :math:`Z_S`, with :math:`H[Z] = \sum_m H[Z_m]`
    by linearity. L + 1 HVPs and one gradient instead of L + 2 HVPs and two gradients."""
    _check_direction(params, z, "update direction")
    members = group_parameters(params.keys(), blocks, model_of(loss_fn))
    dt = working_dtype(params, dtype)
    p, zc = P.cast(params, dt), P.cast(z, dt)
    names, z_sub = _subset_direction(params, zc, subset, model_of(loss_fn))
    use_subset = z_sub is not None
    directions = [P.restrict(zc, b) for b in members.values()] + ([z_sub] if use_subset else [])
    stacked = {n: torch.stack([d[n] for d in directions]) for n in params}
    loss, g, hv = gradient_and_hvps(loss_fn, p, batch, stacked, chunk_size=chunk_size, dtype=dt)
    L = len(members)
    R = np.array([[P.dot(zc, {n: t[m] for n, t in hv.items()}, b) for m in range(L)] for b in members.values()])
    hz = {n: t[:L].sum(0) for n, t in hv.items()}
    stepped = evaluate_loss(loss_fn, P.add(p, zc, -1.0), batch)
    full = _scope(loss, g, zc, hz, stepped, params)
    sub = None
    if use_subset:
        sub_stepped = evaluate_loss(loss_fn, P.add(p, z_sub, -1.0), batch)
        sub = _scope(loss, g, z_sub, {n: t[L] for n, t in hv.items()}, sub_stepped, names)
    elif names:
        sub = full
    split = TaylorSplit(**full.to_dict(), loss=loss, subset=sub, subset_names=tuple(names))
    first = np.array([P.dot(g, zc, b) for b in members.values()])
    return split, _assemble(members, zc, first, R)
