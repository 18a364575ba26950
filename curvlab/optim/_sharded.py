r"""Muon's polar factors for sharded (FSDP2 / DTensor) parameters: whole matrices, one rank each.

Newton–Schulz needs the whole momentum-averaged matrix :math:`\tilde B`, but under FSDP2 each rank
holds a block of its rows (``Shard(0)``). As curvlab's DDP Muon shares polar factors out, the matrices,
sorted by size, go round robin to the ranks: for each matrix its owner *gathers* the row blocks
(``dist.gather``), computes :math:`\operatorname{msign}(\tilde B)`, and *scatters* the rows of the
factor back (``dist.scatter``), so each rank ends with its shard of the step and no rank holds more
than the matrices it owns. The factor is the one a single process computes from the same matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Shard

from curvlab.engine.dtensors import require_process_group
from curvlab.errors import CurvlabError


def _row_counts(rows: int, world: int) -> list[int]:
    """Rows of each rank's ``Shard(0)`` block (``torch.chunk``'s split, as DTensor lays it out)."""
    counts = [len(c) for c in torch.arange(rows).chunk(world)]
    return counts + [0] * (world - len(counts))


def sharded_polar_factors(work: Sequence[tuple[Any, Tensor, Tensor]], factor: Callable[[Any, Tensor], Tensor]) -> list:
    r"""The polar factor of each sharded update, as a DTensor laid out like it.

    Args:
        work: ``(group, param, update)`` triples; ``update`` a ``Shard(0)`` DTensor on a 1-D mesh.
        factor: ``factor(group, full_update) -> full polar factor`` (plain tensors, same shape), run on
            the matrix's owner only.
    """
    require_process_group()
    for _, _, u in work:
        if u.device_mesh.ndim != 1 or tuple(u.placements) != (Shard(0),):
            raise CurvlabError(
                "sharded Muon takes parameters sharded by rows on a 1-D mesh (FSDP2's Shard(0)), "
                f"got {tuple(u.placements)}"
            )
    order = sorted(range(len(work)), key=lambda i: -work[i][2].numel())
    outs: list[Tensor | None] = [None] * len(work)
    for k, i in enumerate(order):
        _, _, update = work[i]
        mesh = update.device_mesh
        group, world = mesh.get_group(), mesh.size()
        me = mesh.get_local_rank()
        owner = k % world  # round robin by size, over the mesh's ranks
        owner_global = dist.get_global_rank(group, owner)
        local = update.to_local()
        rows = update.shape[0]
        counts = _row_counts(rows, world)
        if local.shape[0] != counts[me]:
            raise CurvlabError(f"a shard has {local.shape[0]} rows, expected {counts[me]} of {rows}")
        most = max(counts)
        padded = local.new_zeros((most, *local.shape[1:]))
        padded[: local.shape[0]] = local
        pieces = [torch.empty_like(padded) for _ in range(world)] if me == owner else None
        dist.gather(padded, pieces, dst=owner_global, group=group)
        if me == owner:
            whole = torch.cat([p[:c] for p, c in zip(pieces, counts)])
            ortho = factor(work[i][0], whole).to(local.dtype).contiguous()
            blocks = list(ortho.split(counts))
            sends = [local.new_zeros(padded.shape) for _ in range(world)]
            for s, b in zip(sends, blocks):
                s[: b.shape[0]] = b
        else:
            sends = None
        mine = torch.empty_like(padded)
        dist.scatter(mine, sends, src=owner_global, group=group)
        outs[i] = DTensor.from_local(
            mine[: counts[me]].contiguous(), mesh, (Shard(0),), shape=update.shape, stride=update.stride()
        )
    return outs
