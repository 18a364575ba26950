r"""NDS, the second-order Taylor split and the layer-block interaction matrix (docs/science.md sections 1-2).

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

import functools
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import torch
from torch import Tensor

from curvlab.curvature.groupings import group_parameters, hidden_matrices, model_of
from curvlab.engine import params as P
from curvlab.engine._dtensors import any_dtensor
from curvlab.engine.hvp import DEFAULT_METHOD, CurvaturePoint, working_dtype
from curvlab.engine.loss import LossFn
from curvlab.errors import CurvlabError

BLOCK_WAYS = ("hvp", "alpha")


@dataclass(frozen=True)
class TaylorScope:
    r"""The Taylor split of one step over one set of parameters (all, or a subset S with Z_S = Z on S, 0 elsewhere).

    Attributes:
        first_order: :math:`I_1 = \langle G_S, Z_S\rangle`.
        curvature_penalty: :math:`I_2 = \tfrac12\langle Z_S, H[Z_S]\rangle`.
        predicted: :math:`I_1 - I_2`.
        realized: :math:`L(W) - L(W - Z_S)`.
        nds: :math:`\langle Z_S, H[Z_S]\rangle / \|Z_S\|^2`.
        update_norm, grad_norm: :math:`\|Z_S\|_F`, :math:`\|G_S\|_F`.
        cosine: :math:`I_1 / (\|G_S\|\,\|Z_S\|)`.
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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TaylorScope:
        """The scope from :meth:`to_dict`'s keys (any others in ``d`` are ignored); null reads as NaN."""
        return cls(**{f.name: float("nan") if d[f.name] is None else float(d[f.name]) for f in fields(cls)})


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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TaylorSplit:
        subset = d.get("subset")
        return cls(
            **TaylorScope.from_dict(d).to_dict(),
            loss=float(d["loss"]),
            subset=None if subset is None else TaylorScope.from_dict(subset),
            subset_names=tuple(d.get("subset_names", ())),
        )


def _check_direction(params: Mapping[str, Tensor], z: Mapping[str, Tensor], what: str = "direction") -> float:
    P.check_like(params, z, what)
    norm = P.norm(z)
    if norm == 0.0:
        raise CurvlabError(f"the {what} is zero: NDS = <Z,HZ>/||Z||² is undefined")
    return norm


def _subset_names(point: CurvaturePoint, subset: Sequence[str] | None) -> list[str]:
    """The subset scope's names: ``subset``, or by default the hidden matrices (by role, when the
    loss function carries its model)."""
    params = point.params
    names = hidden_matrices(params, model_of(point.loss_fn)) if subset is None else list(subset)
    unknown = [n for n in names if n not in params]
    if unknown:
        raise CurvlabError(f"subset names unknown parameters: {P.names_text(unknown)}")
    return names


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


def _split(point: CurvaturePoint, z: P.Params, hz: P.Params, names: list[str], hz_sub: P.Params | None) -> TaylorSplit:
    """The :class:`TaylorSplit` from H[Z] and, for a proper non-empty subset S, H[Z_S]."""
    p, loss, g = point.params, point.loss, point.gradient
    full = _scope(loss, g, z, hz, point.loss_at(P.add(p, z, -1.0)), p)
    sub = full if names else None
    if hz_sub is not None:
        z_sub = P.restrict(z, names)
        sub = _scope(loss, g, z_sub, hz_sub, point.loss_at(P.add(p, z_sub, -1.0)), names)
    return TaylorSplit(**full.to_dict(), loss=loss, subset=sub, subset_names=tuple(names))


def _proper(names: list[str], params: Mapping[str, Tensor], z: P.Params) -> bool:
    """Whether the subset is a scope of its own: not empty, not everything, and Z not zero on it."""
    if not names or set(names) == set(params):
        return False
    if P.norm(z, names) == 0.0:
        raise CurvlabError("the update direction is zero on the subset: its NDS is undefined")
    return True


def taylor_split_at(point: CurvaturePoint, z: Mapping[str, Tensor], subset: Sequence[str] | None = None) -> TaylorSplit:
    r"""The second-order Taylor split of the step :math:`W \to W - Z` at a :class:`~curvlab.engine.hvp.CurvaturePoint`.

    :math:`H[Z]` and :math:`H[Z_S]` are two HVPs at the point (:math:`Z_S` touches only S); the
    realized decreases are two more loss evaluations, :math:`L(W - Z)` and :math:`L(W - Z_S)`.
    """
    _check_direction(point.params, z, "update direction")
    z = P.cast(z, point.dtype)
    names = _subset_names(point, subset)
    if _proper(names, point.params, z):
        hz, hz_sub = point.hvp_each([z, {n: z[n] for n in names}])
    else:
        (hz,), hz_sub = point.hvp_each([z]), None
    return _split(point, z, hz, names, hz_sub)


def nds(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    dtype: torch.dtype | None = None,
    method: str = DEFAULT_METHOD,
) -> float:
    r"""The Normalized Directional Sharpness :math:`\langle Z, H[Z]\rangle / \|Z\|_F^2` of a direction Z:
    the curvature along it, whatever its length (one HVP; :func:`taylor_split` gives it with the rest).

    Raises:
        CurvlabError: Z mismatched with the parameters, non-finite, or zero.
    """
    _check_direction(params, z, "direction")
    with CurvaturePoint(loss_fn, params, batch, method, dtype) as point:
        zc = P.cast(z, point.dtype)
        return P.dot(zc, point.hvp(zc)) / P.dot(zc, zc)


def taylor_split(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    subset: Sequence[str] | None = None,
    dtype: torch.dtype | None = None,
    method: str = DEFAULT_METHOD,
) -> TaylorSplit:
    r"""The second-order Taylor split of the step :math:`W \to W - Z`, over all parameters and over ``subset``.

    At one :class:`~curvlab.engine.hvp.CurvaturePoint` (forward and first backward once): L(W), G, H[Z] and
    H[Z_S]; two more loss evaluations give :math:`L(W - Z)` and :math:`L(W - Z_S)`.

    Args:
        z: the step Z, a dict like ``params`` (e.g. from :func:`~curvlab.optim.update.next_update`).
        subset: parameter names of the second scope; default the hidden matrices
            (:func:`~curvlab.curvature.groupings.hidden_matrices`: by role when ``loss_fn`` has a ``.model``). Pass
            ``[]`` to skip it.
        batch: one batch, or several (accumulated with loss-term weights).
        method: the HVP method, ``"rev_rev"`` (default) or ``"fwd_rev"``.

    Raises:
        CurvlabError: Z mismatched with the parameters, non-finite, or zero (NDS undefined).
    """
    _check_direction(params, z, "update direction")
    with CurvaturePoint(loss_fn, params, batch, method, dtype) as point:
        return taylor_split_at(point, z, subset)


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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BlockMatrix:
        return cls(
            names=tuple(d["names"]),
            matrix=np.asarray(d["matrix"], dtype=float).reshape(len(d["names"]), len(d["names"])),
            within=d["within"],
            cross=d["cross"],
            nds=d["nds"],
            rho_within=d["rho_within"],
            first_order=np.asarray(d["first_order"], dtype=float),
            norm=np.asarray(d["norm"], dtype=float),
            block_nds=np.array([np.nan if x is None else x for x in d["block_nds"]], dtype=float),
            asymmetry=d["asymmetry"],
            members={k: list(v) for k, v in d["members"].items()},
        )


def _block_directions(z: P.Params, members: Mapping[str, Sequence[str]]) -> list[P.Params]:
    """Z_m for each block m, as directions that touch only the block's parameters."""
    return [{n: z[n] for n in names} for names in members.values()]


def _interactions(z: P.Params, members: Mapping[str, Sequence[str]], hz_blocks: Sequence[P.Params]) -> np.ndarray:
    """R[l, m] = <Z_l, H[Z_m]_l>."""
    return np.array([[P.dot(z, hz, names) for hz in hz_blocks] for names in members.values()])


class _AlphaLoss:
    r""":math:`\alpha \mapsto L(W + \sum_l \alpha_l Z_l)`, a loss over one parameter ``alpha`` (one entry
    per block), whose Hessian at 0 is :math:`M\|Z\|^2` and whose gradient is :math:`\langle G_l, Z_l\rangle`."""

    def __init__(self, loss_fn: LossFn, params: P.Params, z: P.Params, members: Mapping[str, Sequence[str]]):
        self.loss_fn, self.params, self.z = loss_fn, params, z
        self.block_of = {n: i for i, names in enumerate(members.values()) for n in names}
        self.model = getattr(loss_fn, "model", None)  # so that the point keeps its running statistics
        self.loss_terms = getattr(loss_fn, "loss_terms", None)  # so that batches keep their weights

    def __call__(self, a: Mapping[str, Tensor], batch: Any) -> Tensor:
        alpha = a["alpha"]
        return self.loss_fn({n: w + alpha[self.block_of[n]] * self.z[n] for n, w in self.params.items()}, batch)


def block_matrix_at(
    point: CurvaturePoint, z: Mapping[str, Tensor], blocks: str | Mapping[str, Sequence[str]] = "layer"
) -> BlockMatrix:
    r"""The block interaction matrix of the step Z at a :class:`~curvlab.engine.hvp.CurvaturePoint`: one HVP per
    block, :math:`H[Z_m]` with :math:`Z_m` touching only block m (see :func:`block_matrix`)."""
    _check_direction(point.params, z, "update direction")
    members = group_parameters(point.params.keys(), blocks, model_of(point.loss_fn))
    z = P.cast(z, point.dtype)
    hz_blocks = point.hvp_each(_block_directions(z, members))
    first = np.array([P.dot(point.gradient, z, names) for names in members.values()])
    return _assemble(members, z, first, _interactions(z, members, hz_blocks))


def block_matrix(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    blocks: str | Mapping[str, Sequence[str]] = "layer",
    via: str = "hvp",
    chunk_size: int | None = None,
    dtype: torch.dtype | None = None,
    method: str = DEFAULT_METHOD,
) -> BlockMatrix:
    r"""The block interaction matrix :math:`M_{lm} = \langle Z_l, H_{lm}[Z_m]\rangle / \|Z\|^2`, exactly.

    Args:
        z: the step Z.
        blocks: ``"layer"``, ``"tensor"``, ``"kind"``, or ``{block: [parameter names or globs]}``
            (see :func:`~curvlab.curvature.groupings.group_parameters`).
        via: ``"hvp"`` (one HVP per block at one point, :math:`H[Z_m]` with :math:`Z_m` touching only
            block m) or ``"alpha"`` (the Hessian in α of :math:`L(W + \sum_l \alpha_l Z_l)`, which is
            :math:`M\|Z\|^2`, as the curvature of an L-parameter loss). Both are exact; ``"hvp"`` is
            the default.
        chunk_size: directions per vectorized call (bounds memory).
        method: the HVP method, ``"rev_rev"`` (default) or ``"fwd_rev"``.

    Raises:
        CurvlabError: Z mismatched, non-finite or zero; a grouping that leaves a parameter out or
            claims one twice; an unknown way.
    """
    if via not in BLOCK_WAYS:
        raise CurvlabError(f"unknown block-matrix way {via!r}; choose one of {', '.join(BLOCK_WAYS)}")
    _check_direction(params, z, "update direction")
    if via == "hvp":
        with CurvaturePoint(loss_fn, params, batch, method, dtype, chunk_size) as point:
            return block_matrix_at(point, z, blocks)
    if any_dtensor(params.values()):
        raise CurvlabError("block matrix via 'alpha' takes unsharded parameters; on sharded ones use via='hvp'")
    members = group_parameters(params.keys(), blocks, model_of(loss_fn))
    dt = working_dtype(params, dtype)
    p, zc = P.cast(params, dt), P.cast(z, dt)
    device = next(iter(p.values())).device
    alpha = {"alpha": torch.zeros(len(members), dtype=dt, device=device)}
    with CurvaturePoint(_AlphaLoss(loss_fn, p, zc, members), alpha, batch, method, dt, chunk_size) as point:
        R = point.hvps({"alpha": torch.eye(len(members), dtype=dt, device=device)})["alpha"]
        gz = point.gradient["alpha"]
    return _assemble(members, zc, gz.double().cpu().numpy(), R.double().cpu().numpy())


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


def taylor_split_and_block_matrix_at(
    point: CurvaturePoint,
    z: Mapping[str, Tensor],
    blocks: str | Mapping[str, Sequence[str]] = "layer",
    subset: Sequence[str] | None = None,
) -> tuple[TaylorSplit, BlockMatrix]:
    r""":func:`taylor_split_at` and :func:`block_matrix_at` of one step at one point, sharing their HVPs:
    :math:`H[Z] = \sum_m H[Z_m]` by linearity, and when every block lies inside the subset S or
    outside it, :math:`H[Z_S]` is the sum over the blocks inside. L HVPs (L + 1 otherwise)."""
    _check_direction(point.params, z, "update direction")
    members = group_parameters(point.params.keys(), blocks, model_of(point.loss_fn))
    z = P.cast(z, point.dtype)
    names = _subset_names(point, subset)
    proper = _proper(names, point.params, z)
    inside = set(names)
    aligned = all(set(b) <= inside or not set(b) & inside for b in members.values())
    extra = [{n: z[n] for n in names}] if proper and not aligned else []
    hzs = point.hvp_each(_block_directions(z, members) + extra)
    hz_blocks = hzs[: len(members)]
    hz = functools.reduce(P.add, hz_blocks)
    hz_sub = None
    if proper:
        within_s = [hz_m for hz_m, b in zip(hz_blocks, members.values()) if set(b) <= inside]
        hz_sub = hzs[-1] if extra else functools.reduce(P.add, within_s)
    split = _split(point, z, hz, names, hz_sub)
    first = np.array([P.dot(point.gradient, z, b) for b in members.values()])
    return split, _assemble(members, z, first, _interactions(z, members, hz_blocks))


def taylor_split_and_block_matrix(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    blocks: str | Mapping[str, Sequence[str]] = "layer",
    subset: Sequence[str] | None = None,
    chunk_size: int | None = None,
    dtype: torch.dtype | None = None,
    method: str = DEFAULT_METHOD,
) -> tuple[TaylorSplit, BlockMatrix]:
    r""":func:`taylor_split` and :func:`block_matrix` (via HVPs) of one step, at one point and sharing
    their HVPs (:func:`taylor_split_and_block_matrix_at`)."""
    _check_direction(params, z, "update direction")
    with CurvaturePoint(loss_fn, params, batch, method, dtype, chunk_size) as point:
        return taylor_split_and_block_matrix_at(point, z, blocks, subset)
