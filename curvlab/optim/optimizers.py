r"""Optimizers whose steps curvlab measures, and the side-effect-free next update of any optimizer.

:func:`build_model_optimizer` gives one ``torch.optim.Optimizer`` per name:

* ``"muon"``: :class:`Muon` (``torch.optim.Muon`` with more polar methods and scales) on the hidden
  matrices, ``torch.optim.AdamW`` on embeddings, head, norms and biases, as in modded-nanogpt
  and Moonlight, combined in one :class:`CombinedOptimizer`. The roles come from the model's
  structure (:func:`~curvlab.models.roles.parameter_roles`), not its parameter names;
* ``"adamw"``: ``torch.optim.AdamW`` on everything;
* ``"sgd"``: ``torch.optim.SGD`` with momentum;
* ``"lion"``: :class:`Lion`, a sign-based member (Chen et al. 2023).

:func:`next_update` returns the gradient G and the step :math:`Z = W - W_\text{next}` that an
optimizer *would* take on a batch, leaving model, gradients and optimizer state bit-for-bit as they were.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, MutableMapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from curvlab.engine._gathered import gathering_loss
from curvlab.engine.loss import Batches, weighted_batches
from curvlab.errors import CurvlabError
from curvlab.models.roles import parameter_roles, stored_transposed
from curvlab.optim._sharded import sharded_polar_factors
from curvlab.optim.polar import METHODS as POLAR_METHODS
from curvlab.optim.polar import NEWTON_SCHULZ_COEFFICIENTS, msign
from curvlab.util.distributed import rank_and_world

# AdamW's defaults (docs/science.md section 4: the paper's reference AdamW), and those of the AdamW side of
# every hybrid (Muon's, and the LoRA optimizers' in curvlab.optim.lora): the same, the side tied to AdamW's lr
ADAMW_DEFAULTS = {"lr": 0.0018, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
ADAM_SIDE_DEFAULTS = {f"adam_{k}": v for k, v in ADAMW_DEFAULTS.items()}

SCALES = ("original", "moonlight", "spectral")
OPTIMIZERS = ("muon", "adamw", "sgd", "lion")
LORA_OPTIMIZERS = ("smuon", "lora-muon", "per-factor-muon")  # for peft LoRA models: curvlab.optim.lora


def _evaluate(closure) -> Tensor | None:
    """The loss a ``step(closure)`` returns: the closure evaluated with gradients on, if given."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def muon_scale(shape: tuple[int, ...], scale: str) -> float:
    r"""Muon's per-matrix learning-rate multiplier for a weight of mathematical shape ``rows x cols``
    (:math:`d_\text{out} \times d_\text{in}`; see :func:`matrix_shape`).

    ``"original"``: :math:`\max(1, r/c)^{1/2}` (Keller Jordan); ``"moonlight"``:
    :math:`0.2\max(r, c)^{1/2}` (matches AdamW's update RMS); ``"spectral"``: :math:`(r/c)^{1/2}`.
    """
    rows, cols = shape[0], shape[1]
    if scale == "original":
        return math.sqrt(max(1, rows / cols))
    if scale == "moonlight":
        return 0.2 * math.sqrt(max(rows, cols))
    if scale == "spectral":
        return math.sqrt(rows / cols)
    raise CurvlabError(f"unknown Muon scale {scale!r}; choose one of {', '.join(SCALES)}")


def matrix_shape(p: Tensor, transposed: bool = False) -> tuple[int, int]:
    """The matrix Muon orthogonalizes for parameter ``p``: (out, in) for a 2-D weight (swapped when it
    is stored transposed, as Hugging Face's ``Conv1D``), out x (in/groups * prod k) for a
    convolution kernel."""
    rows, cols = p.shape[0], math.prod(p.shape[1:])
    return (cols, rows) if transposed else (rows, cols)


class Muon(torch.optim.Muon):
    r"""``torch.optim.Muon``, computing its step out of place, with a choice of polar factor and scale.

    Per 2-D parameter W with gradient G (EMA momentum, as torch's):

    .. math::
        B \leftarrow \mu B + (1-\mu) G,\quad
        \tilde B = (1-\mu) G + \mu B \text{ (Nesterov) or } B,\quad
        W \leftarrow (1 - \eta\lambda) W - \eta\, s(W)\, \operatorname{msign}(\tilde B)

    With the defaults (``polar="newton_schulz"``, ``scale="original"``) every step equals
    ``torch.optim.Muon``'s bit for bit, and the state dict has the same layout.

    Parameters of more than 2 dimensions (convolution kernels, out x in/groups x k...) are
    orthogonalized as the out x (in/groups * prod k) matrix they flatten to, and scaled by that
    shape, as Keller Jordan's CIFAR-10 speedrun does (``torch.optim.Muon`` refuses them). A param
    group with ``transposed=True`` holds matrices stored (in, out), like Hugging Face's ``Conv1D``:
    the polar factor doesn't care (msign(Xᵀ) = msign(X)ᵀ) but the scale uses the (out, in) shape.

    Under torch.distributed (gradients already averaged by DDP) the polar factors are shared out: the
    matrices, sorted by size, go round-robin to the ranks, each rank orthogonalizes its own and
    broadcasts them, as Keller Jordan's and modded-nanogpt's distributed Muon do; momentum buffers,
    cheap and elementwise, are updated on every rank. Unlike torch's, the
    momentum buffer is never normalized in place (torch 2.13 does that for bf16 parameters without
    Nesterov). ``weight_decay`` defaults to 0 (torch's to 0.1), as in the reference runs.
    """

    def __init__(
        self,
        params,
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NEWTON_SCHULZ_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        scale: str = "original",
        polar: str = "newton_schulz",
        polar_dtype: torch.dtype | str = torch.bfloat16,
    ):
        muon_scale(torch.Size([1, 1]), scale)  # validates the name
        if isinstance(polar_dtype, str):  # a name from a JSON config, e.g. "float32"
            polar_dtype = getattr(torch, polar_dtype.removeprefix("torch."))
        if polar not in POLAR_METHODS:
            raise CurvlabError(f"unknown polar method {polar!r}; choose one of {', '.join(POLAR_METHODS)}")
        adjust = {"original": "original", "moonlight": "match_rms_adamw", "spectral": None}[scale]
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise CurvlabError(f"Muon needs lr, momentum and weight_decay >= 0, got {lr}, {momentum}, {weight_decay}")
        # torch.optim.Muon's own __init__ refuses parameters that aren't 2-D: set up as it does, minus that
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov}
        defaults |= {"ns_coefficients": ns_coefficients, "eps": eps, "ns_steps": ns_steps, "adjust_lr_fn": adjust}
        torch.optim.Optimizer.__init__(self, params, defaults)
        flat = [tuple(p.shape) for g in self.param_groups for p in g["params"] if p.dim() < 2]
        if flat:
            raise CurvlabError(f"Muon takes matrices (2 or more dimensions); got parameters of shape {flat[:3]}")
        extra = {"scale": scale, "polar": polar, "polar_dtype": polar_dtype, "transposed": False}
        self.defaults.update(extra)
        for group in self.param_groups:
            for k, v in extra.items():
                group.setdefault(k, v)

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        work = []  # (group, param, momentum-averaged update) for every param with a gradient
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                work.append((group, p, p.grad.lerp(buf, mu) if group["nesterov"] else buf))
        if any(isinstance(u, DTensor) for _, _, u in work):  # FSDP2: each whole matrix on one rank
            orthos = sharded_polar_factors(work, _polar_factor)
        else:
            orthos = self._replicated_polar_factors(work)
        for (group, p, _), ortho in zip(work, orthos):
            lr = group["lr"]
            p.mul_(1 - lr * group["weight_decay"])
            shape = matrix_shape(p, group.get("transposed", False))  # (a state dict from before had no flag)
            p.add_(ortho, alpha=-(lr * muon_scale(shape, group["scale"])))
        return loss

    @staticmethod
    def _replicated_polar_factors(work: list) -> list[Tensor]:
        """Polar factors of replicated updates: round robin by size, each broadcast by its owner."""
        rank, world = rank_and_world()
        order = sorted(range(len(work)), key=lambda i: -work[i][1].numel())
        owner = {i: k % world for k, i in enumerate(order)}  # round-robin by size
        orthos = []
        for i, (group, p, update) in enumerate(work):
            if owner[i] == rank:
                # (a tall matrix's factor is a transposed view; collectives need memory order)
                ortho = _polar_factor(group, update).to(p.dtype).contiguous().view(p.shape)
            else:
                ortho = torch.empty_like(p)
            orthos.append(ortho)
        if world > 1:
            for i, ortho in enumerate(orthos):
                dist.broadcast(ortho, src=owner[i])
        return orthos


def _polar_factor(group: dict, update: Tensor) -> Tensor:
    """msign of one whole update with its group's polar settings, shaped like the update."""
    return msign(
        update.reshape(update.shape[0], -1),  # a convolution kernel as out x (in * prod k)
        method=group["polar"],
        steps=group["ns_steps"],
        dtype=group["polar_dtype"],
        coefficients=tuple(group["ns_coefficients"]),
        eps=group["eps"],
    ).reshape(update.shape)


class Lion(torch.optim.Optimizer):
    r"""Lion (Chen et al. 2023), a sign-based optimizer:

    .. math::
        W \leftarrow (1 - \eta\lambda) W - \eta\,\operatorname{sign}(\beta_1 m + (1-\beta_1) G),\quad
        m \leftarrow \beta_2 m + (1-\beta_2) G
    """

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if lr < 0:
            raise CurvlabError(f"Lion learning rate must be >= 0, got {lr}")
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m.lerp(p.grad, 1 - beta1)), alpha=-group["lr"])
                m.lerp_(p.grad, 1 - beta2)
        return loss


class JointState(MutableMapping):
    """The per-parameter state of several optimizers over disjoint parameters, read and written as one
    mapping: ``state[p]`` is the state of ``p`` in the optimizer that holds it."""

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]):
        self._optimizers = list(optimizers)

    def _owner(self, p: Any) -> torch.optim.Optimizer:
        for o in self._optimizers:
            if any(q is p for g in o.param_groups for q in g["params"]):
                return o
        raise KeyError(p)

    def __getitem__(self, p: Any) -> Any:
        return self._owner(p).state[p]  # (a child's defaultdict makes a missing entry, as torch's own)

    def __contains__(self, p: Any) -> bool:
        return any(p in o.state for o in self._optimizers)

    def get(self, p: Any, default: Any = None) -> Any:
        """The state of ``p``, or ``default`` where there is none yet (nothing is made, as ``dict.get``)."""
        return next((o.state[p] for o in self._optimizers if p in o.state), default)

    def __setitem__(self, p: Any, value: Any) -> None:
        self._owner(p).state[p] = value

    def __delitem__(self, p: Any) -> None:
        del self._owner(p).state[p]

    def __iter__(self) -> Iterator[Any]:
        return (p for o in self._optimizers for p in o.state)

    def __len__(self) -> int:
        return sum(len(o.state) for o in self._optimizers)


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, driven as one.

    ``param_groups`` is the concatenation of the children's groups (the same dicts, so an LR scheduler
    on this object drives the children) and ``state`` is the children's states read as one
    (:class:`JointState`; each child keeps its own, so a child's ``state_dict()`` works too), so
    ``state_dict`` and ``load_state_dict`` cover everything in the layout torch uses for a single optimizer.
    """

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]):
        self.optimizers = dict(optimizers)
        if not self.optimizers:
            raise CurvlabError("CombinedOptimizer needs at least one optimizer")
        params = [p for o in self.optimizers.values() for g in o.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise CurvlabError("the combined optimizers share a parameter")
        super().__init__(params, {})
        self._share([g for o in self.optimizers.values() for g in o.param_groups])

    @property
    def state(self) -> JointState:
        return JointState(list(self.optimizers.values()))

    @state.setter
    def state(self, value: Mapping) -> None:
        """Hand each entry to the child holding its parameter (``Optimizer.__init__`` sets an empty one)."""
        joint = self.state
        for p, entry in value.items():
            joint[p] = entry

    def _share(self, groups: list[dict]) -> None:
        """Make ``groups`` (in children's order) both this optimizer's and the children's."""
        start = 0
        for o in self.optimizers.values():
            n = len(o.param_groups)
            o.param_groups = groups[start : start + n]
            start += n
        self.param_groups = groups

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # builds new group dicts and a new state dict
        self._share(self.param_groups)
        # torch's __setstate__ put the new state in __dict__, where the property hides it: hand it out
        loaded = vars(self).pop("state", {})
        for o in self.optimizers.values():
            o.state = defaultdict(dict)
        self.state = loaded

    @torch.no_grad()
    def step(self, closure=None):
        loss = _evaluate(closure)
        for o in self.optimizers.values():
            o.step()
        return loss


def _named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def trainable_parameters(model: nn.Module) -> dict[str, Tensor]:
    """The model's trainable parameters (``requires_grad``), detached: the ``params`` that go with the
    G and Z of :func:`next_update`, which cover exactly these (frozen ones, a LoRA model's base
    weights say, keep their values inside the loss function)."""
    return {n: p.detach() for n, p in _named_trainable(model)}


def default_muon_rule(model: nn.Module) -> Callable[[str, Tensor], bool]:
    """The default split: Muon on the parameters whose role is ``hidden``
    (:func:`~curvlab.models.roles.parameter_roles`: read from the model's structure, so an embedding, the
    head, tied or not, norms and biases never reach Muon)."""
    roles = parameter_roles(model)
    return lambda name, p: roles.get(name) == "hidden"


def build_model_optimizer(
    name: str,
    model: nn.Module,
    muon_rule: Callable[[str, Tensor], bool] | None = None,
    **hyperparameters: Any,
) -> torch.optim.Optimizer:
    """One torch optimizer for all of ``model``'s trainable parameters by name (``"muon"``, ``"adamw"``,
    ``"sgd"``, ``"lion"``); :func:`curvlab.optim.build.build_optimizer` dispatches here and to the LoRA
    optimizers.

    Defaults (docs/science.md sections 4-5): Muon lr 0.02, momentum 0.95, Nesterov, 5 Newton–Schulz
    steps, weight decay 0, with its AdamW side at AdamW's defaults (:data:`ADAM_SIDE_DEFAULTS`); AdamW
    (:data:`ADAMW_DEFAULTS`) lr 0.0018, betas (0.9, 0.95), weight decay 0; SGD lr 0.1, momentum 0.9;
    Lion lr 1e-4, betas (0.9, 0.99).

    For ``"muon"``, the options ``lr``, ``momentum``, ``nesterov``, ``weight_decay``, ``ns_steps``,
    ``scale``, ``polar`` and ``polar_dtype`` go to Muon, and ``adam_lr``, ``adam_betas``,
    ``adam_eps``, ``adam_weight_decay`` to its AdamW side. ``muon_rule(name, param) -> bool`` decides
    which parameters Muon takes (default :func:`default_muon_rule`: the hidden matrices, by
    structure); a vector never reaches Muon. Convolution kernels go to Muon flattened to
    out x (in * prod k) (see :class:`Muon`); Hugging Face ``Conv1D`` weights go in a group marked
    ``transposed``, so that Muon's shape scale reads them as (out, in).

    Raises:
        CurvlabError: an unknown name or option, or a model with no 2-D weights for Muon.
    """
    if name in LORA_OPTIMIZERS:
        raise CurvlabError(f"{name} trains LoRA factors: build it with curvlab.build_optimizer")
    named = _named_trainable(model)
    if not named:
        raise CurvlabError("the model has no trainable parameters")
    hp = dict(hyperparameters)

    def take(defaults: dict[str, Any]) -> dict[str, Any]:
        return {k: hp.pop(k, v) for k, v in defaults.items()}

    if name == "muon":
        muon_hp = take(
            {"lr": 0.02, "momentum": 0.95, "nesterov": True, "weight_decay": 0.0, "ns_steps": 5}
            | {"scale": "original", "polar": "newton_schulz", "polar_dtype": torch.bfloat16}
        )
        adam_hp = take(ADAM_SIDE_DEFAULTS)
        _reject_unknown(name, hp)
        rule = muon_rule or default_muon_rule(model)
        chosen = [(n, p) for n, p in named if rule(n, p)]
        bad = [n for n, p in chosen if p.dim() < 2]
        if bad:
            raise CurvlabError(f"the Muon rule chose parameters that are not matrices: {bad[:3]}")
        if not chosen:
            raise CurvlabError("the model has no hidden weight matrices for Muon; use adamw, or pass muon_rule")
        muon_ids = {id(p) for _, p in chosen}
        rest = [p for _, p in named if id(p) not in muon_ids]
        transposed = stored_transposed(model)
        groups = [
            {"params": [p for n, p in chosen if n not in transposed]},
            {"params": [p for n, p in chosen if n in transposed], "transposed": True},
        ]
        parts = {"muon": Muon([g for g in groups if g["params"]], **muon_hp)}
        if rest:
            parts["adamw"] = torch.optim.AdamW(
                rest,
                lr=adam_hp["adam_lr"],
                betas=tuple(adam_hp["adam_betas"]),
                eps=adam_hp["adam_eps"],
                weight_decay=adam_hp["adam_weight_decay"],
            )
        return CombinedOptimizer(parts)
    params = [p for _, p in named]
    if name == "adamw":
        opt = take(ADAMW_DEFAULTS)
        _reject_unknown(name, hp)
        return torch.optim.AdamW(params, **{**opt, "betas": tuple(opt["betas"])})
    if name == "sgd":
        opt = take({"lr": 0.1, "momentum": 0.9, "nesterov": False, "weight_decay": 0.0})
        _reject_unknown(name, hp)
        return torch.optim.SGD(params, **opt)
    if name == "lion":
        opt = take({"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0})
        _reject_unknown(name, hp)
        return Lion(params, **{**opt, "betas": tuple(opt["betas"])})
    raise CurvlabError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS + LORA_OPTIMIZERS)}")


def _reject_unknown(name: str, leftover: dict[str, Any]) -> None:
    if leftover:
        raise CurvlabError(f"unknown option(s) for {name}: {', '.join(sorted(leftover))}")


Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]


def as_optimizer_list(optimizer: Optimizers) -> list[torch.optim.Optimizer]:
    """``optimizer`` as a list: one optimizer, or a list/tuple of optimizers over disjoint parameters
    (a user's own ``torch.optim.Muon`` on the matrices and ``AdamW`` on the rest, say)."""
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    if not optimizers:
        raise CurvlabError("no optimizer given")
    bad = [type(o).__name__ for o in optimizers if not isinstance(o, torch.optim.Optimizer)]
    if bad:
        raise CurvlabError(f"not a torch.optim.Optimizer: {', '.join(bad)}")
    seen: set[int] = set()
    for o in optimizers:
        ids = {id(p) for g in o.param_groups for p in g["params"]}
        if ids & seen:
            raise CurvlabError("the optimizers given share a parameter: each parameter must have one optimizer")
        seen |= ids
    return optimizers


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
    named = _named_trainable(model)
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
