"""The optimizer factory: a name gives one torch optimizer for a model.

Full-model optimizers (Muon with its AdamW side, AdamW, SGD, Lion) come from :mod:`curvlab.optim.model_optimizer`; the
optimizers of a peft LoRA model's factors (sMuon, LoRA-Muon, per-factor Muon) from :mod:`curvlab.optim.lora`,
which builds on :mod:`curvlab.optim.model_optimizer`. This module sits above both, so that neither imports the other.
"""

from __future__ import annotations

from collections.abc import Callable
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

    Raises:
        CurvlabError: an unknown name or option, a ``muon_rule`` for an optimizer without Muon's split,
            or a model with no 2-D weights for Muon.
    """
    if name in LORA_OPTIMIZERS:
        if muon_rule is not None:
            raise CurvlabError(f"muon_rule applies to muon only, not to {name}")
        return build_lora_optimizer(name, model, **hyperparameters)
    return build_model_optimizer(name, model, muon_rule, **hyperparameters)
