r"""Sharded tensors (``torch.distributed.tensor.DTensor``) as curvlab's parameter dicts hold them.

A DTensor is one global tensor laid out over a device mesh: each rank holds its local piece, and
``placements`` say how (``Shard(d)``: split along dim d; ``Replicate()``: whole on every rank;
``Partial()``: a sum over ranks not yet taken). FSDP2's ``fully_shard`` turns every parameter into a
``Shard(0)`` DTensor. Curvature directions and results are kept in the same layout as the parameters:
a direction stacked over K entries (``(K, *shape)``) is sharded along the dim after.

Reductions of sharded tensors (an inner product :math:`\sum_i a_i b_i`, a finiteness check) come out
``Partial``; :func:`resolved` takes the sum over ranks, so every rank sees the same number.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor
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
    tensors = list(tensors)
    sharded = [t for t in tensors if isinstance(t, DTensor)]
    plain = [t for t in tensors if not isinstance(t, DTensor)]
    ok = True
    if plain:
        ok = bool(torch.stack([torch.isfinite(t).all() for t in plain]).all())
    if sharded:
        bad = sum_terms([(~torch.isfinite(t)).sum().double() for t in sharded])
        ok = ok and float(bad) == 0.0
    return ok


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
    ``(K, *shape)`` directions). Entries whose parameter is plain are returned as they are."""
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
    """Every tensor as its global value, gathered on every rank (for tests, checkpoints and reports;
    the curvature functions never need it)."""
    return {n: resolved(t) for n, t in tensors.items()}
