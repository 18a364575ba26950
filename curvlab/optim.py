r"""Optimizers whose steps curvlab measures, and the side-effect-free next update of any optimizer.

:func:`build_optimizer` gives one ``torch.optim.Optimizer`` per name:

* ``"muon"``: :class:`Muon` (``torch.optim.Muon`` with more polar methods and scales) on the hidden
  matrices, ``torch.optim.AdamW`` on embeddings, head, norms and biases, as in modded-nanogpt
  and Moonlight, combined in one :class:`CombinedOptimizer`. The roles come from the model's
  structure (:func:`~curvlab.roles.parameter_roles`), not its parameter names;
* ``"adamw"``: ``torch.optim.AdamW`` on everything;
* ``"sgd"``: ``torch.optim.SGD`` with momentum;
* ``"lion"``: :class:`Lion`, a sign-based member (Chen et al. 2023).

:func:`next_update` returns the gradient G and the step :math:`Z = W - W_\text{next}` that an
optimizer *would* take on a batch, leaving model, gradients and optimizer state bit-for-bit as they were.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from curvlab.distributed import rank_and_world
from curvlab.errors import CurvlabError
from curvlab.loss import Batches, weighted_batches
from curvlab.polar import METHODS as POLAR_METHODS
from curvlab.polar import NEWTON_SCHULZ_COEFFICIENTS, msign
from curvlab.roles import parameter_roles, stored_transposed
from curvlab.sharded import gathering_loss
from curvlab.sharded_optim import sharded_polar_factors

SCALES = ("original", "moonlight", "spectral")
OPTIMIZERS = ("muon", "adamw", "sgd", "lion")
LORA_OPTIMIZERS = ("smuon", "lora-muon", "per-factor-muon")  # for peft LoRA models: curvlab.lora


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


class CombinedOptimizer(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, driven as one.

    ``param_groups`` is the concatenation of the children's groups (the same dicts, so an LR scheduler
    on this object drives the children) and all children share one ``state`` dict, so ``state_dict``
    and ``load_state_dict`` cover everything in the layout torch uses for a single optimizer.
    """

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]):
        self.optimizers = dict(optimizers)
        if not self.optimizers:
            raise CurvlabError("CombinedOptimizer needs at least one optimizer")
        params = [p for o in self.optimizers.values() for g in o.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise CurvlabError("the combined optimizers share a parameter")
        super().__init__(params, {})
        for o in self.optimizers.values():
            self.state.update(o.state)
        self._share([g for o in self.optimizers.values() for g in o.param_groups])

    def _share(self, groups: list[dict]) -> None:
        """Make ``groups`` (in children's order) both this optimizer's and the children's, and give
        every child this optimizer's state dict."""
        start = 0
        for o in self.optimizers.values():
            n = len(o.param_groups)
            o.param_groups = groups[start : start + n]
            o.state = self.state
            start += n
        self.param_groups = groups

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # builds new group dicts and a new state dict
        self._share(self.param_groups)

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
    (:func:`~curvlab.roles.parameter_roles`: read from the model's structure, so an embedding, the
    head, tied or not, norms and biases never reach Muon)."""
    roles = parameter_roles(model)
    return lambda name, p: roles.get(name) == "hidden"


def build_optimizer(
    name: str,
    model: nn.Module,
    muon_rule: Callable[[str, Tensor], bool] | None = None,
    **hyperparameters: Any,
) -> torch.optim.Optimizer:
    """One torch optimizer for ``model`` by name (``"muon"``, ``"adamw"``, ``"sgd"``, ``"lion"``).

    Defaults (SCIENCE.md sections 4-5): Muon lr 0.02, momentum 0.95, Nesterov, 5 Newton–Schulz
    steps, weight decay 0, with its AdamW side at lr 0.0036 and betas (0.9, 0.95); AdamW lr 0.0018,
    betas (0.9, 0.95), weight decay 0; SGD lr 0.1, momentum 0.9; Lion lr 1e-4, betas (0.9, 0.99).

    For ``"muon"``, the options ``lr``, ``momentum``, ``nesterov``, ``weight_decay``, ``ns_steps``,
    ``scale``, ``polar`` and ``polar_dtype`` go to Muon, and ``adam_lr``, ``adam_betas``,
    ``adam_eps``, ``adam_weight_decay`` to its AdamW side. ``muon_rule(name, param) -> bool`` decides
    which parameters Muon takes (default :func:`default_muon_rule`: the hidden matrices, by
    structure); a vector never reaches Muon. Convolution kernels go to Muon flattened to
    out x (in * prod k) (see :class:`Muon`); Hugging Face ``Conv1D`` weights go in a group marked
    ``transposed``, so that Muon's shape scale reads them as (out, in).

    ``"smuon"``, ``"lora-muon"`` and ``"per-factor-muon"`` train the factors of a peft LoRA model
    (:func:`curvlab.lora.build_lora_optimizer`); ``"adamw"`` on such a model is their baseline.

    Raises:
        CurvlabError: an unknown name or option, or a model with no 2-D weights for Muon.
    """
    if name in LORA_OPTIMIZERS:
        from curvlab.lora import build_lora_optimizer  # imported here: curvlab.lora builds on this module

        if muon_rule is not None:
            raise CurvlabError(f"muon_rule applies to muon only, not to {name}")
        return build_lora_optimizer(name, model, **hyperparameters)
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
        adam_hp = take({"adam_lr": 0.0036, "adam_betas": (0.9, 0.95), "adam_eps": 1e-8, "adam_weight_decay": 0.0})
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
        opt = take({"lr": 0.0018, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0})
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


def _copy_state(optimizer: torch.optim.Optimizer) -> dict:
    """A deep copy of each parameter's state (tensors cloned), keyed by the same parameter objects."""
    try:
        return {
            p: {k: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in s.items()}
            for p, s in optimizer.state.items()
        }
    except Exception as e:  # any failure here means the state can't be copied
        raise CurvlabError(f"the state of {type(optimizer).__name__} can't be copied: {e}") from e


def _copy_groups(optimizer: torch.optim.Optimizer) -> list[dict]:
    return [
        {k: v.clone() if isinstance(v, Tensor) else copy.deepcopy(v) for k, v in g.items() if k != "params"}
        for g in optimizer.param_groups
    ]


def next_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[Mapping[str, Tensor], Any], Tensor],
    batch: Any,
    lr_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
    max_grad_norm: float | None = None,
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    r"""The gradient G and the step :math:`Z = W - W_\text{next}` that ``optimizer`` would take on ``batch``.

    G is computed as a training step computes it (autograd through ``loss_fn`` on the model's own
    parameters, in the model's current mode: dropout is live in train mode), optionally clipped to
    ``max_grad_norm`` as the training loop does; then the optimizer really steps, on cloned state,
    and everything is put back: parameters, their ``.grad`` (the same objects), the optimizer's
    per-parameter state (the same tensor objects), its param groups, and torch's global RNG state
    (so dropout here doesn't change the masks of the user's later steps). Z includes learning rate,
    schedule, momentum, bias correction and weight decay.

    A list of micro-batches (or :class:`~curvlab.loss.Batches`) is one step with gradient
    accumulation: :math:`G = \sum_j w_j \nabla L_j` with :math:`w_j` each micro-batch's share of
    the loss terms (:func:`~curvlab.loss.weighted_batches`), as Hugging Face's Trainer weights them,
    and as nanoGPT's ``loss / gradient_accumulation_steps`` does for its equal micro-batches.

    Frozen parameters (``requires_grad=False``) get neither G nor Z: pair the result with
    :func:`trainable_parameters`.

    Args:
        lr_scale: multiply every group's learning rate by this for the step (Z for a scaled lr).
        dtype: dtype of the returned G and Z (float32 default; differences are taken in float64 first,
            so a bf16 Newton–Schulz step comes back exact).

    Returns:
        ``(G, Z)``, dicts keyed by parameter name (trainable parameters only).
    """
    named = _named_trainable(model)
    if not named:
        raise CurvlabError("the model has no trainable parameters: there is no update")
    names = [n for n, _ in named]
    params = [p for _, p in named]
    pairs = weighted_batches(batch, loss_fn) if isinstance(batch, (list, Batches)) else [(batch, 1.0)]
    # sharded (FSDP2) parameters: every rank runs the whole batch on gathered weights, keeps its gradient shard
    loss_fn = gathering_loss(loss_fn, dict(named), partial=False)
    saved_state = dict(optimizer.state)  # the original per-parameter dicts, put back untouched
    cloned_state = _copy_state(optimizer)
    saved_groups = _copy_groups(optimizer)
    saved_grads = [p.grad for p in params]
    before = [p.detach().clone() for p in params]
    devices = sorted({p.device.index or 0 for p in params if p.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            grads = [torch.zeros_like(p) for p in params]
            for b, w in pairs:
                loss = loss_fn(dict(named), b)
                if not torch.isfinite(loss):
                    raise CurvlabError("the loss is not finite: no update direction")
                parts = torch.autograd.grad(loss * w, params, allow_unused=True, materialize_grads=True)
                grads = [g + part for g, part in zip(grads, parts)] if len(pairs) > 1 else list(parts)
        for p, g in zip(params, grads):
            p.grad = g.detach().clone()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
        G = {n: p.grad.detach().to(dtype).clone() for n, p in zip(names, params)}
        optimizer.state.clear()
        optimizer.state.update(cloned_state)
        for g in optimizer.param_groups:
            g["lr"] = g["lr"] * lr_scale
        optimizer.step()
        Z = {n: (b.double() - p.detach().double()).to(dtype) for n, b, p in zip(names, before, params)}
    finally:
        with torch.no_grad():
            for p, b, g in zip(params, before, saved_grads):
                p.copy_(b)
                p.grad = g
        optimizer.state.clear()
        optimizer.state.update(saved_state)
        for group, saved in zip(optimizer.param_groups, saved_groups):
            for k in [k for k in group if k != "params"]:
                del group[k]
            group.update(saved)
    return G, Z
