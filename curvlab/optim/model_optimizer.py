"""A model's optimizer by name (:func:`build_model_optimizer`):

* ``"muon"``: :class:`~curvlab.optim.muon.Muon` on the hidden matrices, ``torch.optim.AdamW`` on embeddings, head,
  norms and biases, as in modded-nanogpt and Moonlight, combined in one
  :class:`~curvlab.optim.combined.CombinedOptimizer`. The roles come from the model's structure
  (:func:`~curvlab.models.roles.parameter_roles`), not its parameter names;
* ``"adamw"``: ``torch.optim.AdamW`` on everything, in one param group, or with ``hidden_lr`` in two: the rest
  at ``lr``, the hidden matrices at ``hidden_lr`` (µP-style learning rates that transfer across width);
* ``"sgd"``: ``torch.optim.SGD`` with momentum;
* ``"lion"``: :class:`~curvlab.optim.lion.Lion`, a sign-based member (Chen et al. 2023).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from curvlab.errors import CurvlabError
from curvlab.models.roles import parameter_roles, stack_sizes, stored_transposed
from curvlab.optim.combined import CombinedOptimizer
from curvlab.optim.lion import Lion
from curvlab.optim.muon import Muon

# AdamW's defaults (docs/science.md section 4: the paper's reference AdamW), and those of the AdamW side of
# every hybrid (Muon's, and the LoRA optimizers' in curvlab.optim.lora): the same, the side tied to AdamW's lr
ADAMW_DEFAULTS = {"lr": 0.0018, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
ADAM_SIDE_DEFAULTS = {f"adam_{k}": v for k, v in ADAMW_DEFAULTS.items()}
OPTIMIZERS = ("muon", "adamw", "sgd", "lion")
LORA_OPTIMIZERS = ("smuon", "lora-muon", "per-factor-muon")  # for peft LoRA models: curvlab.optim.lora


def named_trainable(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def trainable_parameters(model: nn.Module) -> dict[str, Tensor]:
    """The model's trainable parameters (``requires_grad``), detached: the ``params`` that go with the
    G and Z of :func:`~curvlab.steps.update.next_update`, which cover exactly these (frozen ones, a LoRA model's base
    weights say, keep their values inside the loss function).

    Args:
        model: any ``nn.Module``.

    Returns:
        ``{name: tensor}`` in ``named_parameters`` order, sharing storage with the model's parameters.
    """
    return {n: p.detach() for n, p in named_trainable(model)}


def default_muon_rule(model: nn.Module) -> Callable[[str, Tensor], bool]:
    """The default split: Muon on the parameters whose role is ``hidden``
    (:func:`~curvlab.models.roles.parameter_roles`: read from the model's structure, so an embedding, the
    head, tied or not, norms and biases never reach Muon)."""
    roles = parameter_roles(model)
    return lambda name, p: roles.get(name) == "hidden"


def adamw(params: list, options: dict[str, Any], prefix: str = "") -> torch.optim.AdamW:
    """``torch.optim.AdamW`` with the options of :data:`ADAMW_DEFAULTS`, named with ``prefix`` in ``options``
    (``"adam_"``: a hybrid's AdamW side, :data:`ADAM_SIDE_DEFAULTS`)."""
    kw = {k: options[prefix + k] for k in ADAMW_DEFAULTS}
    return torch.optim.AdamW(params, **{**kw, "betas": tuple(kw["betas"])})


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

    For ``"adamw"``, ``hidden_lr`` (default None: every parameter in one param group at ``lr``, as AdamW's
    state dicts have always been) gives the hidden matrices a learning rate of their own: µP-style transfer
    across width, where AdamW's lr on the hidden matrices scales as 1/width while the embeddings, head,
    norms and biases keep theirs. AdamW then has two param groups: group 0 every other parameter at
    ``lr`` (the one training logs), group 1 the hidden matrices at ``hidden_lr``, chosen as Muon's are
    (``muon_rule``, default :func:`default_muon_rule`: by structure). Its edge of stability is
    measured at the larger lr with each group's P scaled to it (:mod:`curvlab.optim.adam`).

    For ``"muon"``, the options ``lr``, ``momentum``, ``nesterov``, ``weight_decay``, ``ns_steps``,
    ``scale``, ``polar`` and ``polar_dtype`` go to Muon, and ``adam_lr``, ``adam_betas``,
    ``adam_eps``, ``adam_weight_decay`` to its AdamW side. ``muon_rule(name, param) -> bool`` decides
    which parameters Muon takes (default :func:`default_muon_rule`: the hidden matrices, by
    structure); a vector never reaches Muon. Convolution kernels, Hugging Face ``Conv1D`` weights (a group
    marked ``transposed``) and fused MoE experts (a group marked ``stacked``) go to Muon as :class:`Muon` says.

    Raises:
        CurvlabError: an unknown name or option, a model with no 2-D weights for Muon, or a ``hidden_lr``
            that is not a number > 0 or with no hidden matrices to take it.
    """
    if name in LORA_OPTIMIZERS:
        raise CurvlabError(f"{name} trains LoRA factors: build it with curvlab.build_optimizer")
    named = named_trainable(model)
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
        reject_unknown_options(name, hp)
        chosen, rest = split_hidden(model, named, muon_rule, "the Muon rule")
        if not chosen:
            raise CurvlabError("the model has no hidden weight matrices for Muon; use adamw, or pass muon_rule")
        transposed, sizes = stored_transposed(model), stack_sizes(model)
        # Muon's stacked flag: True for a 3-D stack (its first dimension counts the matrices), the count for
        # a 2-D one (DBRX's experts, stacked by rows), whose shape can't tell it
        stacked = {n: (p.dim() == 3 or sizes[n]) if n in sizes else False for n, p in chosen}
        keys = [(False, False), (True, False), (False, True), (True, True)]
        keys += sorted({(n in transposed, stacked[n]) for n, _ in chosen} - set(keys))
        groups = [  # (in the order models without stacks had, so their optimizer state dicts still load)
            {
                "params": [p for n, p in chosen if (n in transposed, stacked[n]) == (t, s)],
                **({"transposed": True} if t else {}),
                **({"stacked": s} if s is not False else {}),
            }
            for t, s in keys
        ]
        parts = {"muon": Muon([g for g in groups if g["params"]], **muon_hp)}
        if rest:
            parts["adamw"] = adamw(rest, adam_hp, prefix="adam_")
        return CombinedOptimizer(parts)
    params = [p for _, p in named]
    if name == "adamw":
        opt = take(ADAMW_DEFAULTS)
        hidden_lr = hp.pop("hidden_lr", None)
        reject_unknown_options(name, hp)
        return adamw(params if hidden_lr is None else hidden_lr_groups(model, named, muon_rule, hidden_lr), opt)
    if name == "sgd":
        opt = take({"lr": 0.1, "momentum": 0.9, "nesterov": False, "weight_decay": 0.0})
        reject_unknown_options(name, hp)
        return torch.optim.SGD(params, **opt)
    if name == "lion":
        opt = take({"lr": 1e-4, "betas": (0.9, 0.99), "weight_decay": 0.0})
        reject_unknown_options(name, hp)
        return Lion(params, **{**opt, "betas": tuple(opt["betas"])})
    raise CurvlabError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS + LORA_OPTIMIZERS)}")


def hidden_lr_groups(
    model: nn.Module, named: list[tuple[str, nn.Parameter]], rule: Callable[[str, Tensor], bool] | None, hidden_lr: Any
) -> list[dict[str, Any]]:
    """AdamW's two param groups for ``hidden_lr``: every parameter that is not a hidden matrix first (group 0, at the
    optimizer's lr, the one training logs), then the hidden matrices (``rule``, default
    :func:`default_muon_rule`) at ``hidden_lr``."""
    if isinstance(hidden_lr, bool) or not isinstance(hidden_lr, int | float) or not 0 < hidden_lr < math.inf:
        raise CurvlabError(f"hidden_lr must be a number > 0, got {hidden_lr!r}")
    hidden, rest = split_hidden(model, named, rule, "the hidden-matrix rule")
    if not hidden:
        raise CurvlabError("hidden_lr: the model has no hidden weight matrices to take it; leave hidden_lr out")
    return [{"params": rest}, {"params": [p for _, p in hidden], "lr": hidden_lr}]


def split_hidden(
    model: nn.Module, named: list[tuple[str, nn.Parameter]], rule: Callable[[str, Tensor], bool] | None, what: str
) -> tuple[list[tuple[str, nn.Parameter]], list[nn.Parameter]]:
    """The named parameters ``rule`` (default :func:`default_muon_rule`: by structure) takes as hidden matrices,
    and every other parameter; ``what`` names the rule when it takes a parameter that is not a matrix."""
    rule = rule or default_muon_rule(model)
    chosen = [(n, p) for n, p in named if rule(n, p)]
    bad = [n for n, p in chosen if p.dim() < 2]
    if bad:
        raise CurvlabError(f"{what} chose parameters that are not matrices: {bad[:3]}")
    ids = {id(p) for _, p in chosen}
    return chosen, [p for _, p in named if id(p) not in ids]


def reject_unknown_options(name: str, leftover: dict[str, Any]) -> None:
    if leftover:
        raise CurvlabError(f"unknown option(s) for {name}: {', '.join(sorted(leftover))}")
