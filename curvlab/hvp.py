r"""Exact Hessian-vector products of ``loss_fn(params, batch)``.

Notation (SCIENCE.md): parameters W as a dict of tensors, gradient :math:`G = \nabla L(W)`, and the
Hessian operator :math:`H[v] = \frac{d}{d\epsilon} \nabla L(W + \epsilon v)\big|_{\epsilon=0}`.

Methods:

* ``"fwd_rev"`` (default): forward-over-reverse, ``jvp`` of ``grad``. One forward and one backward
  pass carrying dual numbers; under ``vmap`` the primal pass is shared by all K directions.
* ``"rev_rev"``: double backward through ``torch.autograd``, for ops without forward-mode AD.
* :func:`quadratic_form`: forward-over-forward, ``jvp`` of ``jvp`` along one direction, gives
  :math:`(\langle G, z\rangle, \langle z, H z\rangle)` without any backward pass.

All of them run inside :func:`~curvlab.exact_ops.exact_second_order` (math attention, no dropout,
composite LayerNorm), so they are exact on any model, and all accept several batches (a ``list``
or :class:`~curvlab.loss.Batches`), accumulated with weights proportional to their loss terms.
Computation is in float32 unless ``dtype`` (or float64 parameters) say otherwise; bf16 and fp16
parameters and directions are upcast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from scipy.sparse.linalg import LinearOperator
from torch import Tensor
from torch.func import grad_and_value, jvp, vmap
from torch.utils._pytree import tree_map

from curvlab import params as P
from curvlab.distributed import all_reduce_sum, my_share, rank_and_world
from curvlab.errors import CurvlabError
from curvlab.exact_ops import exact_second_order
from curvlab.loss import LossFn, weighted_batches

METHODS = ("fwd_rev", "rev_rev")


def working_dtype(params: Mapping[str, Tensor], dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype curvature is computed in: ``dtype`` if given, float64 if any parameter is, else float32."""
    if dtype is not None:
        if not dtype.is_floating_point:
            raise CurvlabError(f"dtype must be floating point, got {dtype}")
        return dtype
    return torch.float64 if any(p.dtype == torch.float64 for p in params.values()) else torch.float32


def _scalar_loss(loss_fn: LossFn, batch: Any):
    def f(p):
        value = loss_fn(p, batch)
        if not isinstance(value, Tensor) or value.dim() != 0:
            shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            raise CurvlabError(f"loss_fn must return a scalar tensor, got {shape}")
        return value

    return f


def _check_finite_loss(loss: Tensor) -> None:
    if not torch.isfinite(loss).all():
        raise CurvlabError(f"the loss is not finite ({float(loss)}) at these parameters and batch")


def shared_batches(batch: Any, loss_fn: Any = None) -> tuple[list[tuple[Any, float]], bool]:
    """This process's ``(batch, weight)`` pairs and whether results must be summed across ranks.

    Weights are normalized over *all* batches (every rank knows them all), so under torch.distributed
    each rank takes its share and the token-weighted sums are all-reduced: exactly the one-process
    result. With fewer batches than ranks, every rank computes everything and nothing is reduced.
    """
    pairs = weighted_batches(batch, loss_fn)
    world = rank_and_world()[1]
    if world > 1 and len(pairs) >= world:
        return my_share(pairs), True
    return pairs, False


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise CurvlabError(f"unknown HVP method {method!r}; choose one of {', '.join(METHODS)}")


def _check_stacked(params: Mapping[str, Tensor], vs: Mapping[str, Tensor]) -> int:
    first = next(iter(vs.values()), None)
    if first is None or first.dim() == 0:
        raise CurvlabError("directions must be stacked along a leading dimension K")
    k = first.shape[0]
    if k == 0:
        raise CurvlabError("no directions given (K = 0)")
    P.check_like(params, {n: t[0] if t.shape[0] == k else t for n, t in vs.items()}, "directions")
    bad = [n for n, t in vs.items() if t.shape[0] != k]
    if bad:
        raise CurvlabError(f"directions disagree on K: {bad[0]!r} stacks {vs[bad[0]].shape[0]}, others {k}")
    for n, t in vs.items():
        if not torch.isfinite(t).all():
            raise CurvlabError(f"directions[{n!r}] holds non-finite values (NaN or inf)")
    return k


def _fwd_rev(f, params, vs, chunk_size):
    """(loss, G, H[v_k] stacked) by jvp of grad, vmapped over the K directions."""

    def one(v):
        (g, loss), (hv, _) = jvp(grad_and_value(f), (params,), (v,))
        return loss, g, hv

    return _vmap_directions(one, vs, chunk_size, out_dims=(None, None, 0))


def _vmap_directions(fn, vs, chunk_size, out_dims):
    """``vmap`` of ``fn`` over directions stacked in ``vs``, ``chunk_size`` at a time.

    Outputs with out_dim ``None`` don't depend on the direction (the loss, the gradient) and are kept
    once, not K times. torch's own ``chunk_size`` can't combine with ``None``, so chunks are taken here.
    """
    k = next(iter(vs.values())).shape[0]
    step = k if chunk_size is None else max(1, chunk_size)
    batched = vmap(fn, out_dims=out_dims, randomness="same")
    pieces = [batched({n: t[i : i + step] for n, t in vs.items()}) for i in range(0, k, step)]
    return tuple(
        first if dim is None else tree_map(lambda *xs: torch.cat(xs), *(p[j] for p in pieces))
        for j, (first, dim) in enumerate(zip(pieces[0], out_dims))
    )


def _rev_rev(f, params, vs, chunk_size):
    """(loss, G, H[v_k] stacked) by double backward: one first-order graph with ``create_graph``,
    reused for every chunk of directions, each chunk one ``is_grads_batched`` backward."""
    names = list(params)
    leaves = [params[n].detach().requires_grad_() for n in names]
    k = vs[names[0]].shape[0]
    step = k if chunk_size is None else max(1, chunk_size)
    with torch.enable_grad():
        loss = f(dict(zip(names, leaves)))
        g = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True, materialize_grads=True)
        connected = [i for i, t in enumerate(g) if t.requires_grad]
        if not connected:  # the loss is at most linear in the parameters
            return loss.detach(), {n: t.detach() for n, t in zip(names, g)}, {n: torch.zeros_like(vs[n]) for n in names}
        pieces = [
            torch.autograd.grad(
                [g[i] for i in connected],
                leaves,
                grad_outputs=[vs[names[i]][s : s + step] for i in connected],
                retain_graph=True,
                is_grads_batched=True,
                allow_unused=True,
                materialize_grads=True,
            )
            for s in range(0, k, step)
        ]
    hv = {n: torch.cat([p[i] for p in pieces]) for i, n in enumerate(names)}
    return loss.detach(), {n: t.detach() for n, t in zip(names, g)}, hv


def evaluate_loss(loss_fn: LossFn, params: Mapping[str, Tensor], batch: Any, dtype: torch.dtype | None = None) -> float:
    """:math:`L(W)` accumulated over batches with loss-term weights, evaluated exactly as the
    curvature functions evaluate it (inside :func:`~curvlab.exact_ops.exact_second_order`, same dtype),
    so that differences of losses and Taylor predictions are comparable."""
    p = P.cast(params, working_dtype(params, dtype))
    total = 0.0
    pairs, reduce = shared_batches(batch, loss_fn)
    with torch.no_grad(), exact_second_order():
        for b, w in pairs:
            loss = _scalar_loss(loss_fn, b)(p)
            _check_finite_loss(loss)
            total += w * float(loss)
    return all_reduce_sum(total) if reduce else total


def gradient_and_hvps(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    vs: Mapping[str, Tensor],
    chunk_size: int | None = None,
    method: str = "fwd_rev",
    dtype: torch.dtype | None = None,
) -> tuple[float, P.Params, P.Params]:
    r"""Loss :math:`L(W)`, gradient :math:`G` and :math:`H[v_k]` for K stacked directions, in one pass.

    Args:
        vs: dict of tensors shaped ``(K, *param.shape)``.
        chunk_size: directions per vectorized call (bounds memory; ``None`` = all K at once).

    Returns:
        ``(loss, G, HV)`` with ``G`` shaped like ``params`` and ``HV`` like ``vs``, accumulated over
        batches with loss-term weights.
    """
    _check_method(method)
    _check_stacked(params, vs)
    dt = working_dtype(params, dtype)
    p = P.cast(params, dt)
    vs = P.cast(vs, dt)
    loss_total, g_total, hv_total = 0.0, P.zeros_like(p), P.zeros_like(vs)
    pairs, reduce = shared_batches(batch, loss_fn)
    with exact_second_order():
        for b, w in pairs:
            f = _scalar_loss(loss_fn, b)
            loss, g, hv = _fwd_rev(f, p, vs, chunk_size) if method == "fwd_rev" else _rev_rev(f, p, vs, chunk_size)
            _check_finite_loss(loss)
            loss_total += w * float(loss)
            g_total = P.add(g_total, g, w)
            hv_total = P.add(hv_total, hv, w)
    if reduce:
        loss_total, g_total, hv_total = all_reduce_sum(loss_total), all_reduce_sum(g_total), all_reduce_sum(hv_total)
    return loss_total, g_total, hv_total


def hvps(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    vs: Mapping[str, Tensor],
    chunk_size: int | None = None,
    method: str = "fwd_rev",
    dtype: torch.dtype | None = None,
) -> P.Params:
    r""":math:`H[v_k]` for K directions stacked along dim 0, in one vectorized call (see
    :func:`gradient_and_hvps`)."""
    return gradient_and_hvps(loss_fn, params, batch, vs, chunk_size, method, dtype)[2]


def hvp(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    v: Mapping[str, Tensor],
    method: str = "fwd_rev",
    dtype: torch.dtype | None = None,
) -> P.Params:
    r"""The exact Hessian-vector product :math:`H[v] = \nabla^2 L(W)\, v`, a dict like ``params``.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or a ``list``/:class:`~curvlab.loss.Batches` of batches to accumulate.
        v: direction, a dict with ``params``' keys and shapes.
        method: ``"fwd_rev"`` (jvp of grad) or ``"rev_rev"`` (double backward).
        dtype: computation dtype (default float32, or float64 when the parameters are).
    """
    P.check_like(params, v)
    stacked = {n: t.unsqueeze(0) for n, t in v.items()}
    return {n: t[0] for n, t in hvps(loss_fn, params, batch, stacked, method=method, dtype=dtype).items()}


def quadratic_forms(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    zs: Mapping[str, Tensor],
    chunk_size: int | None = None,
    dtype: torch.dtype | None = None,
) -> tuple[float, Tensor, Tensor]:
    r"""Loss and :math:`(\langle G, z_k\rangle, \langle z_k, H z_k\rangle)` for K stacked directions.

    Forward-over-forward: the second derivative of :math:`t \mapsto L(W + t z)` at 0 by ``jvp`` of
    ``jvp``. No backward pass and no gradient is formed. Exact through LayerNorm only because
    :func:`~curvlab.exact_ops.exact_second_order` routes it through a composite.

    Returns:
        ``(loss, gz, zhz)`` with ``gz`` and ``zhz`` float64 tensors of shape ``(K,)``.
    """
    _check_stacked(params, zs)
    dt = working_dtype(params, dtype)
    p = P.cast(params, dt)
    zs = P.cast(zs, dt)
    k = next(iter(zs.values())).shape[0]
    loss_total, gz_total, zhz_total = 0.0, torch.zeros(k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64)
    pairs, reduce = shared_batches(batch, loss_fn)
    with exact_second_order():
        for b, w in pairs:
            f = _scalar_loss(loss_fn, b)

            def one(z, f=f):
                def directional(q):
                    value, slope = jvp(f, (q,), (z,))
                    return slope, value

                slope, curvature, value = jvp(directional, (p,), (z,), has_aux=True)
                return value, slope, curvature

            loss, gz, zhz = _vmap_directions(one, zs, chunk_size, out_dims=(None, 0, 0))
            _check_finite_loss(loss)
            loss_total += w * float(loss)
            gz_total = gz_total + w * gz.double()
            zhz_total = zhz_total + w * zhz.double()
    if reduce:
        loss_total, gz_total, zhz_total = (
            all_reduce_sum(loss_total),
            all_reduce_sum(gz_total),
            all_reduce_sum(zhz_total),
        )
    return loss_total, gz_total, zhz_total


def quadratic_form(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    z: Mapping[str, Tensor],
    dtype: torch.dtype | None = None,
) -> tuple[float, float]:
    r"""The pair :math:`(\langle G, z\rangle, \langle z, H[z]\rangle)` by forward-over-forward AD.

    Costs about one forward pass with second-order dual numbers: no gradient is formed (see
    :func:`quadratic_forms`).
    """
    P.check_like(params, z)
    _, gz, zhz = quadratic_forms(loss_fn, params, batch, {n: t.unsqueeze(0) for n, t in z.items()}, dtype=dtype)
    return float(gz[0]), float(zhz[0])


def flat_hvp(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    names: Sequence[str],
    dtype: torch.dtype,
    chunk_size: int | None = None,
    method: str = "fwd_rev",
):
    """``matmat(X) -> H_SS X`` for the principal block over ``names`` of the Hessian, on flat column
    vectors (``X`` is ``(n_S, K)``, laid out in the order of ``names``): the columns are padded with
    zeros to full directions and go through one :func:`hvps` call. ``params`` must be in ``dtype``."""
    unknown = [n for n in names if n not in params]
    if unknown or not names:
        raise CurvlabError(
            f"the block names no parameter: {unknown[:3]}" if unknown else "the block names no parameter"
        )
    sizes = [params[n].numel() for n in names]

    def matmat(X: Tensor) -> Tensor:
        k = X.shape[1]
        vs = {n: torch.zeros((k, *t.shape), dtype=dtype) for n, t in params.items()}
        for n, piece in zip(names, X.T.to(dtype).split(sizes, dim=1)):
            vs[n] = piece.reshape(k, *params[n].shape)
        hv = hvps(loss_fn, params, batch, vs, chunk_size, method, dtype)
        return torch.cat([hv[n].reshape(k, -1) for n in names], dim=1).T

    return matmat, sum(sizes)


class HessianOperator(LinearOperator):
    r"""The Hessian :math:`\nabla^2 L(W)` over the flattened parameters, as a scipy ``LinearOperator``.

    Binds ``loss_fn``, ``params`` and ``batch``; each ``matvec`` is one exact HVP, each ``matmat``
    one vectorized call over its columns (:func:`flat_hvp`). ``subset`` restricts it to the principal
    block of those parameter names (the flattened order is ``subset``'s, else ``params'``).
    ``num_hvps`` counts the Hessian-vector products taken, for diagnostics.
    """

    def __init__(
        self,
        loss_fn: LossFn,
        params: Mapping[str, Tensor],
        batch: Any,
        dtype: torch.dtype | None = None,
        subset: Sequence[str] | None = None,
        method: str = "fwd_rev",
        chunk_size: int | None = None,
    ):
        _check_method(method)
        self.torch_dtype = working_dtype(params, dtype)
        p = P.cast(params, self.torch_dtype)
        self.names = list(p) if subset is None else list(subset)
        self._matmat_torch, n = flat_hvp(loss_fn, p, batch, self.names, self.torch_dtype, chunk_size, method)
        self.num_hvps = 0
        super().__init__(dtype=np.dtype("float64" if self.torch_dtype == torch.float64 else "float32"), shape=(n, n))

    def _matmat(self, X: np.ndarray) -> np.ndarray:
        X = torch.as_tensor(np.asarray(X), dtype=self.torch_dtype)
        self.num_hvps += X.shape[1]
        return self._matmat_torch(X).numpy().astype(self.dtype, copy=False)

    def _matvec(self, x: np.ndarray) -> np.ndarray:
        return self._matmat(np.asarray(x).reshape(-1, 1)).reshape(-1)

    def _adjoint(self) -> HessianOperator:
        return self  # symmetric


def hessian_operator(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    dtype: torch.dtype | None = None,
    subset: Sequence[str] | None = None,
) -> HessianOperator:
    """The Hessian as a :class:`HessianOperator` (a scipy ``LinearOperator``), e.g. for ``eigsh``."""
    return HessianOperator(loss_fn, params, batch, dtype=dtype, subset=subset)
