r"""Exact Hessian-vector products of ``loss_fn(params, batch)``, from one object per point.

Notation (docs/science.md): parameters W as a dict of tensors, gradient :math:`G = \nabla L(W)`, and the
Hessian operator :math:`H[v] = \frac{d}{d\epsilon} \nabla L(W + \epsilon v)\big|_{\epsilon=0}`.

:class:`CurvaturePoint` is the engine: built for a loss, parameters and batches (weighted by
their loss terms, shared across ranks under torch.distributed), it runs the forward pass and the first
backward once, then answers any number of HVPs, quadratic forms and gradients there. Methods:

* ``"rev_rev"`` (default): double backward on the kept first-order graph. Each further direction
  costs one backward pass through that graph (about 2 gradients), restricted to the gradient entries
  the direction touches, so a direction that lives in the top layers skips the bottom of the graph.
* ``"fwd_rev"``: forward-over-reverse, ``jvp`` of ``grad``, for ops without double backward: nothing is
  kept, and every call runs one forward and one backward pass carrying dual numbers.

:meth:`CurvaturePoint.forward_quadratic_forms` is a third way for :math:`(\langle G, z\rangle, \langle z, H
z\rangle)` alone: forward-over-forward, ``jvp`` of ``jvp``, with no backward pass at all.

Every computation runs inside :func:`~curvlab.engine.exact.exact_second_order` with the reroutings its
method needs, so it is exact on any model, and with torch's compiler stance ``"force_eager"``, so that a
``torch.compile``'d model (whose compiled graphs have no double backward) works with every method.
Computation is in float32 unless ``dtype`` (or float64 parameters) say otherwise; bf16 and fp16 are
upcast. :func:`hvp`, :func:`hvps` and :func:`gradient_and_hvps` are one-point shortcuts over
:class:`CurvaturePoint`: ``(loss_fn, params, batch, <directions>)`` positionally, options by keyword.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.func import grad_and_value, jvp, vmap

from curvlab.engine import checks, gathered
from curvlab.engine import params as param_dicts
from curvlab.engine.backward import accumulate, bound_loss, double_backward, eager_stance, fresh_rows, vmap_directions
from curvlab.engine.exact import exact_second_order, running_statistics
from curvlab.engine.loss import LossFn, weighted_batches
from curvlab.errors import CurvlabError
from curvlab.util.distributed import all_reduce_sum, my_share, rank_and_world

METHODS = ("rev_rev", "fwd_rev")
"""The HVP methods (``method=``): ``"rev_rev"``, double backward on the kept first-order graph, and
``"fwd_rev"``, forward-over-reverse (``jvp`` of ``grad``); equal to rounding."""
DEFAULT_METHOD = "rev_rev"


def working_dtype(params: Mapping[str, Tensor], *, dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype curvature is computed in: ``dtype`` if given, float64 if any parameter is, else float32."""
    if dtype is not None:
        if not dtype.is_floating_point:
            raise CurvlabError(f"dtype must be floating point, got {dtype}")
        return dtype
    return torch.float64 if any(p.dtype == torch.float64 for p in params.values()) else torch.float32


def shared_batches(batch: Any, loss_fn: Any = None, *, even: bool = False) -> tuple[list[tuple[Any, float]], bool]:
    """This process's ``(batch, weight)`` pairs (weights normalized over *all* batches) and whether results
    must be summed across ranks (not with fewer batches than ranks: every rank computes everything).
    ``even``: a short share is filled up with one of its batches at weight 0, as sharded parameters need
    (each forward all-gathers them, so every rank must run as many forwards and backwards)."""
    pairs = weighted_batches(batch, loss_fn)
    world = rank_and_world()[1]
    if world > 1 and len(pairs) >= world:
        share = my_share(pairs)
        if even:
            share += [(pairs[0][0], 0.0)] * (-(-len(pairs) // world) - len(share))
        return share, True
    return pairs, False


def check_method(method: str) -> None:
    """Raise :class:`CurvlabError` unless ``method`` is an HVP method."""
    if method not in METHODS:
        raise CurvlabError(f"unknown HVP method {method!r}; choose one of {', '.join(METHODS)}")


@dataclass
class _Graph:
    """One batch's kept first-order graph: leaves, the gradient (with its graph) and the batch weight."""

    weight: float
    leaves: list[Tensor]
    grads: list[Tensor]


class CurvaturePoint:
    r"""Loss :math:`L(W)`, gradient :math:`G` and Hessian :math:`H` of ``loss_fn`` at one point, on a batch.

    The forward pass and the first backward run once, at construction (``"rev_rev"``) or at the first
    request (``"fwd_rev"``); then :meth:`hvps`, :meth:`hvp`, :meth:`quadratic_forms`,
    :meth:`forward_quadratic_forms` and :meth:`loss_at` can be called any number of times. A direction
    may name only some parameters: the others are zero, and no work is spent on them.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified; copied in the working dtype).
        batch: one batch, or a ``list``/:class:`~curvlab.engine.loss.Batches` of batches, accumulated with
            weights proportional to their loss terms (and shared out across ranks).
        method: ``"rev_rev"`` (double backward on the kept graph) or ``"fwd_rev"`` (jvp of grad).
        dtype: computation dtype (default float32, or float64 when the parameters are).
        chunk_size: directions per vectorized call (bounds memory; ``None`` = all at once).

    Memory: ``"rev_rev"`` keeps one first-order graph per batch of this process until :meth:`close` or the
    end of a ``with`` block. Sharded parameters (DTensors): the gradient, directions and HVPs stay sharded
    like the parameters, ``"fwd_rev"`` is refused (:mod:`curvlab.engine.gathered`).
    """

    def __init__(
        self,
        loss_fn: LossFn,
        params: Mapping[str, Tensor],
        batch: Any,
        *,
        method: str = DEFAULT_METHOD,
        dtype: torch.dtype | None = None,
        chunk_size: int | None = None,
    ):
        check_method(method)
        gathered.check_process_group(params)
        self.loss_fn, self.method, self.chunk_size = loss_fn, method, chunk_size
        self.dtype = working_dtype(params, dtype=dtype)
        self.params = param_dicts.cast(params, self.dtype)
        if not self.params:
            raise CurvlabError("no parameters given")
        self.sharded = gathered.is_sharded(self.params)
        self._pairs, self._reduce = shared_batches(batch, loss_fn, even=self.sharded)
        self.loss_fn = gathered.gathering_loss(loss_fn, self.params, partial=self._reduce)
        self._graphs: list[_Graph] | None = None
        self._loss: float | None = None
        self._gradient: param_dicts.Params | None = None
        self._shared = False  # (whether the gradient's tensors are a kept graph's own: see gradient)
        if method == "rev_rev":
            self._graphs = self._first_order(create_graph=True)

    # -- the batch loop ----------------------------------------------------------------------

    def _each_batch(self, method: str) -> Iterator[tuple[Any, float]]:
        """This process's ``(p -> loss, weight)`` pairs, inside the exact mode for ``method``, with the
        running statistics of the loss's model (if it has one) left untouched: the one batch loop."""
        keep = running_statistics(getattr(self.loss_fn, "model", None))
        with exact_second_order(method=method, watch_dtype=self.dtype, keep=keep), eager_stance():
            for b, w in self._pairs:
                yield bound_loss(self.loss_fn, b), w

    def _sum(self, value):
        """A token-weighted sum over this process's batches, summed across ranks when they share them."""
        if self._reduce and self.sharded and isinstance(value, dict):
            return gathered.sum_replicated(value)
        return all_reduce_sum(value) if self._reduce else value

    # -- first order -------------------------------------------------------------------------

    @gathered.names_rank_on_collective_failure
    def _first_order(self, create_graph: bool) -> list[_Graph]:
        """Forward and backward for every batch of this process; loss and gradient accumulated.

        Every op inside the exact mode is a call into Python, so curvlab's own stay out of it: the first
        batch's leaves are made before it, and the backwards whose graphs are kept run after it (the forward
        has chosen attention's kernel, run without checkpointing and eagerly). Without a graph each batch's
        backward runs as it comes, to free it. One kept graph at weight 1 in one process gives its gradient
        as it is, copied only if it is read while the graph is kept (:attr:`gradient`)."""
        names = list(self.params)
        forwards, graphs, loss_total, g_total = [], [], 0.0, None
        first = [self.params[n].detach().requires_grad_() for n in names]
        with torch.enable_grad():
            for i, (f, w) in enumerate(self._each_batch(self.method)):
                leaves = first if i == 0 else [self.params[n].detach().requires_grad_() for n in names]
                loss = f(dict(zip(names, leaves)))
                loss_total += w * checks.finite_loss(loss)
                if not loss.requires_grad:
                    raise checks.detached_error()
                if create_graph:
                    forwards.append((loss, leaves, w))
                else:
                    w_out, grads = self._backward(loss, leaves, w, create_graph=False)
                    g_total = accumulate(g_total, [t.detach() for t in grads], w_out)
            for loss, leaves, w in forwards:
                w_out, grads = self._backward(loss, leaves, w, create_graph=True)
                graphs.append(_Graph(w_out, leaves, grads))
        self._shared = len(graphs) == 1 and graphs[0].weight == 1.0 and not self._reduce
        for graph in graphs:
            g_total = accumulate(g_total, [t.detach() for t in graph.grads], graph.weight, owned=self._shared)
        self._loss, self._gradient = self._sum(loss_total), self._sum(dict(zip(names, g_total)))
        return graphs

    def _backward(self, loss: Tensor, leaves: list[Tensor], w: float, create_graph: bool) -> tuple[float, list]:
        """One batch's first backward: the weight its gradient is summed with, and the gradient. Sharded, the
        backward sums the gradient over ranks, so each rank's weight goes in first."""
        w_in, w_out = (w, 1.0) if self.sharded else (1.0, w)
        grads = torch.autograd.grad(
            loss * w_in if w_in != 1.0 else loss,
            leaves,
            create_graph=create_graph,
            allow_unused=True,
            materialize_grads=True,
        )
        return w_out, list(grads)

    @property
    def loss(self) -> float:
        """:math:`L(W)`, accumulated over the batches."""
        if self._loss is None:
            self._first_order(create_graph=False)
        return self._loss

    @property
    def gradient(self) -> param_dicts.Params:
        r""":math:`G = \nabla L(W)`, a dict like ``params`` (in the working dtype)."""
        if self._gradient is None:
            self._first_order(create_graph=False)
        elif self._shared and self._graphs is not None:  # (a copy, so that no one changes the kept graph's tensors)
            self._gradient, self._shared = {n: t.clone() for n, t in self._gradient.items()}, False
        return self._gradient

    @gathered.names_rank_on_collective_failure
    def loss_at(self, params: Mapping[str, Tensor]) -> float:
        """:math:`L` at other parameters (e.g. :math:`W - Z`) on the same batches, in the same dtype and
        mode, so that differences of losses and Taylor predictions are comparable."""
        p = param_dicts.cast(params, self.dtype)
        total = 0.0
        with torch.no_grad():
            for f, w in self._each_batch(self.method):
                total += w * checks.finite_loss(f(p))
        return self._sum(total)

    @gathered.names_rank_on_collective_failure
    def batch_sum(self, measure: Callable[[Any], Tensor | float], *, method: str | None = None) -> float:
        r""":math:`\sum_j w_j\, m(D_j)` over the point's batches with their loss-term weights (summed across ranks
        where they share them), each ``measure(batch)`` run inside the exact mode of ``method`` (default the
        point's own): a measure of the point beyond the loss and its derivatives (the Gauss–Newton part).

        Args:
            measure: ``measure(batch) -> scalar`` for one batch.
            method: the exact mode's method (``"fwd_rev"`` for one forward-mode product).
        """
        keep = running_statistics(getattr(self.loss_fn, "model", None))
        total = 0.0
        with exact_second_order(method=method or self.method, watch_dtype=self.dtype, keep=keep), eager_stance():
            for b, w in self._pairs:
                total += w * float(measure(b))
        return self._sum(total)

    # -- second order ------------------------------------------------------------------------

    @gathered.names_rank_on_collective_failure
    def hvps(self, vs: Mapping[str, Tensor]) -> param_dicts.Params:
        r""":math:`H[v_k]` for K directions stacked along dim 0, a dict over *all* parameters.

        Args:
            vs: ``{name: tensor (K, *param.shape)}`` for the parameters the directions touch; the
                names left out are zero in every direction, and cost nothing.

        Memory: by double backward, the K results and one second backward's transient memory at a time,
        whatever K (several batches add a second stack of K for their sum); ``chunk_size`` caps how many
        directions ``"fwd_rev"`` vectorizes at once, and with it that method's memory.
        """
        names, k = checks.check_directions(self.params, vs)
        if self.sharded and self.method == "fwd_rev":
            raise CurvlabError(gathered.FWD_REV_REFUSED)
        vs = param_dicts.cast({n: vs[n] for n in names}, self.dtype)
        step = k if self.chunk_size is None else max(1, self.chunk_size)
        chunk = self._hvps_rev_rev if self.method == "rev_rev" else self._hvps_fwd_rev
        if step >= k:  # (one chunk: the directions whole, not sliced)
            hv = chunk(vs)
        else:
            pieces = [chunk({n: t[i : i + step] for n, t in vs.items()}) for i in range(0, k, step)]
            hv = {n: torch.cat([p[n] for p in pieces]) for n in self.params}
        hv = self._sum(hv)
        checks.check_finite_hvp(hv)
        return hv

    def hvp(self, v: Mapping[str, Tensor]) -> param_dicts.Params:
        r"""The exact :math:`H[v]`, a dict like ``params`` (``v`` may name only some parameters)."""
        return self._hvp(v, checked=False)

    def _hvp(self, v: Mapping[str, Tensor], checked: bool) -> param_dicts.Params:
        """:meth:`hvp`, of a direction ``checked`` already or not. By double backward in one process the
        direction as it is, not stacked as one of K (four views a parameter, which show on a small model)."""
        if self.sharded or self.method != "rev_rev":
            return {n: t[0] for n, t in self.hvps({n: t.unsqueeze(0) for n, t in v.items()}).items()}
        names = list(v) if checked else checks.check_directions(self.params, v, stacked=False, finite=False)[0]
        hv = self._sum(self._rev_rev(param_dicts.cast({n: v[n] for n in names}, self.dtype), None, stacked=False))
        checks.check_finite_hvp(hv, v)  # (the direction's finiteness too: one synchronization for both)
        return hv

    def hvp_each(self, directions: Sequence[Mapping[str, Tensor]]) -> list[param_dicts.Params]:
        r""":math:`H[v]` for each direction of a list, each of which may name only some parameters: by double
        backward each on its own support, by forward-over-reverse stacked over the union of the supports."""
        if self.method == "rev_rev":
            return [self.hvp(v) for v in directions]
        union = list(dict.fromkeys(n for v in directions for n in v))
        stacked = {
            n: torch.stack([v[n] if n in v else torch.zeros_like(self.params[n]) for v in directions]) for n in union
        }
        hv = self.hvps(stacked)
        return [{n: t[i] for n, t in hv.items()} for i in range(len(directions))]

    @gathered.names_rank_on_collective_failure
    def interactions(self, directions: Sequence[Mapping[str, Tensor]]) -> Tensor:
        r"""The matrix :math:`R_{lm} = \langle Z_l, H[Z_m]\rangle` of directions :math:`Z_1, \dots, Z_L` on
        disjoint supports (a step cut into blocks), a float64 ``(L, L)`` tensor, symmetric (to rounding by
        forward-over-reverse). Its sum is :math:`\langle Z, H[Z]\rangle` of :math:`Z = \sum_l Z_l`.

        Double backward differentiates :math:`\langle G, Z_m\rangle` only with respect to the parameters of
        block m and the blocks after it, and takes :math:`R_{lm}` for l before m from :math:`R_{ml}` (H is
        symmetric), so autograd skips the earlier blocks' weight adjoints and, below block m, every node: in
        the network's order (the bottom first, as :func:`~curvlab.curvature.groupings.group_parameters`
        gives them) about 4 matrix products a layer above block m, where a whole HVP costs 6
        (docs/benchmarks.md). Forward-over-reverse takes every :math:`H[Z_m]` whole, in one vectorized call.

        Args:
            directions: the L parts :math:`Z_l`, dicts over disjoint sets of parameter names (each
                tensor shaped like its parameter), in the order their second backwards are taken.
        """
        supports = [list(d) for d in directions]
        claimed = [n for names in supports for n in names]
        if not supports or len(set(claimed)) != len(claimed):
            raise CurvlabError("interactions take one or more directions on disjoint sets of parameters")
        # by double backward finiteness comes from the dots below (each entry of every part is in the first
        # row's); forward-over-reverse's hvps check the cast parts
        for d in directions:
            checks.check_directions(self.params, {n: t.unsqueeze(0) for n, t in d.items()}, finite=False)
        parts = [param_dicts.cast(d, self.dtype) for d in directions]
        n_blocks = len(parts)
        R = torch.zeros(n_blocks, n_blocks, dtype=torch.float64, device="cpu")  # (scalars, on the host)
        whole = {n: t for b in parts for n, t in b.items()}
        if self.method == "fwd_rev":
            for m, hz in enumerate(self.hvp_each(parts)):
                R[:, m] = param_dicts.group_sums(param_dicts.dot_table([(whole, hz)], claimed)[:, 0], claimed, supports)
            return R
        for m, b in enumerate(parts):
            later = [n for names in supports[m:] for n in names]
            stacked = self._hvps_rev_rev({n: t.unsqueeze(0) for n, t in b.items()}, wrt=later)
            rows = self._sum({n: t[0] for n, t in stacked.items()})
            column = param_dicts.dot_table([(whole, rows)], later)[:, 0]
            if not torch.isfinite(column).all():  # (a non-finite entry makes its dot non-finite: name it)
                for d in directions:
                    checks.check_directions(self.params, {n: t.unsqueeze(0) for n, t in d.items()})
                checks.check_finite_hvp(rows)
                raise CurvlabError("the interactions <Z_l, H[Z_m]> overflow float64: the directions are too large")
            R[m:, m] = R[m, m:] = param_dicts.group_sums(column, later, supports[m:])
        return R

    def quadratic_forms(self, zs: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        r""":math:`(\langle G, z_k\rangle, \langle z_k, H z_k\rangle)` for K stacked directions, by HVPs at this
        point (this point's method); each a float64 tensor of shape ``(K,)``."""
        hz = self.hvps(zs)
        return param_dicts.stacked_dot(self.gradient, zs, zs), param_dicts.stacked_dot(zs, hz, zs)

    @gathered.names_rank_on_collective_failure
    def forward_quadratic_forms(self, zs: Mapping[str, Tensor]) -> tuple[Tensor, Tensor]:
        r"""The same pair as :meth:`quadratic_forms`, :math:`(\langle G, z_k\rangle, \langle z_k, H z_k\rangle)`,
        by forward-over-forward AD whatever this point's method: the first and second derivatives of
        :math:`t \mapsto L(W + t z_k)` at 0, ``jvp`` of ``jvp``, vmapped over the K directions, with no
        backward pass. On sharded parameters (forward mode doesn't run through the collectives) it comes
        by HVPs (:meth:`quadratic_forms`, which needs a ``"rev_rev"`` point).

        Returns:
            ``(gz, zhz)``, float64 tensors of shape ``(K,)``.
        """
        if self.sharded:
            return self.quadratic_forms(zs)
        _, k = checks.check_directions(self.params, zs)
        p, zs = self.params, param_dicts.cast(zs, self.dtype)
        gz_total, zhz_total = torch.zeros(k, dtype=torch.float64), torch.zeros(k, dtype=torch.float64)
        for f, w in self._each_batch("fwd_fwd"):

            def one(z, f=f):
                def directional(q):
                    value, slope = jvp(f, (q,), (z,))
                    return slope, value

                slope, curvature, value = jvp(directional, (p,), (z,), has_aux=True)
                return value, slope, curvature

            loss, gz, zhz = vmap_directions(one, zs, self.chunk_size, out_dims=(None, 0, 0))
            checks.finite_loss(loss)
            gz_total += w * gz.double().cpu()
            zhz_total += w * zhz.double().cpu()
        return self._sum(gz_total), self._sum(zhz_total)

    def _hvps_rev_rev(self, vs: Mapping[str, Tensor], wrt: Sequence[str] | None = None) -> param_dicts.Params:
        r"""Double backward of :math:`\langle G_S, v_S\rangle` through each kept graph: only the gradient
        entries of the support S are differentiated, so the part of the graph below S is never visited;
        ``wrt``: :math:`H[v]` on those parameters alone, taken only with respect to their leaves, so that
        autograd visits just the nodes on a path from them to :math:`G_S`."""
        return self._rev_rev(vs, wrt, stacked=True)

    def _rev_rev(self, vs: Mapping[str, Tensor], wrt: Sequence[str] | None, stacked: bool) -> param_dicts.Params:
        """:meth:`_hvps_rev_rev` of K stacked directions or (``stacked=False``) of one, not stacked."""
        if self._graphs is None:
            raise CurvlabError("this curvature point was closed: its graphs are freed")
        index = {n: i for i, n in enumerate(self.params)}
        wrt = list(self.params) if wrt is None else list(wrt)
        total = None
        for graph in self._graphs:
            outputs = [(graph.grads[index[n]], v) for n, v in vs.items() if graph.grads[index[n]].requires_grad]
            if outputs:  # (else the gradient on the support doesn't depend on W: H[v] = 0 on this batch)
                leaves = [graph.leaves[index[n]] for n in wrt]
                rows = double_backward([o for o, _ in outputs], leaves, [v for _, v in outputs], stacked)
                total = accumulate(total, rows, graph.weight, owned=fresh_rows(rows, [v for _, v in outputs]))
        if total is None:
            zeros = self._zeros(next(iter(vs.values())).shape[0] if stacked else None)
            return {n: zeros[n] for n in wrt}
        return dict(zip(wrt, total))

    def _hvps_fwd_rev(self, vs: Mapping[str, Tensor]) -> param_dicts.Params:
        """jvp of the full gradient with tangents only on the support S (the rest closed over, so no
        tangent work happens below S), vmapped over the K directions; loss and gradient come with it."""
        rest = {n: t for n, t in self.params.items() if n not in vs}
        on_support = {n: self.params[n] for n in vs}
        total = self._zeros(next(iter(vs.values())).shape[0])
        loss_total, g_total = 0.0, param_dicts.zeros_like(self.params)
        for f, w in self._each_batch("fwd_rev"):

            def one(v, f=f):
                (g, loss), (hv, _) = jvp(lambda p_s: grad_and_value(f)({**rest, **p_s}), (on_support,), (v,))
                return loss, g, hv

            loss, g, hv = vmap(one, out_dims=(None, None, 0), randomness="same")(vs)
            loss_total += w * checks.finite_loss(loss)
            g_total = param_dicts.add(g_total, g, w)
            for n, t in total.items():
                t.add_(hv[n], alpha=w)
        if self._gradient is None:
            self._loss, self._gradient = self._sum(loss_total), self._sum(g_total)
            if not any(t.any() for t in (*self._gradient.values(), *total.values())):
                self._first_order(create_graph=False)  # all zero: raises if the loss is detached
        return total

    def _zeros(self, k: int | None) -> param_dicts.Params:
        """Zeros like the parameters, stacked K times (``None``: not stacked)."""
        if k is None:
            return param_dicts.zeros_like(self.params)
        if self.sharded:  # (stacked zeros laid out like the parameters, sharded one dim later)
            return {n: torch.stack([torch.zeros_like(t)] * k) for n, t in self.params.items()}
        return {n: torch.zeros((k, *t.shape), dtype=t.dtype, device=t.device) for n, t in self.params.items()}

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Free the kept graphs (``"rev_rev"``); the point answers no more HVPs."""
        self._graphs = None

    def __enter__(self) -> CurvaturePoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def gradient_and_hvps(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    vs: Mapping[str, Tensor],
    *,
    method: str = DEFAULT_METHOD,
    dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
) -> tuple[float, param_dicts.Params, param_dicts.Params]:
    r"""Loss :math:`L(W)`, gradient :math:`G` and :math:`H[v_k]` for K stacked directions, at one point.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or a ``list``/:class:`~curvlab.engine.loss.Batches` of batches to accumulate.
        vs: dict of tensors shaped ``(K, *param.shape)``, one per parameter.
        method: ``"rev_rev"`` (double backward on the kept first-order graph, default) or ``"fwd_rev"``
            (jvp of grad); the two agree to rounding (:data:`METHODS`).
        dtype: computation dtype (default float32, or float64 when the parameters are).
        chunk_size: directions per vectorized call (bounds memory; ``None`` = all K at once).

    Returns:
        ``(loss, G, HV)`` with ``G`` shaped like ``params`` and ``HV`` like ``vs``, accumulated over
        batches with loss-term weights.
    """
    checks.check_full(params, vs)
    with CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype, chunk_size=chunk_size) as point:
        hv = point.hvps(vs)
        return point.loss, point.gradient, hv


def hvps(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    vs: Mapping[str, Tensor],
    *,
    method: str = DEFAULT_METHOD,
    dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
) -> param_dicts.Params:
    r""":math:`H[v_k]` for K directions stacked along dim 0, at one point (see :class:`CurvaturePoint`).

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or a ``list``/:class:`~curvlab.engine.loss.Batches` of batches to accumulate.
        vs: dict of tensors shaped ``(K, *param.shape)``, one per parameter.
        method: ``"rev_rev"`` (double backward on the kept first-order graph, default) or ``"fwd_rev"``
            (jvp of grad); the two agree to rounding (:data:`METHODS`).
        dtype: computation dtype (default float32, or float64 when the parameters are).
        chunk_size: directions per vectorized call (bounds memory; ``None`` = all K at once).

    Returns:
        :math:`H[v_k]`, a dict of tensors shaped like ``vs`` (``(K, *param.shape)``).
    """
    return gradient_and_hvps(loss_fn, params, batch, vs, method=method, dtype=dtype, chunk_size=chunk_size)[2]


def hvp(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Any,
    v: Mapping[str, Tensor],
    *,
    method: str = DEFAULT_METHOD,
    dtype: torch.dtype | None = None,
) -> param_dicts.Params:
    r"""The exact Hessian-vector product :math:`H[v] = \nabla^2 L(W)\, v`, a dict like ``params``.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``.
        params: parameter dict W (not modified).
        batch: one batch, or a ``list``/:class:`~curvlab.engine.loss.Batches` of batches to accumulate.
        v: direction, a dict with ``params``' keys and shapes.
        method: ``"rev_rev"`` (double backward, default) or ``"fwd_rev"`` (jvp of grad).
        dtype: computation dtype (default float32, or float64 when the parameters are).

    Returns:
        :math:`H[v]`, a dict of tensors with ``params``' keys and shapes.
    """
    param_dicts.check_like(params, v, finite=False)  # (finiteness with the product's: CurvaturePoint._hvp)
    with CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype) as point:
        return point._hvp(v, checked=True)  # (checked above, before the forward: the point's check would be a second)
