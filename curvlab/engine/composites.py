r"""Composite forms of the fused ops torch differentiates wrongly, or not twice: the same values from
primitive ops (``mean``, ``rsqrt``, ``index_add``, ...), whose derivatives of every order and mode are exact.

The exact mode (:mod:`curvlab.engine.exact`, its ``_ROUTES``) routes each fused op here under the
methods where torch's own formulas are wrong or missing, as the op sweep (``tests/op_sweep.py``) measures
every op against central differences of torch's gradient, by each method; docs/op-sweep.md has the
table. Each composite takes torch's signature and gives torch's value for every option it accepts (the
sweep checks the values too); an option that changes only torch's gradient is not used.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor


def composite_layer_norm(
    x: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    r"""Layer normalization :math:`(x - \mu)/\sqrt{\sigma^2 + \epsilon}\,w + b`, as ``F.layer_norm``."""
    return _affine(_normalize(x, tuple(range(-len(normalized_shape), 0)), eps), weight, bias, x.dim(), 0)


def composite_batch_norm(
    x: Tensor,
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    r"""Batch normalization of ``(N, C, ...)``, never updating running statistics: with batch statistics
    (``training`` or no running statistics), :math:`\mu, \sigma^2` over every dimension but C (biased
    variance, as ``F.batch_norm`` normalizes); otherwise the running ones."""
    dims = (0, *range(2, x.dim()))
    return _statistics_norm(x, running_mean, running_var, weight, bias, training, dims, eps)


def composite_instance_norm(
    x: Tensor,
    running_mean: Tensor | None = None,
    running_var: Tensor | None = None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    use_input_stats: bool = True,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Instance normalization of ``(N, C, ...)`` over the spatial dimensions (see :func:`composite_batch_norm`)."""
    dims = tuple(range(2, x.dim()))
    return _statistics_norm(x, running_mean, running_var, weight, bias, use_input_stats, dims, eps)


def _statistics_norm(x, running_mean, running_var, weight, bias, batch_stats: bool, dims: tuple, eps: float):
    """Batch or instance norm: over ``dims`` with batch statistics (or without running ones), else by the
    running statistics."""
    if batch_stats or running_mean is None or running_var is None:
        y = _normalize(x, dims, eps)
    else:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        y = (x - running_mean.view(shape)) * torch.rsqrt(running_var.view(shape) + eps)
    return _affine(y, weight, bias, x.dim(), 1)


def _normalize(x: Tensor, dims: tuple[int, ...], eps: float) -> Tensor:
    centered = x - x.mean(dims, keepdim=True)
    return centered * torch.rsqrt(centered.pow(2).mean(dims, keepdim=True) + eps)


def _affine(y: Tensor, weight: Tensor | None, bias: Tensor | None, ndim: int, channel_dim: int) -> Tensor:
    """``y * weight + bias`` with the parameters broadcast along ``channel_dim`` (1: channels, 0: the
    trailing normalized shape, which broadcasts as is)."""
    shape = None if channel_dim == 0 else (-1,) + (1,) * (ndim - 2)
    if weight is not None:
        y = y * (weight if shape is None else weight.view(shape))
    if bias is not None:
        y = y + (bias if shape is None else bias.view(shape))
    return y


def composite_weight_norm(v: Tensor, g: Tensor, dim: int = 0) -> Tensor:
    r"""Weight normalization :math:`g\, v / \|v\|`, as ``torch._weight_norm(v, g, dim)``: the norm over every
    dimension but ``dim`` (all of them for ``dim = -1``, as torch's ``norm_except_dim``)."""
    dims = tuple(range(v.dim())) if dim == -1 else tuple(d for d in range(v.dim()) if d != dim % v.dim())
    return v * (g / torch.linalg.vector_norm(v, 2, dims, keepdim=True))  # (accumulates low precision in float32)


def composite_embedding_bag(
    input: Tensor,
    weight: Tensor,
    offsets: Tensor | None = None,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    scale_grad_by_freq: bool = False,
    mode: str = "mean",
    sparse: bool = False,
    per_sample_weights: Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int | None = None,
) -> Tensor:
    r"""``F.embedding_bag`` from a lookup and a reduction per bag (sum, mean or max), the same values. Bags
    are the rows of a 2-D ``input``, or the runs of a 1-D ``input`` that ``offsets`` start (with
    ``include_last_offset`` the last bag runs to the end, as torch's does). Entries equal to
    ``padding_idx`` are left out of their bag (and of its count, for the mean); an empty bag is zero.
    ``scale_grad_by_freq`` and ``sparse`` change torch's gradient, not the function, and are not used
    (the exact mode refuses ``max_norm`` before this is called).
    """
    bags = input.shape[0] if input.dim() == 2 else offsets.numel() - int(include_last_offset)
    flat, bag = _bags(input, offsets, bags)
    keep = torch.ones_like(flat, dtype=torch.bool) if padding_idx is None else flat != padding_idx % weight.shape[0]
    flat, bag = flat[keep], bag[keep]
    rows = weight[flat]
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.reshape(-1)[keep].unsqueeze(-1)
    out = rows.new_zeros(bags, weight.shape[1])
    if mode == "max":
        return out.scatter_reduce(0, bag.unsqueeze(-1).expand_as(rows), rows, "amax", include_self=False)
    out = out.index_add(0, bag, rows)
    if mode == "mean":
        counts = torch.bincount(bag, minlength=bags).clamp(min=1).to(out.dtype)
        out = out / counts.unsqueeze(-1)
    return out


def _bags(input: Tensor, offsets: Tensor | None, bags: int) -> tuple[Tensor, Tensor]:
    """The entries, flat, and the bag of each."""
    if input.dim() == 2:
        return input.reshape(-1), torch.arange(bags, device=input.device).repeat_interleave(input.shape[1])
    positions = torch.arange(input.numel(), device=input.device)
    bag = torch.bucketize(positions, offsets, right=True) - 1  # offsets start the bags, in order
    return input, bag.clamp(max=bags - 1)


def composite_hardsigmoid(input: Tensor, inplace: bool = False) -> Tensor:
    r""":math:`\min(\max(x/6 + 1/2, 0), 1)`, as ``F.hardsigmoid`` (never in place: the input may be a leaf)."""
    return (input / 6 + 0.5).clamp(0, 1)


def composite_glu(input: Tensor, dim: int = -1) -> Tensor:
    r""":math:`a \odot \sigma(b)` of the two halves of ``input`` along ``dim``, as ``F.glu``."""
    if input.shape[dim] % 2:
        return F.glu(input, dim)  # (torch's own error)
    a, b = input.chunk(2, dim)
    return a * torch.sigmoid(b)


def _reduction(size_average, reduce, reduction: str) -> str:
    """The reduction, from the legacy ``size_average``/``reduce`` when either is given (as torch reads them)."""
    if size_average is None and reduce is None:
        return reduction
    return torch.nn._reduction.legacy_get_string(size_average, reduce, emit_warning=False)


def _reduced(loss: Tensor, reduction: str) -> Tensor:
    return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss


def composite_mse_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None) -> Tensor:
    """``F.mse_loss``: :math:`w (x - y)^2`, reduced (a weighted mean divides by the weights' sum, as torch's;
    the legacy ``size_average``/``reduce`` read as torch reads them)."""
    loss, reduction = (input - target) ** 2, _reduction(size_average, reduce, reduction)
    if weight is not None and reduction == "mean":
        return (weight * loss).sum() / weight.sum()  # (torch's weighted mean: by the weights' sum)
    return _reduced(loss if weight is None else weight * loss, reduction)


def composite_huber_loss(input, target, reduction="mean", delta=1.0, weight=None) -> Tensor:
    r"""``F.huber_loss``: :math:`\tfrac12 d^2` where :math:`|d| < \delta`, else :math:`\delta(|d| - \delta/2)`."""
    d = input - target
    loss = torch.where(d.abs() < delta, 0.5 * d * d, delta * (d.abs() - 0.5 * delta))
    return _reduced(loss if weight is None else weight * loss, reduction)


def composite_soft_margin_loss(input, target, size_average=None, reduce=None, reduction="mean") -> Tensor:
    r"""``F.soft_margin_loss``: :math:`\log(1 + e^{-y x})`, reduced."""
    return _reduced(F.softplus(-target * input), _reduction(size_average, reduce, reduction))


def composite_multi_margin_loss(
    input, target, p=1, margin=1.0, weight=None, size_average=None, reduce=None, reduction="mean"
) -> Tensor:
    r"""``F.multi_margin_loss``: :math:`\frac1C \sum_{j \ne y} w_y \max(0, m - x_y + x_j)^p` per sample."""
    x = input if input.dim() == 2 else input.unsqueeze(0)
    y = target.reshape(-1, 1)
    hinge = (margin - x.gather(1, y) + x).clamp(min=0)
    hinge = hinge**p if p != 1 else hinge
    if weight is not None:
        hinge = hinge * weight[y]
    hinge = hinge.scatter(1, y, 0.0)  # (the target's own class is not a margin)
    return _reduced(hinge.sum(1) / x.shape[1], _reduction(size_average, reduce, reduction))


def composite_multilabel_margin_loss(input, target, size_average=None, reduce=None, reduction="mean") -> Tensor:
    r"""``F.multilabel_margin_loss``: :math:`\frac1C \sum_{j \in T} \sum_{k \notin T} \max(0, 1 - x_j + x_k)`,
    T the target classes up to the first -1."""
    x, t = (input, target) if input.dim() == 2 else (input.unsqueeze(0), target.unsqueeze(0))
    listed = (t >= 0).cumprod(1).bool()  # the classes before the first -1
    listed_count = (F.one_hot(t.clamp(min=0), x.shape[1]) * listed.unsqueeze(-1)).sum(1)  # (a repeat counts twice)
    pairs = (1 - x.unsqueeze(2) + x.unsqueeze(1)).clamp(min=0)  # [i, j, k]: 1 - x_j + x_k
    mask = listed_count.unsqueeze(2) * (listed_count == 0).unsqueeze(1)
    loss = (pairs * mask).sum((1, 2)) / x.shape[1]
    return _reduced(loss if input.dim() == 2 else loss.squeeze(0), _reduction(size_average, reduce, reduction))


def composite_cdist(x1: Tensor, x2: Tensor, p: float = 2.0, compute_mode: str | None = None) -> Tensor:
    r"""``torch.cdist``: :math:`\|x_{1,i} - x_{2,j}\|_p` for every pair of rows (the compute mode changes
    only rounding)."""
    return torch.linalg.vector_norm(x1.unsqueeze(-2) - x2.unsqueeze(-3), p, dim=-1)


def composite_pdist(input: Tensor, p: float = 2.0) -> Tensor:
    r"""``F.pdist``: :math:`\|x_i - x_j\|_p` for the rows i < j, in torch's order."""
    i, j = torch.triu_indices(input.shape[0], input.shape[0], 1, device=input.device)
    return torch.linalg.vector_norm(input[i] - input[j], p, dim=-1)


def composite_solve(A: Tensor, B: Tensor, *, left: bool = True, out=None) -> Tensor:
    """``torch.linalg.solve`` by an LU factorization (``lu_factor`` and ``lu_solve``, whose forward-over-
    forward derivatives are right, where ``linalg_solve``'s are not). ``B`` of one dimension fewer than
    ``A`` is a (batch of) vector(s), as torch reads it."""
    return _lu_solved(*torch.linalg.lu_factor(A), B, left)


def composite_solve_ex(A: Tensor, B: Tensor, *, left: bool = True, check_errors: bool = False, out=None):
    """``torch.linalg.solve_ex``: :func:`composite_solve`'s solution and the LU factorization's ``info``."""
    lu, pivots, info = torch.linalg.lu_factor_ex(A, check_errors=check_errors)
    return torch.return_types.linalg_solve_ex((_lu_solved(lu, pivots, B, left), info))


def _lu_solved(lu: Tensor, pivots: Tensor, B: Tensor, left: bool) -> Tensor:
    """X of A X = B (X A = B unless ``left``) from A's LU factors; ``B`` a (batch of) vector(s) by torch's rule."""
    vector = B.dim() == 1 or (B.dim() == lu.dim() - 1 and B.shape == lu.shape[:-1])
    x = torch.linalg.lu_solve(lu, pivots, B.unsqueeze(-1) if vector else B, left=left)
    return x.squeeze(-1) if vector else x


def composite_householder_product(A: Tensor, tau: Tensor, *, out=None) -> Tensor:
    r"""``torch.linalg.householder_product``: the first n columns of
    :math:`\prod_i (I - \tau_i v_i v_i^\top)`, :math:`v_i` column i of ``A`` below the diagonal, 1 on it."""
    m, n = A.shape[-2:]
    eye = torch.eye(m, dtype=A.dtype, device=A.device)
    q = eye.expand(*A.shape[:-2], m, m)
    below = torch.ones(m, m, dtype=torch.bool, device=A.device).tril(-1)
    for i in range(tau.shape[-1]):
        v = A[..., :, i] * below[:, i] + eye[:, i]
        q = q - tau[..., i, None, None] * (q @ v.unsqueeze(-1)) * v.conj().unsqueeze(-2)  # (I - tau v v^H)
    return q[..., :, :n]


def _lu_signs(A: Tensor) -> tuple[Tensor, Tensor]:
    """The diagonal of A's LU factor and the sign of its row permutation."""
    lu, pivots, _ = torch.linalg.lu_factor_ex(A)  # (a singular A too: its det is 0, as torch's)
    swaps = (pivots != torch.arange(1, pivots.shape[-1] + 1, device=A.device, dtype=pivots.dtype)).sum(-1)
    return lu.diagonal(dim1=-2, dim2=-1), 1 - 2 * (swaps % 2).to(A.dtype)


def composite_det(A: Tensor, *, out=None) -> Tensor:
    r"""``torch.linalg.det``: :math:`\pm \prod_i U_{ii}` from an LU factorization."""
    diagonal, sign = _lu_signs(A)
    return sign * diagonal.prod(-1)


def composite_slogdet(A: Tensor, *, out=None):
    r"""``torch.linalg.slogdet``: the sign and :math:`\sum_i \log |U_{ii}|` from an LU factorization."""
    diagonal, sign = _lu_signs(A)
    sign = sign * torch.sgn(diagonal).prod(-1)
    return torch.return_types.linalg_slogdet((sign.detach(), diagonal.abs().log().sum(-1)))


def composite_logdet(A: Tensor) -> Tensor:
    """``torch.logdet``: the log of the determinant (NaN where it is negative, as torch's)."""
    sign, logabsdet = composite_slogdet(A)
    return torch.where(sign > 0, logabsdet, torch.where(sign == 0, -torch.inf, torch.nan))


def composite_binary_cross_entropy_with_logits(
    input, target, weight=None, size_average=None, reduce=None, reduction="mean", pos_weight=None
) -> Tensor:
    r"""``F.binary_cross_entropy_with_logits``: :math:`-w\,[p\,y \log\sigma(x) + (1 - y) \log\sigma(-x)]`."""
    positive = F.logsigmoid(input) * (target if pos_weight is None else pos_weight * target)
    loss = -(positive + (1 - target) * F.logsigmoid(-input))
    return _reduced(loss if weight is None else weight * loss, _reduction(size_average, reduce, reduction))


def composite_rrelu(input, lower=1.0 / 8, upper=1.0 / 3, training=False, inplace=False) -> Tensor:
    """``F.rrelu`` in eval mode: a leaky ReLU of slope (lower + upper)/2 (in training mode it draws its
    slopes at random, and torch's own runs: the exact mode reports the draw)."""
    if training:
        return F.rrelu(input, lower, upper, training)
    return F.leaky_relu(input, (lower + upper) / 2)
