"""The optimizer factory: a name gives one torch optimizer for a model.

Full-model optimizers (Muon with its AdamW side, AdamW, SGD, Lion) come from :mod:`curvlab.optim.model_optimizer`; the
optimizers of a peft LoRA model's factors (sMuon, LoRA-Muon, per-factor Muon) from :mod:`curvlab.optim.lora`,
which builds on :mod:`curvlab.optim.model_optimizer`. This module sits above both, so that neither imports the other.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from curvlab.errors import CurvlabError
from curvlab.optim.lora import build_lora_optimizer
from curvlab.optim.model_optimizer import LORA_OPTIMIZERS, build_model_optimizer


def build_optimizer(
    name: str,
    model: nn.Module,
    *,
    muon_rule: Callable[[str, Tensor], bool] | None = None,
    **hyperparameters: Any,
) -> torch.optim.Optimizer:
    """One torch optimizer for ``model`` by name.

    ``"muon"``, ``"adamw"``, ``"sgd"`` and ``"lion"`` train every trainable parameter
    (:func:`curvlab.optim.model_optimizer.build_model_optimizer`: defaults, options and ``muon_rule`` there);
    ``"smuon"``, ``"lora-muon"`` and ``"per-factor-muon"`` train the factors of a peft LoRA model
    (:func:`curvlab.optim.lora.build_lora_optimizer`), and ``"adamw"`` on such a model is their baseline.

    Args:
        name: the optimizer, one of the names above.
        model: the module whose trainable parameters (or LoRA factors) it trains.
        muon_rule: ``muon_rule(name, param) -> bool``, the parameters Muon takes (default ``None``: the
            hidden matrices, by the model's structure); only for an optimizer with Muon's split (and AdamW's
            ``hidden_lr`` group).
        **hyperparameters (Any): the optimizer's options (``lr=...``, ``weight_decay=...``, ...); any not
            given keep the defaults of the function that builds it (see above).

    Returns:
        The torch optimizer, over ``model``'s own parameter objects.

    Raises:
        CurvlabError: an unknown name or option, a ``muon_rule`` for an optimizer without Muon's split,
            or a model with no 2-D weights for Muon.
    """
    if name in LORA_OPTIMIZERS:
        if muon_rule is not None:
            raise CurvlabError(f"muon_rule applies to muon only, not to {name}")
        return build_lora_optimizer(name, model, **hyperparameters)
    return build_model_optimizer(name, model, muon_rule, **hyperparameters)


def is_finite_number(value: Any) -> bool:
    """Whether ``value`` is an int or a float (no bool) that is a finite float: an int beyond the floats' range
    is not (math.isfinite raises OverflowError on one, and an optimizer would)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _fraction(value: Any) -> bool:
    return is_finite_number(value) and 0 <= value < 1


def _betas(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and len(value) == 2 and all(map(_fraction, value))


def _dtype_name(value: Any) -> bool:
    dtype = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else value
    return isinstance(dtype, torch.dtype) and dtype.is_floating_point


# What each option's value must be, whichever optimizer reads it (an option an optimizer doesn't take, the
# builders name): a JSON value from `--opt KEY=VALUE` or a config file, checked before anything is built
OPTION_RULES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "lr": ("a finite number > 0", lambda v: is_finite_number(v) and v > 0),
    "hidden_lr": ("a finite number > 0", lambda v: is_finite_number(v) and v > 0),  # AdamW's hidden matrices
    "eps": ("a finite number > 0", lambda v: is_finite_number(v) and v > 0),
    "momentum": ("a number in [0, 1)", _fraction),
    "weight_decay": ("a finite number >= 0", lambda v: is_finite_number(v) and v >= 0),
    "betas": ("a pair of numbers in [0, 1), e.g. [0.9,0.95]", _betas),
    "nesterov": ("true or false", lambda v: isinstance(v, bool)),
    "ns_steps": ("an integer in [1, 2**31 - 1]", lambda v: type(v) is int and 1 <= v <= 2**31 - 1),
    "scale": ("a name", lambda v: isinstance(v, str)),
    "polar": ("a name", lambda v: isinstance(v, str)),
    "polar_dtype": ("a torch floating dtype, e.g. float32", _dtype_name),
}
OPTION_RULES |= {f"adam_{k}": OPTION_RULES[k] for k in ("lr", "betas", "eps", "weight_decay")}


def check_optimizer_options(options: Mapping[str, Any], where: str = "optimizer option") -> None:
    """Each option of :data:`OPTION_RULES` in ``options`` has its type and lies in its range.

    Args:
        options: option name -> value, as ``build_optimizer`` takes them.
        where: how the error names them (``"optimizer_options (--opt)"`` for a training config).

    Raises:
        CurvlabError: the first bad value, with its option named.
    """
    for key, value in options.items():
        what, good = OPTION_RULES.get(key, ("", lambda v: True))
        if not good(value):
            raise CurvlabError(f"{where}: {key} must be {what}, got {value!r}")
