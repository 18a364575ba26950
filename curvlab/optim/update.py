"""The side-effect-free next update of any optimizer: :func:`next_update` returns the gradient G and the step
:math:`Z = W - W_\text{next}` that an optimizer *would* take on a batch, leaving model, gradients and optimizer
state bit-for-bit as they were.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from curvlab.engine._gathered import gathering_loss
from curvlab.engine.loss import Batches, weighted_batches
from curvlab.errors import CurvlabError
from curvlab.optim.combined import Optimizers, as_optimizer_list
from curvlab.optim.model_optimizer import named_trainable


def _reachable_optimizers(root: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """``root`` and every optimizer it holds, at any depth of its attributes' dicts, lists and tuples
    (Lookahead's inner optimizer, SAM's base optimizer, CombinedOptimizer's children)."""
    found: dict[int, torch.optim.Optimizer] = {}
    stack: list[Any] = [root]
    seen: set[int] = set()
    while stack:
        x = stack.pop()
        if id(x) in seen or isinstance(x, Tensor):
            continue
        seen.add(id(x))
        if isinstance(x, torch.optim.Optimizer):
            found[id(x)] = x
            stack.extend(vars(x).values())
        elif isinstance(x, Mapping):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set)):
            stack.extend(x)
    return list(found.values())


def copy_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """A deep copy of ``optimizer`` and of every optimizer it holds, over the same parameter objects.

    Everything a step can mutate is copied: per-parameter state, param groups, and every other
    attribute (a wrapper's inner optimizer and its state, step counters), not only ``state``.
    (``copy.deepcopy`` alone won't do: ``torch.optim.Optimizer.__getstate__`` keeps only
    ``defaults``, ``state`` and ``param_groups``.) An LR scheduler's ``step`` wrapper, which would
    call the original's step, is left out of the copy.

    Raises:
        CurvlabError: some part of the state can't be copied.
    """
    memo: dict[int, Any] = {}
    for o in _reachable_optimizers(optimizer):
        for group in o.param_groups:
            for p in group["params"]:
                memo[id(p)] = p  # the same parameters: only the optimizer's own data is copied
    pairs = [(o, object.__new__(type(o))) for o in _reachable_optimizers(optimizer)]
    memo.update({id(o): shell for o, shell in pairs})
    try:
        for o, shell in pairs:
            attrs = {k: v for k, v in vars(o).items() if not (k == "step" and hasattr(v, "_wrapped_by_lr_sched"))}
            vars(shell).update(copy.deepcopy(attrs, memo))
    except Exception as e:  # any failure here means the state can't be copied
        raise CurvlabError(f"the state of {type(optimizer).__name__} can't be copied: {e}") from e
    return memo[id(optimizer)]


def _needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (``LBFGS.step(closure)``: no default)."""
    try:
        closure = inspect.signature(optimizer.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def _asks_for_closure(error: Exception) -> bool:
    """Whether ``step()`` failed because it wanted a closure (SAM's ``assert closure is not None``)."""
    return isinstance(error, (AssertionError, TypeError, RuntimeError, ValueError)) and "closure" in str(error).lower()


@contextlib.contextmanager
def forked_rng(tensors: Sequence[Tensor]) -> Iterator[None]:
    """Fork the CPU's random stream and those of the devices ``tensors`` live on; put back on exit."""
    devices = {t.device for t in tensors if t.device.type not in ("cpu", "meta")}
    kinds = {d.type for d in devices}
    if len(kinds) > 1:
        raise CurvlabError(f"parameters on several device types ({sorted(kinds)}): can't fork their RNGs")
    kind = kinds.pop() if kinds else "cuda"
    with torch.random.fork_rng(devices=sorted({d.index or 0 for d in devices}), device_type=kind):
        yield


def next_update(
    model: nn.Module,
    optimizer: Optimizers,
    loss_fn: Callable[[Mapping[str, Tensor], Any], Tensor],
    batch: Any,
    lr_scale: float = 1.0,
    dtype: torch.dtype | None = None,
    max_grad_norm: float | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    r"""The gradient G and the step :math:`Z = W - W_\text{next}` that ``optimizer`` would take on ``batch``.

    G is computed as a training step computes it (autograd through ``loss_fn`` on the model's own
    parameters, in the model's current mode: dropout is live in train mode), optionally clipped to
    ``max_grad_norm`` as the training loop does; then a copy of the optimizer
    (:func:`copy_optimizer`: its state, groups, inner optimizers, counters) really steps, and the
    parameters and their ``.grad`` (the same objects) are put back. The optimizer itself is never
    touched. Gradient and step run under one fork of torch's RNG (CPU and the parameters' devices):
    an optimizer that draws random numbers (SGLD, PSGD) takes the very draws its real step then
    takes after the same gradient, and the user's RNG is where it was. Z includes learning rate,
    schedule, momentum, bias correction and weight decay.

    ``optimizer`` may be a list or tuple of optimizers over disjoint parameters (a user's own
    ``torch.optim.Muon`` + ``AdamW`` pair): each steps, as a loop calling each ``step()`` would. A
    trainable parameter that no optimizer holds is refused by name (its Z would silently be 0):
    give every optimizer, or freeze it (``requires_grad=False``).

    An optimizer whose step needs a closure (``torch.optim.LBFGS``; SAM, which asks for it) gets
    one: it sets every trainable parameter's ``.grad`` to the (clipped) gradient of ``loss_fn`` on
    ``batch`` at the point it is called, and returns the loss. G is the gradient at W, taken first,
    and left in ``.grad`` for the step, as in a loop that runs ``backward()`` then ``step(closure)``.

    A list of micro-batches (or :class:`~curvlab.engine.loss.Batches`) is one step with gradient
    accumulation: :math:`G = \sum_j w_j \nabla L_j` with :math:`w_j` each micro-batch's share of
    the loss terms (:func:`~curvlab.engine.loss.weighted_batches`), as Hugging Face's Trainer weights them,
    and as nanoGPT's ``loss / gradient_accumulation_steps`` does for its equal micro-batches.

    Frozen parameters (``requires_grad=False``) get neither G nor Z: pair the result with
    :func:`trainable_parameters`.

    Args:
        lr_scale: multiply every group's learning rate by this for the step (Z for a scaled lr).
        dtype: dtype of the returned G and Z; default each parameter's own (float32 for half
            precision, where a difference of two values needs more bits). Differences are taken in
            float64 first, so a bf16 Newton–Schulz step comes back exact.

    Returns:
        ``(G, Z)``, dicts keyed by parameter name (trainable parameters only).

    Raises:
        CurvlabError: no trainable parameters, a non-finite loss, a trainable parameter no optimizer
            holds, optimizers sharing a parameter, or a state that can't be copied.
    """
    named = named_trainable(model)
    if not named:
        raise CurvlabError("the model has no trainable parameters: there is no update")
    optimizers = as_optimizer_list(optimizer)
    names = [n for n, _ in named]
    params = [p for _, p in named]
    held = {id(p): p for o in optimizers for g in o.param_groups for p in g["params"]}
    orphans = [n for n, p in named if id(p) not in held]
    if orphans:
        shown = ", ".join(orphans[:3]) + (f" and {len(orphans) - 3} more" if len(orphans) > 3 else "")
        raise CurvlabError(
            f"no optimizer holds the trainable parameter(s) {shown}: their Z would be 0; pass every optimizer "
            "(a list) or set requires_grad=False on them"
        )
    trainable = {id(p) for p in params}
    others = [p for i, p in held.items() if i not in trainable]  # held but frozen: must not move either
    moved = params + others
    pairs = weighted_batches(batch, loss_fn) if isinstance(batch, (list, Batches)) else [(batch, 1.0)]
    # sharded (FSDP2) parameters: every rank runs the whole batch on gathered weights, keeps its gradient shard
    loss_fn = gathering_loss(loss_fn, dict(named), partial=False)
    copies = [_scaled(copy_optimizer(o), lr_scale) for o in optimizers]
    saved_grads = [p.grad for p in moved]
    before = [p.detach().clone() for p in moved]
    calls = {"n": 0}

    def gradient() -> Tensor:
        """Set every trainable parameter's ``.grad`` to the (clipped) gradient on ``batch``; the loss."""
        with torch.enable_grad():
            total, grads = None, [torch.zeros_like(p) for p in params]
            for b, w in pairs:
                loss = loss_fn(dict(named), b)
                if calls["n"] == 0 and not torch.isfinite(loss):
                    raise CurvlabError("the loss is not finite: no update direction")
                parts = torch.autograd.grad(loss * w, params, allow_unused=True, materialize_grads=True)
                grads = [g + part for g, part in zip(grads, parts)] if len(pairs) > 1 else list(parts)
                total = loss.detach() * w if total is None else total + loss.detach() * w
        calls["n"] += 1
        for p, g in zip(params, grads):
            p.grad = g.detach().clone()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        return total

    try:
        with forked_rng(moved):
            gradient()
            G = {n: p.grad.detach().to(_result_dtype(p, dtype)).clone() for n, p in zip(names, params)}
            at_w = [p.grad.clone() for p in params]  # for a second try with a closure
            for p in others:
                p.grad = None  # a frozen parameter an optimizer holds takes no step
            for k, o in enumerate(optimizers):
                try:
                    _step(copies[k], gradient, _needs_closure(o))
                except Exception as e:
                    if _needs_closure(o) or not _asks_for_closure(e):
                        raise
                    # it wanted a closure (SAM asserts one): again from W and G, on a fresh copy, with
                    # one (G not recomputed: no random draws between the gradient and the step)
                    own = {id(p) for g in o.param_groups for p in g["params"]}
                    with torch.no_grad():
                        for p, b in zip(moved, before):
                            if id(p) in own:  # (the optimizers before it in the list have stepped)
                                p.copy_(b)
                    for p, g in zip(params, at_w):
                        p.grad = g.clone()
                    _step(_scaled(copy_optimizer(o), lr_scale), gradient, True)
        Z = {
            n: (b.double() - p.detach().double()).to(_result_dtype(p, dtype)) for n, b, p in zip(names, before, params)
        }
    finally:
        with torch.no_grad():
            for p, b, g in zip(moved, before, saved_grads):
                p.copy_(b)
                p.grad = g
    return G, Z


def _result_dtype(p: Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None else torch.promote_types(p.dtype, torch.float32)


def _scaled(optimizer: torch.optim.Optimizer, lr_scale: float) -> torch.optim.Optimizer:
    """``optimizer`` (a copy) with every group's learning rate multiplied by ``lr_scale``."""
    if lr_scale != 1.0:
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * lr_scale
    return optimizer


def _step(optimizer: torch.optim.Optimizer, gradient: Callable[[], Tensor], closure: bool) -> None:
    """One ``step()`` of ``optimizer``, given ``gradient`` as its closure if ``closure``."""
    if closure:
        optimizer.step(gradient)
    else:
        optimizer.step()
