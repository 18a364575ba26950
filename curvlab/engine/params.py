"""Arithmetic on parameter dicts: ``{name: tensor}`` mappings that share keys and shapes.

Every curvature quantity in curvlab is an inner product over *all* parameter tensors of a model,
so directions (gradients G, updates Z, Hessian-vector products H[Z]) are dicts keyed like
``model.named_parameters()``. Inner products accumulate in float64 whatever the tensors' dtype:
the NDS of a late checkpoint is a ratio of two sums over ~10^8 terms.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from curvlab.engine.dtensors import all_finite, check_layout, resolved, sum_terms
from curvlab.errors import CurvlabError

Params = dict[str, Tensor]


def dot(a: Mapping[str, Tensor], b: Mapping[str, Tensor], keys: Iterable[str] | None = None) -> float:
    r"""Euclidean inner product :math:`\langle a, b\rangle = \sum_k \sum_i a_{k,i} b_{k,i}` in float64.

    ``keys`` restricts the sum to a subset of the parameter names.
    """
    keys = list(a.keys() if keys is None else keys)
    if not keys:
        return 0.0
    # on the tensors' own device, one float64 sum per tensor, and a single transfer at the end (for
    # sharded tensors, one all-reduce of the per-rank partial sums)
    return float(sum_terms([torch.sum(a[k].double() * b[k].double()) for k in keys]))


def stacked_dot(a: Mapping[str, Tensor], b: Mapping[str, Tensor], keys: Iterable[str]) -> Tensor:
    r"""Inner products :math:`\langle a_k, b_k\rangle` over ``keys`` for K stacked entries, float64 ``(K,)``.

    Tensors stacked along dim 0 (``(K, *shape)``) pair entry by entry; an unstacked tensor (``shape``)
    pairs with every entry.
    """
    total = None
    for k in keys:
        x, y = a[k].double(), b[k].double()
        if x.dim() < y.dim():  # (unsqueeze rather than broadcast_tensors: it keeps a DTensor's sharding)
            x = x.unsqueeze(0)
        elif y.dim() < x.dim():
            y = y.unsqueeze(0)
        xy = x * y
        part = xy.sum(dim=tuple(range(1, xy.dim()))) if xy.dim() > 1 else xy
        total = part if total is None else total + part
    return resolved(total).cpu()


def norm(a: Mapping[str, Tensor], keys: Iterable[str] | None = None) -> float:
    r"""Frobenius norm :math:`\|a\|_F = \langle a, a\rangle^{1/2}` over all (or ``keys``) tensors."""
    return dot(a, a, keys) ** 0.5


def add(a: Mapping[str, Tensor], b: Mapping[str, Tensor], alpha: float = 1.0) -> Params:
    """``a + alpha * b``, key by key."""
    return {k: a[k] + alpha * b[k] for k in a}


def scale(a: Mapping[str, Tensor], c: float) -> Params:
    """``c * a``, key by key."""
    return {k: c * t for k, t in a.items()}


def zeros_like(a: Mapping[str, Tensor]) -> Params:
    """A dict of zeros with ``a``'s keys, shapes and dtypes."""
    return {k: torch.zeros_like(t) for k, t in a.items()}


def restrict(a: Mapping[str, Tensor], keys: Iterable[str]) -> Params:
    """``a`` with every tensor outside ``keys`` replaced by zeros (the direction padded to all params)."""
    keep = set(keys)
    return {k: t if k in keep else torch.zeros_like(t) for k, t in a.items()}


def cast(a: Mapping[str, Tensor], dtype: torch.dtype) -> Params:
    """Detached copies of ``a`` in ``dtype`` (floating tensors only; others pass through)."""
    return {k: t.detach().to(dtype) if t.is_floating_point() else t.detach() for k, t in a.items()}


def flatten(a: Mapping[str, Tensor]) -> Tensor:
    """Concatenate the tensors of ``a`` (in key order) into one vector."""
    return torch.cat([t.reshape(-1) for t in a.values()])


def unflatten(vector: Tensor, like: Mapping[str, Tensor]) -> Params:
    """Inverse of :func:`flatten`: split ``vector`` into tensors shaped like ``like``'s values."""
    sizes = [t.numel() for t in like.values()]
    if vector.numel() != sum(sizes):
        raise CurvlabError(f"vector has {vector.numel()} entries but the parameters have {sum(sizes)}")
    return {k: piece.view(t.shape) for (k, t), piece in zip(like.items(), vector.split(sizes))}


def check_like(params: Mapping[str, Tensor], direction: Mapping[str, Tensor], what: str = "direction") -> None:
    """Raise ``CurvlabError`` unless ``direction`` has exactly ``params``' keys and shapes and is finite."""
    missing = [k for k in params if k not in direction]
    extra = [k for k in direction if k not in params]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {names_text(missing)}")
        if extra:
            parts.append(f"unknown {names_text(extra)}")
        raise CurvlabError(f"{what} does not match the parameters: {'; '.join(parts)}")
    for k, p in params.items():
        d = direction[k]
        if tuple(d.shape) != tuple(p.shape):
            raise CurvlabError(f"{what}[{k!r}] has shape {tuple(d.shape)}, parameter has {tuple(p.shape)}")
        check_layout(p, d, f"{what}[{k!r}]")
        check_device(p, d, f"{what}[{k!r}]")
        if not all_finite([d]):
            raise CurvlabError(f"{what}[{k!r}] holds non-finite values (NaN or inf)")


def check_device(param: Tensor, direction: Tensor, what: str) -> None:
    """Raise ``CurvlabError`` unless ``direction`` lives on ``param``'s device and holds values (a tensor on
    the ``meta`` device has a shape and no data: nothing can be computed along it)."""
    if direction.is_meta or param.is_meta:
        which = "it" if direction.is_meta else "the parameter"
        raise CurvlabError(
            f"{what}: {which} is on the meta device (a shape, no values): materialize it first (e.g. .to_empty and "
            "an initialization, or a load)"
        )
    if direction.device != param.device:
        raise CurvlabError(
            f"{what} is on {direction.device}, the parameter on {param.device}: create directions on the parameters' "
            "device"
        )


def names_text(keys: list[str], most: int = 4) -> str:
    """Up to ``most`` names quoted, then how many more: for error messages."""
    shown = ", ".join(repr(k) for k in keys[:most])
    return shown + (f" and {len(keys) - most} more" if len(keys) > most else "")
