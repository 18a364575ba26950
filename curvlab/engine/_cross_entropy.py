r"""Cross-entropy over class logits whose second backward is the Hessian's closed form.

For logits :math:`x_i` (one row per position) with targets :math:`y_i`, row weights
:math:`c_i` (:math:`g_L / n` for the ``n`` positions kept under ``"mean"``, :math:`g_L` under ``"sum"``,
0 for an ignored target, :math:`g_L` the loss's incoming gradient) and :math:`p_i = \mathrm{softmax}(x_i)`:

.. math::  \nabla_{x_i} = c_i\,(p_i - e_{y_i}), \qquad
           \nabla_{x_i} \langle v, \nabla_x \rangle = c_i\,\bigl(p_i \odot v_i - p_i\,\langle p_i, v_i\rangle\bigr)

(the softmax Jacobian :math:`\mathrm{diag}(p) - p p^\top` applied to :math:`v`). Autograd's own double
backward takes two ``exp`` over the logits and about ten full passes per second backward, where this
takes one product, one row sum and two in-place updates, with :math:`p` kept once per point: over a
vocabulary of thousands, most of an HVP's elementwise work (docs/benchmarks.md).

The loss and the gradient are computed by the very kernels ``F.cross_entropy`` runs, so both are bitwise
torch's; only the second backward is rewritten (a third derivative recomputes :math:`p` from the logits).
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import Tensor
from torch.autograd import Function

_REDUCTIONS = {"sum": 2, "mean": 1}  # torch's reduction enums (torch.nn._reduction)
SMALLEST = 1 << 16
"""The fewest logits (rows x classes) taken in closed form: its fixed cost (100-200 us on a CPU) pays back only
from about 2^16 entries on (``benchmarks/small_models.py``); below, torch's own double backward is faster."""


def closed_form_cross_entropy(
    input: Tensor,
    target: Tensor,
    weight: Tensor | None = None,
    size_average: bool | None = None,
    ignore_index: int = -100,
    reduce: bool | None = None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    r"""``F.cross_entropy``, with the second backward in closed form where the call is the plain case it
    covers: ``(N, C)`` logits that require grad, at least :data:`SMALLEST` of them, ``(N,)`` class
    indices, no class weights or label smoothing, a mean or a sum, plain tensors under autograd alone
    (see :func:`_beyond_autograd`). Otherwise ``F.cross_entropy`` itself. The logits are kept for the
    backward (torch keeps :math:`\log p`), so changing them in place before it is refused.
    """
    covered = (
        type(input) is Tensor
        and input.numel() >= SMALLEST  # (first: a small model's logits, the common miss, cost one test)
        and torch.is_grad_enabled()
        and type(target) is Tensor
        and input.requires_grad
        and input.dim() == 2
        and input.is_floating_point()
        and target.shape == input.shape[:1]
        and target.dtype == torch.int64
        and weight is None
        and size_average is None
        and reduce is None
        and not label_smoothing
        and reduction in _REDUCTIONS
        and not _beyond_autograd(input)
    )
    if not covered:
        return F.cross_entropy(input, target, weight, size_average, ignore_index, reduce, reduction, label_smoothing)
    return _CrossEntropy.apply(input, target, ignore_index, _REDUCTIONS[reduction])


def _beyond_autograd(logits: Tensor) -> bool:
    """Whether more than autograd would see the call, for which the closed form has no rule: a
    ``torch.func`` transform, a forward-mode tangent on the logits, ``torch.compile``'s tracing, or
    autocast (which computes the cross-entropy in float32)."""
    return (
        torch._C._are_functorch_transforms_active()
        or torch.compiler.is_compiling()
        or torch.is_autocast_enabled(logits.device.type)
        or (fwAD._current_level >= 0 and fwAD.unpack_dual(logits).tangent is not None)
    )


def _gradient(
    logits: Tensor, grad_loss: Tensor, targets: Tensor, total_weight: Tensor, ignore_index: int, reduction: int
):
    r"""Torch's own gradient of the loss with respect to the logits (the kernels of ``F.cross_entropy``'s
    backward, on :math:`\log p` recomputed as its forward computed it), and :math:`\log p`."""
    logp = torch.log_softmax(logits, -1)
    nll_grad = torch.ops.aten.nll_loss_backward(grad_loss, logp, targets, None, reduction, ignore_index, total_weight)
    return torch.ops.aten._log_softmax_backward_data(nll_grad, logp, -1, logits.dtype), logp


class _CrossEntropy(Function):
    """The loss (torch's ``log_softmax`` and ``nll_loss``); its gradient is torch's, as a
    :class:`_CrossEntropyGradient` when a second backward may follow."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, ignore_index: int, reduction: int) -> Tensor:
        logp = torch.log_softmax(logits, -1)
        loss, total_weight = torch.ops.aten.nll_loss_forward(logp, targets, None, reduction, ignore_index)
        # the logits, not log p: the gradient's node must hang on them, and log p is recomputed once
        # there (a kept log p beside them would be a third (N, C) tensor per point)
        ctx.save_for_backward(logits, targets, total_weight)
        ctx.ignore_index, ctx.reduction = ignore_index, reduction
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        logits, targets, total_weight = ctx.saved_tensors
        args = (targets, total_weight, ctx.ignore_index, ctx.reduction)
        if torch.is_grad_enabled():  # (create_graph: a second backward may follow)
            grad = _CrossEntropyGradient.apply(logits, grad_loss, *args)
        else:
            grad, _ = _gradient(logits, grad_loss, *args)
        return grad, None, None, None


class _CrossEntropyGradient(Function):
    r""":math:`\nabla_x`, torch's gradient, as a function of the logits and the loss's incoming gradient,
    whose backward is the closed form."""

    @staticmethod
    def forward(ctx, logits, grad_loss, targets, total_weight, ignore_index: int, reduction: int) -> Tensor:
        grad, logp = _gradient(logits, grad_loss, targets, total_weight, ignore_index, reduction)
        kept = (targets != ignore_index).unsqueeze(-1)
        per_term = total_weight.reciprocal() if reduction == _REDUCTIONS["mean"] else torch.ones_like(total_weight)
        # an ignore_index beyond the classes can't index a row: the ignored rows read class 0, weighed 0
        safe_targets = targets.masked_fill(~kept.squeeze(-1), 0)
        # (a copy of a constant incoming gradient, which its owner may change in place once this returns)
        grad_loss = grad_loss if grad_loss.requires_grad else grad_loss.clone()
        ctx.save_for_backward(logits, logp.exp_(), safe_targets, kept, grad_loss, per_term)
        return grad

    @staticmethod
    def backward(ctx, v: Tensor):
        logits, p, safe_targets, kept, grad_loss, per_term = ctx.saved_tensors
        differentiable = torch.is_grad_enabled()  # a third derivative is asked for
        if differentiable:  # p as a function of the logits, and nothing in place
            p = torch.softmax(logits, -1)
        pv = p * v
        pv_rows = pv.sum(-1, keepdim=True)
        d_logits = d_grad_loss = None
        if ctx.needs_input_grad[1]:  # <v, p - e_y> over the kept rows, per loss term
            d_grad_loss = ((pv_rows - v.gather(-1, safe_targets.unsqueeze(-1))) * kept).sum() * per_term
        if ctx.needs_input_grad[0]:
            # c per row; where instead of a product, as every row is ignored under a mean: 1/0 there
            row_weights = torch.where(kept, grad_loss * per_term, 0)
            if differentiable:
                d_logits = (pv - p * pv_rows) * row_weights
            else:
                d_logits = pv.addcmul_(p, pv_rows, value=-1).mul_(row_weights)
        return d_logits, d_grad_loss, None, None, None, None
