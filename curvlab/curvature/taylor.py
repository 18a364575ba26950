r"""NDS, the second-order Taylor split and the layer-block interaction matrix (docs/science.md sections 1-2).

For parameters W, a step Z (so that :math:`W_\text{next} = W - Z`), gradient G and Hessian H on a batch:

.. math::
    I_1 = \langle G, Z\rangle,\qquad I_2 = \tfrac12 \langle Z, H[Z]\rangle,\qquad
    \Delta_D = L(W) - L(W - Z) \approx I_1 - I_2,\qquad
    \mathrm{NDS} = \frac{\langle Z, H[Z]\rangle}{\|Z\|_F^2}.

Blocks :math:`Z = (Z_1, \dots, Z_L)` give the interaction matrix
:math:`M_{lm} = \langle Z_l, H_{lm}[Z_m]\rangle / \|Z\|^2`, symmetric with entries summing to NDS;
its trace is the within-layer NDS and its off-diagonal sum the cross-layer NDS.

Every function takes ``(loss_fn, params, batch, z)`` positionally and its options by keyword only, and
each has its ``_at(point, z, ...)`` twin for a :class:`~curvlab.engine.hvp.CurvaturePoint` already built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from curvlab.curvature.groupings import group_parameters, model_of
from curvlab.curvature.scope import DirectionCurvature, ScopeCurvature, scope_names
from curvlab.engine import params as param_dicts
from curvlab.engine.dtensors import all_finite, any_dtensor
from curvlab.engine.hvp import DEFAULT_METHOD, CurvaturePoint, working_dtype
from curvlab.engine.loss import LossFn
from curvlab.errors import CurvlabError
from curvlab.util.codec import Record, meta

BLOCK_METHODS = ("hvp", "alpha")
"""The block-matrix methods (``block_method=``): ``"hvp"``, one HVP per block at one point, or ``"alpha"``, the
Hessian in α of L(W + Σ_l α_l Z_l); both exact."""
Scope = str | Sequence[str] | None  # "hidden", "all", parameter names, or None (see curvlab.curvature.scope)


@dataclass(frozen=True)
class TaylorSplit(DirectionCurvature):
    """The :class:`~curvlab.curvature.scope.DirectionCurvature` of a step over all parameters, plus ``loss`` =
    L(W) and the same over the second scope, ``hidden``. JSON: the eight quantities, ``loss`` and ``hidden``
    (the eight and ``names``, or null), the keys of a curvature report.

    Attributes:
        loss: :math:`L(W)` at the point (NaN where not evaluated).
        hidden: the :class:`~curvlab.curvature.scope.DirectionCurvature` of the step over the second scope,
            with its parameter ``names`` (``None`` when the scope is empty or skipped).
    """

    loss: float = float("nan")
    hidden: ScopeCurvature | None = None

    @property
    def hidden_names(self) -> tuple[str, ...]:
        """The second scope's parameter names (``()`` without one)."""
        return () if self.hidden is None else self.hidden.names


def _checked(
    params: Mapping[str, Tensor], z: Mapping[str, Tensor], dtype: torch.dtype, what: str = "direction"
) -> tuple[param_dicts.Params, dict[str, float]]:
    r"""Z checked against the parameters and cast to ``dtype``, with its squared norm per parameter: one
    float64 pass, non-finite when an entry is (or float64 overflows), so only then are the entries searched.

    Raises:
        CurvlabError: Z mismatched with the parameters, non-finite (in its dtype or once cast to ``dtype``),
            too large for its squared norm in float64, or zero.
    """
    param_dicts.check_like(params, z, what, finite=False)
    zc = param_dicts.cast(z, dtype)
    keys = list(params)
    squares = param_dicts.dot_table([(zc, zc)], keys)[:, 0]
    if not torch.isfinite(squares).all():
        param_dicts.check_like(params, z, what)
        for n, t in zc.items():
            if not all_finite([t]):
                raise CurvlabError(f"{what}[{n!r}] holds values beyond the range of {dtype}, its working dtype")
        raise CurvlabError(f"the {what}'s squared norm overflows float64: its entries are too large")
    if float(squares.sum()) == 0.0:
        raise CurvlabError(f"the {what} is zero: NDS = <Z,HZ>/||Z||² is undefined")
    return zc, dict(zip(keys, squares.tolist()))


def _scope_names(point: CurvaturePoint, scope: Scope) -> list[str]:
    """The second scope's names (the hidden matrices by role when the loss function carries its model)."""
    return scope_names(scope, point.params, model_of(point.loss_fn))


def _split(
    point: CurvaturePoint,
    z: param_dicts.Params,
    squares: Mapping[str, float],
    zhz: float,
    names: list[str],
    zhz_sub: float | None,
) -> TaylorSplit:
    r"""The :class:`TaylorSplit` of Z from :math:`\langle Z, H[Z]\rangle` and, for a proper second scope S,
    :math:`\langle Z_S, H[Z_S]\rangle`; the first-order sums of both scopes from one table over the keys."""
    p, loss, g = point.params, point.loss, point.gradient
    keys = list(p)
    table = param_dicts.dot_table([(g, z), (g, g)], keys)  # per key: <G, Z>, <G, G>

    def curvature(group: list[str], zhz: float, stepped: param_dicts.Params) -> DirectionCurvature:
        gz, gg = param_dicts.group_sums(table, keys, [group])[0].tolist()
        zz = sum(squares[n] for n in group)
        return DirectionCurvature.of(gz, zhz, zz, gg, loss - point.loss_at(stepped))

    stepped = {n: w - z[n] for n, w in p.items()}
    full = curvature(keys, zhz, stepped)
    sub = full if names else None
    if zhz_sub is not None:
        inside = set(names)
        # W - Z_S is W - Z on S and W elsewhere: its tensors are those two's, with nothing new to allocate
        sub = curvature(names, zhz_sub, {n: stepped[n] if n in inside else w for n, w in p.items()})
    hidden = None if sub is None else ScopeCurvature(**vars(sub), names=tuple(names))
    return TaylorSplit(**vars(full), loss=loss, hidden=hidden)


def _proper(names: list[str], params: Mapping[str, Tensor], squares: Mapping[str, float]) -> bool:
    """Whether the second scope is one of its own: not empty, not everything, and Z not zero on it."""
    if not names or set(names) == set(params):
        return False
    if sum(squares[n] for n in names) == 0.0:
        raise CurvlabError("the update direction is zero on the scope: its NDS is undefined")
    return True


def nds_at(point: CurvaturePoint, z: Mapping[str, Tensor]) -> float:
    r""":func:`nds` at a :class:`~curvlab.engine.hvp.CurvaturePoint`: one HVP there.

    Args:
        point: the point W (its loss, batch and HVP method).
        z: the direction Z, a dict like the point's parameters.

    Returns:
        The NDS :math:`\langle Z, H[Z]\rangle / \|Z\|_F^2`.
    """
    zc, squares = _checked(point.params, z, point.dtype)
    return _nds(point, zc, squares)


def _nds(point: CurvaturePoint, z: param_dicts.Params, squares: Mapping[str, float]) -> float:
    return param_dicts.dot(z, point.hvp(z)) / sum(squares.values())


def nds(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    *,
    method: str = DEFAULT_METHOD,
    dtype: torch.dtype | None = None,
) -> float:
    r"""The Normalized Directional Sharpness :math:`\langle Z, H[Z]\rangle / \|Z\|_F^2` of a direction Z
    (one HVP; :func:`taylor_split` gives it with the rest).

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or several (accumulated with loss-term weights).
        z: the direction Z, a dict like ``params``.
        method: the HVP method, ``"rev_rev"`` (default) or ``"fwd_rev"``.
        dtype: computation dtype (default float32, or float64 when the parameters are).

    Returns:
        The NDS, in loss units per squared parameter units (the scale of a Hessian eigenvalue).

    Raises:
        CurvlabError: Z mismatched with the parameters, non-finite, or zero.
    """
    zc, squares = _checked(params, z, working_dtype(params, dtype=dtype))
    with CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype) as point:
        return _nds(point, zc, squares)


def taylor_split_at(point: CurvaturePoint, z: Mapping[str, Tensor], *, scope: Scope = "hidden") -> TaylorSplit:
    r"""The second-order Taylor split of the step :math:`W \to W - Z` at a :class:`~curvlab.engine.hvp.CurvaturePoint`.

    The two curvatures come from the interactions of :math:`Z_S` and the rest :math:`Z_{\bar S}`, two second
    backwards (:meth:`~curvlab.engine.hvp.CurvaturePoint.interactions`): :math:`\langle Z_S, H[Z_S]\rangle =
    R_{SS}` and :math:`\langle Z, H[Z]\rangle = R_{SS} + 2R_{S\bar S} + R_{\bar S\bar S}`; the realized
    decreases are two more loss evaluations, :math:`L(W - Z)` and :math:`L(W - Z_S)`.

    Args:
        point: the point W (its loss, batch and HVP method).
        z: the step Z, a dict like the point's parameters.
        scope: the second scope S, the split's ``hidden``: ``"hidden"`` (default: the hidden matrices,
            which Muon updates), parameter names of your own, or ``None`` (or ``[]``) to skip it.

    Returns:
        The :class:`TaylorSplit` over all parameters, with its ``hidden`` split over ``scope``.
    """
    return _taylor_split(point, *_checked(point.params, z, point.dtype, "update direction"), scope)


def _taylor_split(
    point: CurvaturePoint, z: param_dicts.Params, squares: Mapping[str, float], scope: Scope
) -> TaylorSplit:
    """:func:`taylor_split_at` of a checked step in the point's dtype, of these squared norms per parameter."""
    names = _scope_names(point, scope)
    if not _proper(names, point.params, squares):
        return _split(point, z, squares, float(point.interactions([z])[0, 0]), names, None)
    inside = set(names)
    # S first, its second backward on every parameter, then the rest's on the rest alone, so that the hidden
    # matrices' weight adjoints (most of the matrix products) are taken once, not twice (docs/benchmarks.md)
    R = point.interactions([{n: z[n] for n in names}, {n: t for n, t in z.items() if n not in inside}])
    return _split(point, z, squares, float(R.sum()), names, float(R[0, 0]))


def taylor_split(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    *,
    scope: Scope = "hidden",
    method: str = DEFAULT_METHOD,
    dtype: torch.dtype | None = None,
) -> TaylorSplit:
    r"""The second-order Taylor split of the step :math:`W \to W - Z`, over all parameters and over ``scope``.

    At one :class:`~curvlab.engine.hvp.CurvaturePoint` (see :func:`taylor_split_at`).

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or several (accumulated with loss-term weights).
        z: the step Z, a dict like ``params`` (e.g. from :func:`~curvlab.steps.update.next_update`).
        scope: the second scope S, the split's ``hidden``: ``"hidden"`` (default: the hidden matrices,
            :func:`~curvlab.curvature.groupings.hidden_matrices`, by role when ``loss_fn`` has a ``.model``),
            parameter names of your own, or ``None`` (or ``[]``) to skip it.
        method: the HVP method, ``"rev_rev"`` (default) or ``"fwd_rev"``.
        dtype: computation dtype (default float32, or float64 when the parameters are).

    Returns:
        The :class:`TaylorSplit` over all parameters, with its ``hidden`` split over ``scope``.

    Raises:
        CurvlabError: Z mismatched with the parameters, non-finite, or zero (NDS undefined).
    """
    zc, squares = _checked(params, z, working_dtype(params, dtype=dtype), "update direction")
    with CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype) as point:
        return _taylor_split(point, zc, squares, scope)


@dataclass(frozen=True)
class BlockMatrix(Record):
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
        asymmetry: :math:`\max|M - M^\top| / \max|M|` before symmetrizing, a rounding diagnostic; NaN where
            double backward computes only the triangle.
        members: the parameter names of each block.
    """

    names: tuple[str, ...]
    matrix: np.ndarray = field(metadata=meta(dtype=float))
    within: float
    cross: float
    nds: float
    rho_within: float
    first_order: np.ndarray = field(metadata=meta(dtype=float))
    norm: np.ndarray = field(metadata=meta(dtype=float))
    block_nds: np.ndarray = field(metadata=meta(dtype=float, strict=True))  # (NaN, no block's own: null)
    asymmetry: float = field(metadata=meta(strict=True))  # (NaN, not measured on the triangle: null)
    members: dict[str, list[str]] = field(default_factory=dict)


def _block_interactions(
    point: CurvaturePoint, z: param_dicts.Params, members: Mapping[str, Sequence[str]]
) -> np.ndarray:
    """R[l, m] = <Z_l, H[Z_m]> of the blocks' parts of Z, Z_m touching only block m's parameters."""
    return point.interactions([{n: z[n] for n in names} for names in members.values()]).numpy()


def _block_matrix(
    point: CurvaturePoint,
    z: param_dicts.Params,
    squares: Mapping[str, float],
    members: dict[str, list[str]],
    R: np.ndarray,
) -> BlockMatrix:
    """The :class:`BlockMatrix` of Z from its blocks' interactions at the point (by double backward their
    triangle: its asymmetry isn't measured)."""
    keys = list(point.params)
    first = param_dicts.group_sums(
        param_dicts.dot_table([(point.gradient, z)], keys)[:, 0], keys, members.values()
    ).numpy()
    return _assemble(members, squares, first, R, measured_asymmetry=point.method != "rev_rev")


class _AlphaLoss:
    r""":math:`\alpha \mapsto L(W + \sum_l \alpha_l Z_l)`, a loss over one parameter ``alpha`` (one entry
    per block), whose Hessian at 0 is :math:`M\|Z\|^2` and whose gradient is :math:`\langle G_l, Z_l\rangle`."""

    def __init__(
        self, loss_fn: LossFn, params: param_dicts.Params, z: param_dicts.Params, members: Mapping[str, Sequence[str]]
    ):
        self.loss_fn, self.params, self.z = loss_fn, params, z
        self.block_of = {n: i for i, names in enumerate(members.values()) for n in names}
        self.model = getattr(loss_fn, "model", None)  # so that the point keeps its running statistics
        self.loss_terms = getattr(loss_fn, "loss_terms", None)  # so that batches keep their weights

    def __call__(self, a: Mapping[str, Tensor], batch: Any) -> Tensor:
        alpha = a["alpha"]
        return self.loss_fn({n: w + alpha[self.block_of[n]] * self.z[n] for n, w in self.params.items()}, batch)


def block_matrix_at(
    point: CurvaturePoint, z: Mapping[str, Tensor], *, blocks: str | Mapping[str, Sequence[str]] = "layer"
) -> BlockMatrix:
    r"""The block interaction matrix of the step Z at a :class:`~curvlab.engine.hvp.CurvaturePoint`: one HVP per
    block (see :func:`block_matrix`).

    Args:
        point: the point W (its loss, batch and HVP method).
        z: the step Z, a dict like the point's parameters.
        blocks: ``"layer"`` (default: the within/cross-layer split), ``"tensor"``, ``"kind"``, or
            ``{block: [parameter names or globs]}`` (see :func:`~curvlab.curvature.groupings.group_parameters`).

    Returns:
        The :class:`BlockMatrix` of Z.
    """
    return _block_matrix_at(point, *_checked(point.params, z, point.dtype, "update direction"), blocks)


def _block_matrix_at(point: CurvaturePoint, z: param_dicts.Params, squares: Mapping[str, float], blocks) -> BlockMatrix:
    members = group_parameters(point.params.keys(), blocks=blocks, model=model_of(point.loss_fn))
    return _block_matrix(point, z, squares, members, _block_interactions(point, z, members))


def block_matrix(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    *,
    blocks: str | Mapping[str, Sequence[str]] = "layer",
    block_method: str = "hvp",
    method: str = DEFAULT_METHOD,
    dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
) -> BlockMatrix:
    r"""The block interaction matrix :math:`M_{lm} = \langle Z_l, H_{lm}[Z_m]\rangle / \|Z\|^2`, exactly.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or several (accumulated with loss-term weights).
        z: the step Z.
        blocks: ``"layer"``, ``"tensor"``, ``"kind"``, or ``{block: [parameter names or globs]}``
            (see :func:`~curvlab.curvature.groupings.group_parameters`).
        block_method: :data:`BLOCK_METHODS`: ``"hvp"`` (default; one HVP per block at one point) or
            ``"alpha"`` (the Hessian in α of :math:`L(W + \sum_l \alpha_l Z_l)`, which is :math:`M\|Z\|^2`).
        method: the HVP method, ``"rev_rev"`` (default) or ``"fwd_rev"``.
        dtype: computation dtype (default float32, or float64 when the parameters are).
        chunk_size: directions per vectorized call (bounds memory).

    Returns:
        The :class:`BlockMatrix` of Z.

    Raises:
        CurvlabError: Z mismatched, non-finite or zero; a bad grouping; an unknown block method.
    """
    if block_method not in BLOCK_METHODS:
        raise CurvlabError(f"unknown block method {block_method!r}; choose one of {', '.join(BLOCK_METHODS)}")
    dt = working_dtype(params, dtype=dtype)
    zc, squares = _checked(params, z, dt, "update direction")
    if block_method == "hvp":
        with CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype, chunk_size=chunk_size) as point:
            return _block_matrix_at(point, zc, squares, blocks)
    if any_dtensor(params.values()):
        raise CurvlabError("block_method 'alpha' takes unsharded parameters; on sharded ones use block_method='hvp'")
    members = group_parameters(params.keys(), blocks=blocks, model=model_of(loss_fn))
    p = param_dicts.cast(params, dt)
    device = next(iter(p.values())).device
    alpha = {"alpha": torch.zeros(len(members), dtype=dt, device=device)}
    alpha_loss = _AlphaLoss(loss_fn, p, zc, members)
    with CurvaturePoint(alpha_loss, alpha, batch, method=method, dtype=dt, chunk_size=chunk_size) as point:
        R = point.hvps({"alpha": torch.eye(len(members), dtype=dt, device=device)})["alpha"]
        gz = point.gradient["alpha"]
    return _assemble(members, squares, gz.double().cpu().numpy(), R.double().cpu().numpy())


def _assemble(
    members: dict[str, list[str]],
    squares: Mapping[str, float],
    first: np.ndarray,
    R: np.ndarray,
    *,
    measured_asymmetry: bool = True,
) -> BlockMatrix:
    """A :class:`BlockMatrix` from R[l, m] = <Z_l, H[Z_m]_l>, the per-block first-order terms and Z's squared
    norm per parameter (``measured_asymmetry=False``: R was computed as a triangle)."""
    zz = sum(squares.values())
    scale = max(np.abs(R).max(), np.finfo(float).tiny)
    asymmetry = float(np.abs(R - R.T).max() / scale) if measured_asymmetry else float("nan")
    M = 0.5 * (R + R.T) / zz
    norms = np.sqrt([sum(squares[n] for n in b) for b in members.values()])
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


def taylor_split_and_block_matrix_at(
    point: CurvaturePoint,
    z: Mapping[str, Tensor],
    *,
    blocks: str | Mapping[str, Sequence[str]] = "layer",
    scope: Scope = "hidden",
) -> tuple[TaylorSplit, BlockMatrix]:
    r""":func:`taylor_split_at` and :func:`block_matrix_at` of one step at one point, sharing their second
    backwards: :math:`\langle Z, H[Z]\rangle = \sum_{lm} R_{lm}`, and when every block lies inside the
    scope S or outside it, :math:`\langle Z_S, H[Z_S]\rangle` is the sum of R over the blocks inside.

    Args:
        point: the point W (its loss, batch and HVP method).
        z: the step Z, a dict like the point's parameters.
        blocks: the grouping of :func:`block_matrix_at` (default ``"layer"``: the within/cross-layer split).
        scope: the second scope of :func:`taylor_split_at` (default ``"hidden"``: the hidden matrices).

    Returns:
        ``(split, blocks)``: the :class:`TaylorSplit` and the :class:`BlockMatrix` of Z.
    """
    return _split_and_block_matrix(point, *_checked(point.params, z, point.dtype, "update direction"), blocks, scope)


def _split_and_block_matrix(
    point: CurvaturePoint, z: param_dicts.Params, squares: Mapping[str, float], blocks, scope: Scope
) -> tuple[TaylorSplit, BlockMatrix]:
    members = group_parameters(point.params.keys(), blocks=blocks, model=model_of(point.loss_fn))
    names = _scope_names(point, scope)
    proper = _proper(names, point.params, squares)
    inside = set(names)
    R = _block_interactions(point, z, members)
    zhz_sub = None
    if proper and all(set(b) <= inside or not set(b) & inside for b in members.values()):
        within = [i for i, b in enumerate(members.values()) if set(b) <= inside]
        zhz_sub = float(R[np.ix_(within, within)].sum())
    elif proper:
        zhz_sub = float(point.interactions([{n: z[n] for n in names}])[0, 0])
    return _split(point, z, squares, float(R.sum()), names, zhz_sub), _block_matrix(point, z, squares, members, R)


def taylor_split_and_block_matrix(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    *,
    blocks: str | Mapping[str, Sequence[str]] = "layer",
    scope: Scope = "hidden",
    method: str = DEFAULT_METHOD,
    dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
) -> tuple[TaylorSplit, BlockMatrix]:
    r""":func:`taylor_split` and :func:`block_matrix` (block method ``"hvp"``) of one step, at one point
    and sharing their HVPs (:func:`taylor_split_and_block_matrix_at`).

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or several (accumulated with loss-term weights).
        z: the step Z, a dict like ``params``.
        blocks: the grouping of :func:`block_matrix` (default ``"layer"``: the within/cross-layer split).
        scope: the second scope of :func:`taylor_split` (default ``"hidden"``: the hidden matrices).
        method: the HVP method, ``"rev_rev"`` (default) or ``"fwd_rev"``.
        dtype: computation dtype (default float32, or float64 when the parameters are).
        chunk_size: directions per vectorized call (bounds memory; ``None`` = all at once).

    Returns:
        ``(split, blocks)``: the :class:`TaylorSplit` and the :class:`BlockMatrix` of Z.
    """
    zc, squares = _checked(params, z, working_dtype(params, dtype=dtype), "update direction")
    with CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype, chunk_size=chunk_size) as point:
        return _split_and_block_matrix(point, zc, squares, blocks, scope)
