r"""The side-effect-free next update of any optimizer: :func:`next_update` returns the gradient G and the step
:math:`Z = W - W_\text{next}` that an optimizer *would* take on a batch, leaving model, gradients and optimizer
state bit-for-bit as they were.
"""

from __future__ import annotations

import copy
import enum
import inspect
import traceback
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from curvlab.engine.gathered import gathering_loss
from curvlab.engine.loss import Batches, weighted_batches
from curvlab.errors import CurvlabError
from curvlab.optim.combined import Optimizers, as_optimizer_list
from curvlab.optim.model_optimizer import named_trainable
from curvlab.steps._no_trace import SideState, left_as_found


def _reachable_optimizers(root: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """``root`` and every optimizer it holds, at any depth of its attributes' dicts, lists and tuples
    (Lookahead's inner optimizer, SAM's base optimizer)."""
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
    """A deep copy of ``optimizer`` and of every optimizer it holds, over the same parameter objects: every
    attribute a step can mutate is copied (``copy.deepcopy`` alone won't do:
    ``Optimizer.__getstate__`` keeps only ``defaults``, ``state`` and ``param_groups``), but an LR
    scheduler's ``step`` wrapper, which would call the original's step. A tensor of the state that lies
    in a parameter's memory stays a view of that parameter (:func:`_parameter_views`).

    Raises:
        CurvlabError: some part of the state can't be copied.
    """
    optimizers = _reachable_optimizers(optimizer)
    params = [p for o in optimizers for group in o.param_groups for p in group["params"]]
    memo: dict[int, Any] = {id(p): p for p in params}  # the same parameters: only the optimizer's own data is copied
    pairs = [(o, object.__new__(type(o))) for o in optimizers]
    memo.update({id(o): shell for o, shell in pairs})
    attrs = [
        {k: v for k, v in vars(o).items() if not (k == "step" and hasattr(v, "_wrapped_by_lr_sched"))}
        for o in optimizers
    ]
    try:
        views = _parameter_views(attrs, params)
        memo.update({id(t): alias for t, alias in views})
        for t, alias in views:  # (attributes a view carries, as a copied tensor keeps its own)
            vars(alias).update(copy.deepcopy(vars(t), memo))
        for (_, shell), own in zip(pairs, attrs):
            vars(shell).update(copy.deepcopy(own, memo))
    except Exception as e:  # any failure here means the state can't be copied
        raise CurvlabError(f"the state of {type(optimizer).__name__} can't be copied: {e}") from e
    return memo[id(optimizer)]


def _storage_key(t: Tensor) -> tuple[torch.device, int] | None:
    """Where ``t``'s memory lies (device, address of its storage); ``None`` where it has none of its own."""
    if t.device.type == "meta":
        return None
    try:
        address = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return (t.device, address) if address else None


# what a deep copy keeps as it is (or, for a bound method, rebinds): nothing inside is copied
_OPAQUE = (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType)


def _parameter_views(roots: list[Any], params: list[Tensor]) -> list[tuple[Tensor, Tensor]]:
    """(tensor, alias) for every tensor reachable from ``roots`` (through containers and objects'
    attributes) that lies in a parameter's memory but isn't a parameter (heavyball's SOAP keeps its
    parameters' reshaped views): the alias is the same view of that parameter, so that the copy's step
    writes to the parameter as the original's would (a deep copy would give it memory of its own)."""
    owners: dict[tuple[torch.device, int], Tensor] = {}
    for p in params:
        key = _storage_key(p)
        if key is not None:
            owners.setdefault(key, p)
    found: list[tuple[Tensor, Tensor]] = []
    ids = {id(p) for p in params}
    stack, seen = list(roots), set(ids)
    while stack and owners:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, Tensor):
            key = _storage_key(x)
            if key in owners:
                found.append((x, _alias(x, owners[key])))
        elif isinstance(x, Mapping):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack.extend(x)
        elif not isinstance(x, _OPAQUE) and isinstance(getattr(x, "__dict__", None), dict):
            stack.extend(x.__dict__.values())
    return found


def _alias(view: Tensor, owner: Tensor) -> Tensor:
    """A tensor on ``owner``'s memory with ``view``'s dtype, shape, strides and offset: a view of ``owner``
    (made without autograd, as an optimizer's step makes its views), or of its memory where the dtypes differ."""
    with torch.no_grad():
        if view.dtype == owner.dtype:
            return owner.as_strided(view.shape, view.stride(), view.storage_offset())
        return torch.empty(0, dtype=view.dtype, device=view.device).set_(
            owner.untyped_storage(), view.storage_offset(), view.shape, view.stride()
        )


def next_update(
    model: nn.Module,
    optimizer: Optimizers,
    loss_fn: Callable[[Mapping[str, Tensor], Any], Tensor],
    batch: Any,
    *,
    lr_scale: float = 1.0,
    dtype: torch.dtype | None = None,
    max_grad_norm: float | None = None,
    grad_norm_type: float = 2.0,
    max_grad_value: float | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    r"""The gradient G and the step :math:`Z = W - W_\text{next}` that ``optimizer`` would take on ``batch``.

    It takes the model, not a parameter dict, because the step is the model's: the optimizer's real
    ``step()`` runs on the module's own parameters, and G comes from autograd on them in the module's
    current mode (dropout live in train mode, BatchNorm on the batch's statistics).

    G is computed (and clipped) as a training step computes it; then a copy of the optimizer
    (:func:`copy_optimizer`) really steps (a parameter without gradient keeps ``.grad = None``; its G is
    reported as zeros). Afterwards the optimizer, the parameters, their ``.grad``, every module's buffers
    and attributes and the random streams of torch, numpy and Python are as before; gradient and step
    draw from those streams as the real step then will (SGLD, PSGD, Kron take the very same draws). Z
    includes learning rate, schedule, momentum, bias correction and weight decay.

    ``optimizer`` may be a list or tuple of optimizers over disjoint parameters: each steps, as a loop
    calling each ``step()`` would. A trainable parameter that no optimizer holds is refused by name (its
    Z would silently be 0). Each step is taken as the optimizer asks for it:

    - with a closure whenever its ``step`` takes one, read from its signature (where the signature can't
      tell, a plain ``step()`` that fails is tried again with one; in a list, an optimizer after the
      first gets its optional closure only if a plain ``step()`` fails). The closure's first evaluation
      at W gives G again, computed once as in a training loop; every other evaluation (SAM's ascent point,
      L-BFGS's line search) computes the gradient where the parameters then are;
    - with the gradient's graph (``backward(create_graph=True)``) when a step with a detached gradient
      fails: Hessian-reading optimizers (AdaHessian, SophiaH) differentiate ``.grad``.

    Each try starts afresh from where the optimizer's turn began; a step that no try can take is refused
    in one line by the optimizer's name. A list of micro-batches (or :class:`~curvlab.engine.loss.Batches`)
    is one step with gradient accumulation: :math:`G = \sum_j w_j \nabla L_j` with :math:`w_j` each
    micro-batch's share of the loss terms, as Hugging Face's Trainer weights them. Frozen parameters get
    neither G nor Z: pair the result with :func:`~curvlab.optim.model_optimizer.trainable_parameters`.

    Args:
        model: the module the optimizer trains, in the mode its training step runs in.
        optimizer: a torch optimizer over ``model``'s parameters, or a list or tuple of them over disjoint
            parameters; never modified.
        loss_fn: ``loss_fn(params, batch) -> scalar`` (e.g. :func:`~curvlab.engine.loss.make_loss_fn`).
        batch: one batch, or a ``list``/:class:`~curvlab.engine.loss.Batches` of micro-batches (one step
            with gradient accumulation).
        lr_scale: multiply every group's learning rate by this for the step (Z for a scaled lr).
        dtype: dtype of the returned G and Z; default each parameter's own (float32 for half
            precision). Differences are taken in float64 first, so a bf16 step comes back exact.
        max_grad_norm: clip the gradient by its total norm over the trainable parameters, as
            ``torch.nn.utils.clip_grad_norm_`` does. Default ``None``: no clipping.
        grad_norm_type: the norm ``max_grad_norm`` bounds, as ``clip_grad_norm_``'s ``norm_type``: 2.0
            (the default), ``float("inf")``, or any other p > 0.
        max_grad_value: clip every gradient entry to ``[-max_grad_value, max_grad_value]``, as
            ``torch.nn.utils.clip_grad_value_`` does. Not with ``max_grad_norm`` (their order changes the step).

    Returns:
        ``(G, Z)``, dicts keyed by parameter name (trainable parameters only).

    Raises:
        CurvlabError: no trainable parameters, a non-finite loss, a trainable parameter no optimizer
            holds, optimizers sharing a parameter, a state that can't be copied, a step that can't be
            taken in any of the ways above, or clipping that can't be done.
    """
    clip = _clipping(max_grad_norm, grad_norm_type, max_grad_value)
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
    saved_grads = [p.grad for p in moved]
    before = [p.detach().clone() for p in moved]
    evaluations = 0

    def gradient(graph: bool = False) -> tuple[Tensor, list[Tensor | None]]:
        """Set ``.grad`` to the (clipped) gradient on ``batch`` at the parameters' values now (``None`` where
        a parameter gets none; with its graph if ``graph``); the loss and those gradients."""
        nonlocal evaluations
        with torch.enable_grad():
            total, grads = None, [None] * len(params)
            for b, w in pairs:
                loss = loss_fn(dict(named), b)
                if evaluations == 0 and not torch.isfinite(loss):
                    raise CurvlabError("the loss is not finite: no update direction")
                parts = torch.autograd.grad(loss * w, params, allow_unused=True, create_graph=graph)
                grads = [part if g is None else g if part is None else g + part for g, part in zip(grads, parts)]
                total = loss.detach() * w if total is None else total + loss.detach() * w
        evaluations += 1
        for p, g in zip(params, grads):
            p.grad = None if g is None else g if graph else g.detach().clone()
        clip(params)
        return total, [p.grad for p in params]

    try:
        with left_as_found(model, moved) as before_g:
            loss_at_w, at_w = gradient()
            G = {
                n: (torch.zeros_like(p) if g is None else g).detach().to(_result_dtype(p, dtype)).clone()
                for n, p, g in zip(names, params, at_w)
            }
            start = _Start(model, params, others, before, loss_at_w, at_w, before_g, SideState.capture(model, moved))
            for k, o in enumerate(optimizers):
                _step_as_asked(o, start, gradient, lr_scale, first=k == 0)
        Z = {
            n: (b.double() - p.detach().double()).to(_result_dtype(p, dtype)) for n, b, p in zip(names, before, params)
        }
    finally:
        with torch.no_grad():
            for p, b, g in zip(moved, before, saved_grads):
                p.copy_(b)
                p.grad = g
    return G, Z


def _clipping(
    max_grad_norm: float | None, grad_norm_type: float, max_grad_value: float | None
) -> Callable[[list[Tensor]], None]:
    """What clips the parameters' ``.grad`` in place, as torch's ``clip_grad_norm_`` or ``clip_grad_value_``
    does in the training loop (nothing, with neither bound)."""
    if max_grad_norm is not None and max_grad_value is not None:
        raise CurvlabError(
            "pass max_grad_norm or max_grad_value, not both: which comes first changes the step, and loops differ"
        )
    for name, bound in (("max_grad_norm", max_grad_norm), ("max_grad_value", max_grad_value)):
        # (torch takes a negative bound: a value bound would clamp with min > max, a norm bound flip G)
        if bound is not None and not (isinstance(bound, (int, float)) and bound >= 0):
            raise CurvlabError(f"{name} must be a number >= 0, got {bound!r}")
    if not (isinstance(grad_norm_type, (int, float)) and grad_norm_type > 0):
        raise CurvlabError(f"grad_norm_type must be a number p > 0 or float('inf'), got {grad_norm_type!r}")
    if max_grad_norm is not None:
        return lambda params: torch.nn.utils.clip_grad_norm_(params, max_grad_norm, norm_type=grad_norm_type)
    if max_grad_value is not None:
        return lambda params: torch.nn.utils.clip_grad_value_(params, max_grad_value)
    return lambda params: None


@dataclass(frozen=True)
class _Start:
    """What every try of every optimizer's step starts from: the trainable parameters and the frozen ones an
    optimizer holds (``others``), their values at W (``before``), G (``at_w``) and its loss, and the model's
    side state before and after G."""

    model: nn.Module
    params: list[Tensor]
    others: list[Tensor]
    before: list[Tensor]
    loss: Tensor
    at_w: list[Tensor | None]
    before_g: SideState
    after_g: SideState


class _Way(enum.Enum):
    """A way of taking a step: ``step()``; ``step(closure)``; or with the gradient's graph in ``.grad``
    (``backward(create_graph=True)``; with a closure if the step takes one)."""

    PLAIN = "plain"
    CLOSURE = "closure"
    GRAPH = "graph"


def _step_method(optimizer: torch.optim.Optimizer) -> Callable[..., Any]:
    """The ``step`` a copy of ``optimizer`` runs: the instance's own (a user's patch) but an LR scheduler's
    wrapper, else its class's."""
    own = vars(optimizer).get("step")
    return own if own is not None and not hasattr(own, "_wrapped_by_lr_sched") else type(optimizer).step


def _takes_closure(optimizer: torch.optim.Optimizer) -> str | None:
    """Whether the step takes a ``closure``: ``"required"`` (no default: L-BFGS), ``"optional"``, ``"no"``,
    or ``None`` where its signature can't tell (a ``step(*args, **kwargs)`` wrapper)."""
    try:
        parameters = inspect.signature(_step_method(optimizer)).parameters
    except (TypeError, ValueError):
        return None
    closure = parameters.get("closure")
    if closure is not None:
        return "required" if closure.default is inspect.Parameter.empty else "optional"
    kinds = {x.kind for x in parameters.values()}
    return None if kinds & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD} else "no"


def _ways(takes: str | None, first: bool) -> list[_Way]:
    """The tries of a step, in order: a closure first when the step requires one, or takes one and comes
    first in the list (a list stands for ``backward()`` then each ``step()``); the graph last."""
    if takes == "no":
        return [_Way.PLAIN, _Way.GRAPH]
    if takes == "required" or (takes == "optional" and first):
        return [_Way.CLOSURE, _Way.GRAPH]
    return [_Way.PLAIN, _Way.CLOSURE, _Way.GRAPH]


def _step_as_asked(
    optimizer: torch.optim.Optimizer,
    start: _Start,
    gradient: Callable[[bool], tuple[Tensor, list[Tensor | None]]],
    lr_scale: float,
    first: bool,
) -> None:
    """Step a copy of ``optimizer`` in the first of its :func:`_ways` that works. Every try starts from
    where its turn began: its own parameters there, G as ``.grad``, the buffers and random streams there
    (``first``: the first optimizer of the list, whose turn begins at W, right after G)."""
    own = {id(p) for g in optimizer.param_groups for p in g["params"]}
    mine = [(p, p.detach().clone()) for p in start.params + start.others if id(p) in own]
    turn = start.after_g if first else SideState.capture(start.model, start.params + start.others)
    takes = _takes_closure(optimizer)
    failures: list[str] = []
    cause: Exception | None = None
    for way in _ways(takes, first):
        with torch.no_grad():
            for p, value in mine:  # a failed try changes nothing for the next
                p.copy_(value)
        turn.restore()
        try:
            if way is _Way.GRAPH:
                loss, grads = _graph_gradient(start, turn, gradient, first)
            else:
                loss, grads = start.loss, start.at_w
                for p, g in zip(start.params, grads):
                    p.grad = None if g is None else g.clone()
            for p in start.others:
                p.grad = None  # a frozen parameter an optimizer holds takes no step
            at_w = start.before[: len(start.params)] if first else None
            closure = _Closure(start.params, at_w, gradient, way is _Way.GRAPH, loss, grads)
            stepped = _scaled(copy_optimizer(optimizer), lr_scale)
            if way is _Way.CLOSURE or (way is _Way.GRAPH and takes in ("required", "optional")):
                stepped.step(closure)
            else:
                stepped.step()
            return
        except (CurvlabError, torch.OutOfMemoryError):
            raise
        except Exception as e:  # any other failure: the next way of taking the step
            failures.append(f"{way.value}: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
            if cause is None:
                cause = e
                # its frames hold the failed copy of the optimizer and the gradient's graph: let them go
                traceback.clear_frames(e.__traceback__)
    raise CurvlabError(
        f"{type(optimizer).__name__}.step can't be taken on a copy in any way curvlab knows ({'; '.join(failures)})"
    ) from cause


def _graph_gradient(
    start: _Start,
    turn: SideState,
    gradient: Callable[[bool], tuple[Tensor, list[Tensor | None]]],
    first: bool,
) -> tuple[Tensor, list[Tensor | None]]:
    """G again, with its graph: at W, from the buffers and draws G was computed with. A later optimizer's
    parameters go to W and back, in place, and its turn's side state is put back (that graph no longer
    backs a second differentiation, as in a loop)."""
    start.before_g.restore()
    if first:
        return gradient(True)
    now = [p.detach().clone() for p in start.params]
    with torch.no_grad():
        for p, b in zip(start.params, start.before):
            p.copy_(b)
    try:
        return gradient(True)
    finally:
        with torch.no_grad():
            for p, value in zip(start.params, now):
                p.copy_(value)
        turn.restore()


@dataclass
class _Closure:
    """A step's closure: sets ``.grad`` and returns the loss. Its first call, with the parameters still at W
    (``at_w``, their values there; ``None``: the step began elsewhere), gives G again; every other call
    computes the gradient where the parameters then are. (W is told by value: a fused kernel may move a
    parameter without counting a version.)"""

    params: list[Tensor]
    at_w: list[Tensor] | None
    gradient: Callable[[bool], tuple[Tensor, list[Tensor | None]]]
    graph: bool
    loss: Tensor
    grads: list[Tensor | None]

    def __call__(self) -> Tensor:
        at_w, self.at_w = self.at_w, None  # only the first call may give G again
        if at_w is None or not all(torch.equal(p, w) for p, w in zip(self.params, at_w)):
            return self.gradient(self.graph)[0]
        for p, g in zip(self.params, self.grads):
            p.grad = None if g is None else g if self.graph else g.clone()
        return self.loss


def _result_dtype(p: Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None else torch.promote_types(p.dtype, torch.float32)


def _scaled(optimizer: torch.optim.Optimizer, lr_scale: float) -> torch.optim.Optimizer:
    """``optimizer`` (a copy) with every group's learning rate multiplied by ``lr_scale``."""
    if lr_scale != 1.0:
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * lr_scale
    return optimizer
