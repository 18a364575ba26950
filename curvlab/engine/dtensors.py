r"""Sharded tensors (``torch.distributed.tensor.DTensor``) as curvlab's parameter dicts hold them.

Curvature directions and results are kept in the same layout as the parameters (FSDP2's ``Shard(0)``): a
direction stacked over K entries (``(K, *shape)``) is sharded along the dim after. Reductions of sharded
tensors come out ``Partial``; :func:`resolved` takes the sum over ranks, so every rank sees the same number.
"""

from __future__ import annotations

import cmath
import math
from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor
from torch._utils import _flatten_dense_tensors
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from curvlab.errors import CurvlabError


def is_dtensor(t: object) -> bool:
    return isinstance(t, DTensor)


def any_dtensor(values: Iterable[object]) -> bool:
    """Whether any of ``values`` is a DTensor (a sharded parameter dict)."""
    return any(isinstance(t, DTensor) for t in values)


NO_GROUP = (
    "the parameters are sharded (DTensor) but no torch.distributed process group is initialized: "
    "run under torchrun inside curvlab.util.distributed.distributed_context() (or dist.init_process_group)"
)


def require_process_group() -> None:
    """Raise :class:`CurvlabError` unless a process group is initialized (sharded tensors need one)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise CurvlabError(NO_GROUP)


def resolved(t: Tensor) -> Tensor:
    """``t`` as a plain tensor holding its global value on every rank (a DTensor's ``full_tensor()``)."""
    if not isinstance(t, DTensor):
        return t
    require_process_group()
    return t.full_tensor()


def sum_terms(terms: list[Tensor]) -> Tensor:
    """The sum of 0-d ``terms``, sharded ones reduced over ranks in one collective: a plain 0-d tensor."""
    sharded = [t for t in terms if isinstance(t, DTensor)]
    plain = [t for t in terms if not isinstance(t, DTensor)]
    total = resolved(torch.stack(sharded).sum()) if sharded else None
    if plain:
        local = torch.stack(plain).sum()
        total = local if total is None else total + local.to(total.device)
    return total


def all_finite(tensors: Iterable[Tensor]) -> bool:
    """Whether every entry of every tensor is finite, decided over all ranks for sharded tensors (so
    that every rank raises together instead of one raising and the others waiting for it)."""
    plain: list[Tensor] = []
    sharded: list[Tensor] = []
    for t in tensors:
        (sharded if isinstance(t, DTensor) else plain).append(t)
    ok = all(_plain_finite(group) for group in _by_device(plain))
    if sharded:
        bad = sum_terms([(~torch.isfinite(t)).sum().double() for t in sharded])
        ok = ok and float(bad) == 0.0
    return ok


def _by_device(tensors: list[Tensor]) -> Iterable[list[Tensor]]:
    """The floating (and complex) tensors that hold entries, grouped by device: integer and boolean ones are
    finite, and an empty one has no entry (nor an infinity norm)."""
    groups: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        if t.numel() and (t.is_floating_point() or t.is_complex()):
            groups.setdefault(t.device, []).append(t)
    return groups.values()


_FLAT = 1 << 16
"""Entries up to which tensors are checked as one vector: copying them into it costs less than a kernel's setup
a tensor (``benchmarks/small_models.py --checks``, docs/benchmarks.md)."""


def _plain_finite(tensors: list[Tensor]) -> bool:
    """Whether tensors on one device are finite, in one synchronization: the infinity norm (max |x|) is NaN or
    inf exactly where an entry is, of all tensors in one call. When they are few, of one vector of them all,
    and only if its sum is not finite (NaN and inf carry through a sum; an overflow is settled by the norm)."""
    if sum(t.numel() for t in tensors) <= _FLAT:
        flat = _flatten_dense_tensors(tensors)
        return cmath.isfinite(flat.sum().item()) or math.isfinite(flat.abs().max().item())  # (cmath: complex too)
    return all(map(math.isfinite, torch.stack(torch._foreach_norm(tensors, math.inf)).tolist()))


def stacked_placements(placements) -> tuple:
    """The placements of K directions stacked along a new dim 0 (``Shard(d)`` becomes ``Shard(d + 1)``)."""
    return tuple(Shard(p.dim + 1) if isinstance(p, Shard) else p for p in placements)


def check_layout(param: Tensor, direction: Tensor, what: str, stacked: bool = False) -> None:
    """Raise :class:`CurvlabError` unless ``direction`` is laid out like ``param``: both plain, or both
    DTensors on the same mesh with the same placements (shifted one dim when ``stacked``)."""
    if not isinstance(param, DTensor):
        if isinstance(direction, DTensor):
            raise CurvlabError(f"{what} is a sharded DTensor but the parameter is a plain tensor")
        return
    if not isinstance(direction, DTensor):
        raise CurvlabError(
            f"{what} is a plain tensor but the parameter is sharded: shard it like the parameters "
            "(curvlab.engine.dtensors.shard_like)"
        )
    want = stacked_placements(param.placements) if stacked else tuple(param.placements)
    if direction.device_mesh != param.device_mesh or tuple(direction.placements) != want:
        raise CurvlabError(
            f"{what} is sharded as {tuple(direction.placements)}, the parameter as {want}: "
            "shard it like the parameters (curvlab.engine.dtensors.shard_like)"
        )


def shard_like(direction: Mapping[str, Tensor], params: Mapping[str, Tensor], stacked: bool = False) -> dict:
    """``direction`` laid out like ``params``: a plain tensor (the same global tensor on every rank) is
    distributed, a DTensor redistributed, to the parameter's mesh and placements (``stacked``: for
    ``(K, *shape)`` directions)."""
    out = {}
    for n, t in direction.items():
        p = params[n]
        if not isinstance(p, DTensor):
            out[n] = t
            continue
        place = stacked_placements(p.placements) if stacked else tuple(p.placements)
        if isinstance(t, DTensor):
            out[n] = t if tuple(t.placements) == place else t.redistribute(p.device_mesh, place)
        else:
            out[n] = distribute_tensor(t.to(device=p.device, dtype=p.dtype), p.device_mesh, place)
    return out


def full(tensors: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Every tensor as its global value, gathered on every rank."""
    return {n: resolved(t) for n, t in tensors.items()}
