r"""The autograd steps under :class:`~curvlab.engine.hvp.CurvaturePoint`: the second backward that turns
directions :math:`v_k` into rows :math:`\nabla_W \langle \nabla L, v_k\rangle = H[v_k]`, the weighted sum of such
rows over batches, the vmap over stacked directions, and the compiler stance every computation runs under.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.func import vmap
from torch.utils._pytree import tree_map

from curvlab.engine import checks
from curvlab.engine.dtensors import any_dtensor
from curvlab.engine.loss import LossFn


def eager_stance() -> contextlib.AbstractContextManager:
    """torch.compile'd code runs eagerly within: AOTAutograd's graphs have no double backward. Where
    torch.compile's module was never imported nothing was compiled, and this does not import it."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def bound_loss(loss_fn: LossFn, batch: Any):
    """``p -> loss_fn(p, batch)``, checked to be a scalar."""
    return lambda p: checks.scalar(loss_fn(p, batch))


def double_backward(
    outputs: list[Tensor], leaves: list[Tensor], vs: list[Tensor], stacked: bool = True
) -> list[Tensor]:
    r"""Rows :math:`\nabla_W \langle \text{outputs}, v_k\rangle` stacked over the K directions in ``vs``
    (``stacked=False``: the one row of one direction), by one plain backward per direction: a vmapped
    ``is_grads_batched`` backward measured 1.7x slower (``benchmarks/hvp.py``), and lacks some batching rules.
    """
    kw = {"retain_graph": True, "allow_unused": True, "materialize_grads": True}
    if not stacked:
        return list(torch.autograd.grad(outputs, leaves, vs, **kw))
    k = vs[0].shape[0]
    if k == 1:
        return [r.unsqueeze(0) for r in torch.autograd.grad(outputs, leaves, [v[0] for v in vs], **kw)]
    if any_dtensor(leaves):
        rows = [torch.autograd.grad(outputs, leaves, [v[i] for v in vs], **kw) for i in range(k)]
        return [torch.stack(r) for r in zip(*rows)]
    # each row goes into its place as it comes, so that one row at a time is alive beside the stack
    # (stacking them after holds K rows twice) and the next row reuses its memory
    stacked = [torch.empty((k, *leaf.shape), dtype=leaf.dtype, device=leaf.device) for leaf in leaves]
    for i in range(k):
        for out, row in zip(stacked, torch.autograd.grad(outputs, leaves, [v[i] for v in vs], **kw)):
            out[i].copy_(row)
    return stacked


def fresh_rows(rows: Sequence[Tensor], vs: Sequence[Tensor]) -> bool:
    """Whether a second backward's rows are tensors of their own: plain, contiguous, each on its own memory
    (autograd hands an addition's gradient to both inputs as one tensor), and none on the directions' (an
    identity passes its grad output through)."""
    if any_dtensor(rows) or any_dtensor(vs) or not all(r.is_contiguous() for r in rows):
        return False
    pointers = [r.untyped_storage().data_ptr() for r in rows if r.numel()]
    taken = {v.untyped_storage().data_ptr() for v in vs}
    return len(set(pointers)) == len(pointers) and taken.isdisjoint(pointers)


def accumulate(
    total: list[Tensor] | None, terms: Sequence[Tensor], weight: float, *, owned: bool = False
) -> list[Tensor]:
    """``total + weight * terms``, tensor by tensor (``total`` ``None``: the first batch's), into fresh tensors:
    the terms may be views of a kept graph's tensors; ``owned`` terms at weight 1 are kept as they are."""
    if total is None:
        return list(terms) if owned and weight == 1.0 else list(torch._foreach_mul(terms, weight))
    torch._foreach_add_(total, terms, alpha=weight)  # (one call for all the tensors: one kernel on a GPU)
    return total


def vmap_directions(fn, vs, chunk_size, out_dims):
    """``vmap`` of ``fn`` over directions stacked in ``vs``, ``chunk_size`` at a time (here: torch's own
    ``chunk_size`` can't combine with an out_dim ``None``, the outputs kept once, not K times)."""
    k = next(iter(vs.values())).shape[0]
    step = k if chunk_size is None else max(1, chunk_size)
    batched = vmap(fn, out_dims=out_dims, randomness="same")
    pieces = [batched({n: t[i : i + step] for n, t in vs.items()}) for i in range(0, k, step)]
    return tuple(
        first if dim is None else tree_map(lambda *xs: torch.cat(xs), *(p[j] for p in pieces))
        for j, (first, dim) in enumerate(zip(pieces[0], out_dims))
    )
