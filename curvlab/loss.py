"""The loss-function convention: ``loss_fn(params, batch) -> scalar``, and batches to accumulate over.

Every curvature function takes a pure function of a parameter dict, exactly like ``torch.func``.
:func:`make_loss_fn` builds one from any ``nn.Module`` and criterion. Several batches are passed as
a ``list`` (or a :class:`Batches`, to give weights explicitly); the loss they stand for is the mean
over *all* their loss terms, so each batch is weighted by its share of those terms, never equally:

.. math::  L = \\sum_j \\frac{n_j}{\\sum_i n_i} L_j, \\qquad n_j = \\text{loss terms (tokens) in batch } j.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from curvlab.errors import CurvlabError

LossFn = Callable[[Mapping[str, Tensor], Any], Tensor]


def token_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over all positions of ``(..., vocab)`` logits; targets < 0 are ignored.

    Half-precision logits are upcast to float32 (softmax over a large vocabulary needs it).
    """
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)


class ModuleLoss:
    """``loss_fn(params, batch) = criterion(model(inputs), targets)`` for ``batch = (inputs, targets)``.

    Runs ``model`` through :func:`torch.func.functional_call` with ``params`` substituted (names
    not in ``params`` keep the module's own tensors); buffers pass through untouched, except that
    floating buffers and floating inputs are cast to the parameters' dtype, so a float32 model can
    be evaluated in float64 by passing float64 parameters.
    """

    def __init__(self, model: nn.Module, criterion: Callable[[Tensor, Tensor], Tensor]):
        self.model = model
        self.criterion = criterion

    def __call__(self, params: Mapping[str, Tensor], batch: Any) -> Tensor:
        inputs, targets = batch
        dtype = next((p.dtype for p in params.values() if p.is_floating_point()), None)
        buffers = {
            name: b.to(dtype) if dtype is not None and b.is_floating_point() and b.dtype != dtype else b
            for name, b in self.model.named_buffers()
        }
        if dtype is not None and isinstance(inputs, Tensor) and inputs.is_floating_point():
            inputs = inputs.to(dtype)
        return self.criterion(functional_call(self.model, {**buffers, **params}, (inputs,)), targets)


def make_loss_fn(model: nn.Module, criterion: Callable[[Tensor, Tensor], Tensor] | None = None) -> ModuleLoss:
    """Build ``loss_fn(params, batch)`` computing ``criterion(model(inputs), targets)``.

    ``criterion`` defaults to :func:`token_cross_entropy` (mean over all positions).
    """
    return ModuleLoss(model, token_cross_entropy if criterion is None else criterion)


def count_loss_terms(batch: Any) -> int:
    """Loss terms of a ``(inputs, targets)`` batch: integer targets >= 0 (class labels, tokens not
    ignored), else every target entry."""
    targets = batch[-1] if isinstance(batch, (tuple, list)) else batch
    if not isinstance(targets, Tensor):
        return 1
    if targets.dtype in (torch.int64, torch.int32, torch.int16, torch.uint8):
        return int((targets >= 0).sum())
    return targets.numel()


@dataclass(frozen=True)
class Batches:
    """Several batches with explicit weights (their numbers of loss terms).

    ``Batches(list_of_batches)`` counts the terms with :func:`count_loss_terms`; pass ``weights`` when
    the loss is not a mean over targets (the weights are normalized to sum to one).
    """

    batches: Sequence[Any]
    weights: Sequence[float] | None = None


def weighted_batches(batch: Any) -> list[tuple[Any, float]]:
    """Split ``batch`` into ``(batch_j, w_j)`` pairs with ``sum(w_j) == 1``.

    A ``list`` or :class:`Batches` is several batches; anything else (a tuple, a tensor) is one.
    """
    if isinstance(batch, Batches):
        batches = list(batch.batches)
        weights = list(batch.weights) if batch.weights is not None else [count_loss_terms(b) for b in batches]
    elif isinstance(batch, list):
        batches, weights = batch, [count_loss_terms(b) for b in batch]
    else:
        return [(batch, 1.0)]
    if not batches:
        raise CurvlabError("no batches given: an empty list of batches has no loss")
    if len(weights) != len(batches):
        raise CurvlabError(f"{len(batches)} batches but {len(weights)} weights")
    total = float(sum(weights))
    if not total > 0:
        raise CurvlabError(f"the batches hold no loss terms (weights sum to {total})")
    return [(b, float(w) / total) for b, w in zip(batches, weights)]
