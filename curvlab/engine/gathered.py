r"""Exact curvature with sharded parameters (FSDP2 ``fully_shard`` models, plain DTensor parameters).

:class:`~curvlab.engine.hvp.CurvaturePoint` and every function built on it take a parameter dict whose values
are ``DTensor`` shards (``dict(model.named_parameters())`` of an FSDP2 model, say) and keep the
gradient, the directions and the HVPs sharded the same way. This module holds what makes that exact.

**The route.** The loss is evaluated by a functional call over *gathered* parameters: each sharded
:math:`W_i` becomes its full tensor by ``DTensor.full_tensor()``, a differentiable all-gather (its
backward is a reduce-scatter, whose backward is an all-gather again), and the model runs on those with
FSDP2's own forward hooks off. So both backwards run through the collectives, and :math:`H[v]` comes back
sharded like :math:`W`, equal to the one-process HVP up to summation order. The other routes don't work
on torch 2.13: ``torch.autograd.grad`` through FSDP2's hooks fails with respect to the sharded parameters
(pytorch#172543), and forward mode fails through FSDP2 and DDP (pytorch#182641, #182661), so ``"fwd_rev"``
and forward-over-forward are refused or replaced by double backward.

**Batches.** With fewer batches than ranks every rank computes the same loss, and the gradients are
taken as replicated; otherwise each rank takes its share, and the gradients are declared ``Partial``
so that the reduce-scatter sums them over ranks.

**Memory.** Each rank holds 1/N of the parameters, directions and results; the kept graph of
``"rev_rev"`` holds the gathered weights, as FSDP2 with ``reshard_after_forward=False`` does.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Replicate

from curvlab.engine.dtensors import any_dtensor, require_process_group
from curvlab.errors import CurvlabError
from curvlab.util.distributed import all_reduce_sum, rank_and_world, unanswered_ranks, watch_ranks

FWD_REV_REFUSED = (
    "method 'fwd_rev' is refused on sharded parameters: torch.func.jvp does not run through FSDP2 or "
    "DTensor collectives (pytorch#182641, #182661); use 'rev_rev' (exact double backward)"
)


def is_sharded(params: Mapping[str, Tensor]) -> bool:
    """Whether a parameter dict holds sharded tensors (DTensors)."""
    return any_dtensor(params.values())


def check_process_group(params: Mapping[str, Tensor]) -> None:
    """Raise :class:`CurvlabError` when ``params`` are sharded but no process group is initialized."""
    if is_sharded(params):
        require_process_group()


def _fsdp_hook_ids(model: nn.Module) -> set[int]:
    ids = set()
    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            for handle in (state._pre_forward_hook_handle, state._post_forward_hook_handle):
                ids.update(h.id for h in getattr(handle, "handles", (handle,)))
    return ids


@contextlib.contextmanager
def fsdp_hooks_off(model: nn.Module | None) -> Iterator[None]:
    """Within the block, FSDP2's forward hooks of ``model`` don't run (the other hooks do): its
    pre-forward all-gather would swap FSDP's own unsharded parameters in over the functional call's."""
    ids = _fsdp_hook_ids(model) if isinstance(model, nn.Module) else set()
    saved = []
    if ids:
        for m in model.modules():
            dicts = (
                m._forward_pre_hooks,
                m._forward_pre_hooks_with_kwargs,
                m._forward_hooks,
                m._forward_hooks_with_kwargs,
                m._forward_hooks_always_called,
            )
            if any(i in d for d in dicts for i in ids):
                saved.append((dicts, [list(d.items()) for d in dicts]))
                for d in dicts:
                    for i in ids:
                        d.pop(i, None)
    try:
        yield
    finally:
        for dicts, items in saved:  # (put back in their order: FSDP prepends its pre-forward hook)
            for d, kept in zip(dicts, items):
                d.clear()
                d.update(kept)


class GatheringLoss:
    r"""``loss_fn`` over sharded parameters: ``loss(W) = loss_fn(gather(W), batch)``.

    Each DTensor in ``params`` is gathered by the differentiable ``full_tensor()``; sharded module
    parameters not in ``params`` (frozen ones) are gathered detached. With ``partial=True`` (ranks
    hold different batches) the gradients are summed over ranks by the backward's reduce-scatter. Its
    ``model`` and ``loss_terms`` are the wrapped loss function's.
    """

    def __init__(self, loss_fn: Any, partial: bool):
        self.inner, self.partial = loss_fn, partial
        self.model = getattr(loss_fn, "model", None)
        if getattr(loss_fn, "loss_terms", None) is not None:
            self.loss_terms = loss_fn.loss_terms

    def _gather(self, t: Tensor) -> Tensor:
        if not isinstance(t, DTensor):
            return t
        grad = [Partial() if self.partial else Replicate()] * t.device_mesh.ndim
        return t.full_tensor(grad_placements=grad)

    def __call__(self, params: Mapping[str, Tensor], batch: Any) -> Tensor:
        full = {n: self._gather(t) for n, t in params.items()}
        if isinstance(self.model, nn.Module):
            frozen = {
                n: t.detach().full_tensor()
                for n, t in self.model.named_parameters()
                if n not in full and isinstance(t, DTensor)
            }
            full = {**frozen, **full}
        with fsdp_hooks_off(self.model):
            return self.inner(full, batch)


def gathering_loss(loss_fn: Any, params: Mapping[str, Tensor], partial: bool) -> Any:
    """``loss_fn`` wrapped in a :class:`GatheringLoss` when ``params`` are sharded (checked to have a
    process group), else ``loss_fn`` itself."""
    if not is_sharded(params):
        return loss_fn
    check_process_group(params)
    watch_ranks()  # (every rank is here together: the roll call that names a rank that dies later)
    inner = loss_fn.inner if isinstance(loss_fn, GatheringLoss) else loss_fn
    return GatheringLoss(inner, partial)


def sum_replicated(values: dict[str, Tensor]) -> dict[str, Tensor]:
    """Sum over ranks the plain (replicated) tensors of a result dict; the sharded entries were summed
    by the reduce-scatter of the backward already."""
    plain = {n: t for n, t in values.items() if not isinstance(t, DTensor)}
    if plain:
        all_reduce_sum(plain)
    return values


# what gloo and NCCL say when a peer died or stalled past the process group's timeout
_COLLECTIVE_FAILURES = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "nccl")


def names_rank_on_collective_failure(method: Callable) -> Callable:
    """Decorate a method of an object with a ``sharded`` flag: when sharded, a collective that fails
    because another rank died or stalled becomes a one-line :class:`CurvlabError` naming the rank(s),
    found by a roll call (:func:`curvlab.util.distributed.unanswered_ranks`)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if not getattr(self, "sharded", False):
            return method(self, *args, **kwargs)
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if isinstance(e, CurvlabError) or not any(k in first.lower() for k in _COLLECTIVE_FAILURES):
                raise
            rank, world = rank_and_world()
            missing = unanswered_ranks()
            if missing:
                who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {world}"
                raise CurvlabError(
                    f"{who} died or stalled during {method.__name__}: a collective failed on rank {rank} and "
                    f"{'they' if len(missing) > 1 else 'it'} did not answer its roll call within the process "
                    f"group's timeout ({first})"
                ) from e
            if missing == []:
                why = "every rank answered a roll call after it (a stall that ended, or collectives out of step)"
            else:
                why = "another rank died or stalled past the process group's timeout (no roll call: watch_ranks)"
            message = f"rank {rank} of {world}: a collective of {method.__name__} failed: {why} ({first})"
            raise CurvlabError(message) from e

    return wrapper
