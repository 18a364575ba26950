"""A mode under which any PyTorch model can be differentiated twice, exactly.

Three things break second derivatives of ordinary models on torch 2.13 (see SCIENCE.md and
``shared/repro/layernorm_hessian.py``):

* flash and memory-efficient attention have neither forward-mode AD nor double backward, so
  ``scaled_dot_product_attention`` must run on the math backend;
* dropout makes the loss random, so the "Hessian" would change between two HVPs;
* ``nn.LayerNorm``'s fused kernel has wrong second-order forward-mode formulas: ``jvp`` of ``jvp``
  through any LayerNorm, and ``jacrev`` of ``jacrev`` (``torch.func.hessian``) through an affine one,
  give wrong numbers. Forward-over-reverse and double backward are right.

It also routes the plain cross-entropy through ``logsumexp`` (:func:`composite_cross_entropy`): not a
correctness fix but a speed one, since second derivatives of the fused ``log_softmax`` cost twice as
much on a large vocabulary.

:func:`exact_second_order` fixes all three for the code run inside it, whatever model that code
calls: a :class:`~torch.overrides.TorchFunctionMode` routes ``F.layer_norm`` through a composite of
``mean`` and ``rsqrt`` (whose derivatives of every order are exact), makes every functional dropout
the identity, and zeroes attention dropout, while ``sdpa_kernel(SDPBackend.MATH)`` pins attention to
the math backend. Every curvature function of curvlab enters it itself, so a user can't forget.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}


def composite_layer_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    r"""Layer normalization :math:`(x - \mu)/\sqrt{\sigma^2 + \epsilon}\,w + b` from primitive ops.

    Same value as ``F.layer_norm`` (to rounding), with derivatives of every order and mode exact.
    """
    dims = tuple(range(-len(normalized_shape), 0))
    mean = x.mean(dims, keepdim=True)
    centered = x - mean
    var = centered.pow(2).mean(dims, keepdim=True)
    y = centered * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y


def composite_cross_entropy(
    logits: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    r"""Cross-entropy :math:`\operatorname{logsumexp}(x) - x_y` for ``(N, C)`` logits and class targets.

    Same value as ``F.cross_entropy``; its second derivatives (forward-over-reverse or double
    backward) cost about half as much, because the derivative formulas of ``logsumexp`` and
    ``gather`` touch the ``N x C`` logits fewer times than those of ``_log_softmax_backward_data``.
    """
    keep = target != ignore_index
    safe = torch.where(keep, target, torch.zeros_like(target))
    terms = torch.logsumexp(logits, dim=-1) - logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    terms = torch.where(keep, terms, torch.zeros_like(terms))
    if reduction == "sum":
        return terms.sum()
    if reduction == "none":
        return terms
    return terms.sum() / keep.sum()


def _is_plain_cross_entropy(args, kwargs) -> bool:
    """Class-index targets on (N, C) logits, no class weights, no label smoothing: what the composite covers."""
    bound = dict(zip(("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction"), args))
    bound.update(kwargs)
    logits, target = bound.get("input"), bound.get("target")
    return (
        isinstance(logits, Tensor)
        and isinstance(target, Tensor)
        and logits.dim() == 2
        and target.dim() == 1
        and not target.is_floating_point()
        and bound.get("weight") is None
        and bound.get("size_average") is None
        and bound.get("reduce") is None
        and not bound.get("label_smoothing", 0.0)
        and bound.get("reduction", "mean") in ("mean", "sum", "none")
    )


class _ExactSecondOrderMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.layer_norm:
            return composite_layer_norm(*args, **kwargs)
        if func is F.cross_entropy and _is_plain_cross_entropy(args, kwargs):
            bound = dict(zip(("input", "target", "weight", "size_average", "ignore_index"), args))
            bound.update(kwargs)
            return composite_cross_entropy(
                bound["input"], bound["target"], bound.get("ignore_index", -100), bound.get("reduction", "mean")
            )
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:
            kwargs = {**kwargs, "dropout_p": 0.0}
            if len(args) > 4:  # dropout_p passed positionally
                args = (*args[:4], 0.0, *args[5:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def exact_second_order() -> Iterator[None]:
    """Context in which second derivatives of any model are exact and deterministic.

    Inside it: attention runs on the math backend with dropout 0, all functional dropouts are the
    identity, ``F.layer_norm`` is replaced by :func:`composite_layer_norm` and the plain
    ``F.cross_entropy`` by :func:`composite_cross_entropy`. Re-entrant.
    """
    with sdpa_kernel(SDPBackend.MATH), _ExactSecondOrderMode():
        yield
