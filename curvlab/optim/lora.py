r"""Optimizers for low-rank adapters: sMuon, LoRA-Muon and per-factor Muon on peft's LoRA factors.

Convention (peft). An adapted layer computes the linear map :math:`W = W_0 + s\,BA` with
:math:`B \in \mathbb{R}^{d_\text{out}\times r}` (``lora_B``), :math:`A \in \mathbb{R}^{r\times d_\text{in}}`
(``lora_A``) and the scale :math:`s` (peft's ``scaling``: ``lora_alpha / r``, or ``/ sqrt(r)`` with
rsLoRA). Write :math:`G = \partial L/\partial W`. The loss sees A and B only through BA, so

.. math::
    G_A = \partial L/\partial A = s\,B^\top G, \qquad G_B = \partial L/\partial B = s\,G A^\top .

The factor gradients therefore know G only on the tangent space T of rank-r matrices at BA: with
:math:`P_B = BB^+` and :math:`P_A = A^+A`, the projection
:math:`\operatorname{proj}_T(X) = P_B X + (I - P_B) X P_A` of G is, exactly,

.. math::
    H = \operatorname{proj}_T(G) = \tfrac1s\big[B (B^\top B)^+ G_A + (I - P_B)\, G_B (AA^\top)^+ A\big].

The same formulas hold for LoRA on embeddings (``lora_embedding_A/B``, the map is :math:`(sBA)^\top`)
and on convolutions (the factors flattened to :math:`r\times(d_\text{in} k)` and
:math:`d_\text{out}\times r`).

* :class:`SMuon` (Anson, Houghton, Milsom 2026; docs/science.md section 8) steps the factors so that the
  first-order change of W is :math:`-\eta\,c\,\operatorname{proj}_T(\operatorname{msign}(H))`,
  the least-squares fit (over :math:`\delta B A + B\,\delta A`) to the Muon step of the
  *first-order-equivalent* gradient H. This is **not** :math:`\operatorname{proj}_T(\operatorname{msign}(G))`:
  msign(H) leaves T, and on random matrices the two directions have cosine 0.84-0.93
  (``benchmarks/lora.py``). The cost is O((d_out + d_in) r²), as the paper's recipe: matrix products, four
  r x r eigendecompositions (thin SVDs of B, A and two d x r pieces of H), one polar factor of at most 2r x 2r.
* :class:`LoraMuon` (Cesista, Simal, Crowson, Biderman 2026): each factor's momentum is whitened by the
  other factor's Gram matrix, orthogonalized, and given half of the step budget.
* :class:`PerFactorMuon`: Muon on A and on B, each as a matrix of its own.
* AdamW, the baseline, needs nothing here: peft freezes everything but the adapters, so
  ``build_optimizer("adamw", peft_model)`` trains exactly them.

Shared by the three: curvlab Muon's EMA momentum (:math:`m \leftarrow \mu m + (1-\mu) g`, Nesterov input
:math:`g + \mu(m - g)`), a polar factor from :func:`curvlab.optim.polar.msign` (``"svd"``,
``"newton_schulz"``, ``"polar_express"``), Muon's shape scale c (:func:`curvlab.optim.muon.muon_scale`) and
*split* weight decay: with :math:`\kappa = \sqrt{1-\lambda\eta}` and :math:`\Delta A, \Delta B` the steps
computed at the current factors,

.. math::  A \leftarrow \kappa A + \Delta A / \kappa, \qquad B \leftarrow \kappa B + \Delta B / \kappa,

so the adapter :math:`sBA` decays by :math:`1 - \lambda\eta` (W_0 never decays) and the first-order change
from the step is the undecayed one. For sMuon this equals decaying first and stepping at the decayed
factors (:math:`(\kappa B)^+ = B^+/\kappa`), as the paper does.

Singular factors. Every inverse above is a Moore-Penrose pseudo-inverse, computed from a rank-revealing
thin SVD of each factor (the eigendecomposition of its float64 Gram matrix); singular values below about
:math:`10^{-7}\sigma_\max` count as zero.
At peft's initialization, B = 0: then :math:`P_B = 0`, T is :math:`\{X P_A\}`, H = G P_A, and sMuon's
first step is :math:`\delta A = 0`, :math:`\delta B \propto \operatorname{msign}(G P_A) A^+` - the exact
least-squares solution, no division by zero. LoRA-Muon gives A no step there (:math:`(B^\top B)^{+1/2} = 0`),
so its first step spends half its budget. peft's embedding LoRA starts from A = 0 instead; the same
rule applies with the roles swapped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from curvlab.errors import CurvlabError
from curvlab.optim.combined import CombinedOptimizer
from curvlab.optim.model_optimizer import ADAM_SIDE_DEFAULTS, LORA_OPTIMIZERS, adamw, reject_unknown_options
from curvlab.optim.muon import check_polar_settings, ema_momentum, evaluate_closure, muon_scale, polar_options
from curvlab.optim.polar import msign

_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class AdaptedLayer:
    r"""One LoRA-adapted layer, :math:`W = W_0 + s\,BA`: its name, its factor parameters and s."""

    name: str
    A: nn.Parameter
    B: nn.Parameter
    scaling: float

    @property
    def shape(self) -> tuple[int, int]:
        """``(d_out, d_in)`` of the map BA (a convolution's d_in counts its kernel)."""
        return self.B.shape[0], self.A[0].numel()


def _factor_pairs(module: nn.Module) -> list[tuple[str, Tensor, Tensor]]:
    """``(adapter, A, B)`` for each adapter of one peft ``LoraLayer``, linear/conv or embedding."""
    pairs = [(a, module.lora_A[a].weight, module.lora_B[a].weight) for a in module.lora_A if a in module.lora_B]
    pairs += [
        (a, module.lora_embedding_A[a], module.lora_embedding_B[a])
        for a in module.lora_embedding_A
        if a in module.lora_embedding_B
    ]
    return pairs


def lora_layers(model: nn.Module) -> list[AdaptedLayer]:
    r"""The trainable LoRA factor pairs of a peft model, one :class:`AdaptedLayer` per layer and adapter.

    Layers are found by module type (peft's ``LoraLayer``), never by parameter names. A layer with
    several trainable adapters gives one entry per adapter, named ``layer[adapter]``.

    Raises:
        CurvlabError: no trainable LoRA layer; a pair with only one factor trainable; factors whose
            shapes are not :math:`d_\text{out}\times r` and :math:`r\times d_\text{in}` (e.g. a grouped
            convolution); a rank larger than the layer; a factor shared by two layers (tied adapters).
    """
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:  # without peft there can be no peft LoRA layers
        LoraLayer = ()
    layers: list[AdaptedLayer] = []
    for module_name, module in model.named_modules():
        if not isinstance(module, LoraLayer):
            continue
        pairs = [(a, A, B) for a, A, B in _factor_pairs(module) if A.requires_grad or B.requires_grad]
        for adapter, A, B in pairs:
            name = module_name.removeprefix(_PEFT_PREFIX) + (f"[{adapter}]" if len(pairs) > 1 else "")
            if not (A.requires_grad and B.requires_grad):
                raise CurvlabError(f"LoRA layer {name}: only one of its factors A, B is trainable")
            r = A.shape[0]
            if B.dim() < 2 or B.shape[1] != r or B[0, 0].numel() != 1:
                raise CurvlabError(
                    f"LoRA layer {name}: factors of shapes A {tuple(A.shape)}, B {tuple(B.shape)} are not "
                    f"r x d_in and d_out x r (a grouped convolution?); the adapter optimizers need W0 + s·B A"
                )
            layer = AdaptedLayer(name, A, B, float(module.scaling[adapter]))
            if r > min(layer.shape):
                raise CurvlabError(
                    f"LoRA layer {name}: rank {r} exceeds the layer's smaller side "
                    f"(d_out x d_in = {layer.shape[0]} x {layer.shape[1]}); use r <= {min(layer.shape)}"
                )
            layers.append(layer)
    if not layers:
        raise CurvlabError(
            "the model has no trainable LoRA layers (peft LoraLayer modules); the adapter optimizers need a "
            "peft LoRA model (peft.get_peft_model), otherwise use muon or adamw"
        )
    factors = [id(p) for layer in layers for p in (layer.A, layer.B)]
    if len(set(factors)) != len(factors):
        raise CurvlabError("two LoRA layers share a factor (tied adapters); the adapter optimizers need separate ones")
    return layers


def adapter_blocks(model: nn.Module) -> dict[str, list[str]]:
    """One curvature block per adapted layer, its A and B together, for ``block_matrix(..., blocks=...)``.

    Keys are layer names (``transformer.h.0.attn.c_q``, peft's ``base_model.model.`` prefix dropped),
    values the two factors' parameter names as ``model.named_parameters()`` gives them. Any other
    trainable parameter (a ``modules_to_save`` copy, a LoRA bias) is a block of its own under its
    parameter name, so the mapping covers every trainable parameter, the ones ``next_update`` returns.
    """
    names = {id(p): n for n, p in model.named_parameters()}
    blocks = {layer.name: [names[id(layer.A)], names[id(layer.B)]] for layer in lora_layers(model)}
    claimed = {n for members in blocks.values() for n in members}
    for n, p in model.named_parameters():
        if p.requires_grad and n not in claimed:
            blocks[n] = [n]
    return blocks


# ---------------------------------------------------------------------------------------------------
# The algebra, on plain matrices: a (r x n) = A, b (m x r) = B, gradients in the same shapes.


@dataclass(frozen=True)
class _Frame:
    r"""A rank-revealing thin SVD :math:`F = Q \operatorname{diag}(\sigma) V^\top` of a tall ``m x r`` F,
    nonzero part only: Q (m x k) is an orthonormal basis of col(F), and :math:`F^+ = V \sigma^{-1} Q^\top`."""

    Q: Tensor
    V: Tensor
    sigma: Tensor

    @property
    def W(self) -> Tensor:
        r""":math:`V\sigma^{-1}` (r x k), so that :math:`Q = FW` and :math:`F^+ = W Q^\top`."""
        return self.V / self.sigma

    @property
    def inv_sqrt_gram(self) -> Tensor:
        r""":math:`(F^\top F)^{+1/2} = V \sigma^{-1} V^\top` (r x r)."""
        return self.W @ self.V.mT


def _frame(F: Tensor) -> _Frame:
    r"""From the Gram matrix :math:`F^\top F = V \Lambda V^\top` (one r x r eigendecomposition):
    :math:`\sigma = \Lambda^{1/2}` and :math:`Q = F V \sigma^{-1}`, with eigenvalues below
    :math:`\lambda_\max \max(d, r)\,\epsilon_{64}` dropped (singular values below about
    :math:`10^{-7}\sigma_\max`). Computed in float64 and rounded once, Q is orthonormal to F's own
    precision for condition numbers up to about :math:`10^4` (measured: 6e-9 in float64 before rounding;
    Householder QR then an SVD gives 1e-6 in float32 and costs about 1.3x more on the CPU)."""
    if F.shape[1] == 0:
        return _Frame(F, F.new_zeros(0, 0), F.new_zeros(0))
    F64 = F.double()
    lam, V = torch.linalg.eigh(F64.mT @ F64)
    keep = lam[-1] * max(F.shape) * torch.finfo(torch.float64).eps < lam  # ascending; none kept when F = 0
    V, sigma = V[:, keep], lam[keep].sqrt()
    return _Frame((F64 @ (V / sigma)).to(F.dtype), V.to(F.dtype), sigma.to(F.dtype))


def _orthogonal_part(F: Tensor, Q: Tensor) -> Tensor:
    r""":math:`(I - QQ^\top)F` for orthonormal Q (one classical Gram-Schmidt pass)."""
    return F - Q @ (Q.mT @ F)


@dataclass(frozen=True)
class _Tangent:
    r"""A matrix in the tangent space at (B, A), as :math:`M = Q_B X + Y Q_A^\top` with
    :math:`X = Q_B^\top M` (k_B x n) and :math:`Y = (I - P_B) M Q_A` (m x k_A)."""

    X: Tensor
    Y: Tensor


class _Point:
    """The factors a = A (r x n), b = B (m x r) and s; the frames of col(B) and row(A), made when first used."""

    def __init__(self, a: Tensor, b: Tensor, scaling: float):
        self.a, self.b, self.scaling = a, b, scaling

    @functools.cached_property
    def fb(self) -> _Frame:
        return _frame(self.b)

    @functools.cached_property
    def fa(self) -> _Frame:
        return _frame(self.a.mT)

    def project(self, grad_a: Tensor, grad_b: Tensor) -> _Tangent:
        r""":math:`\operatorname{proj}_T(M)` of the M whose factor gradients are ``(grad_a, grad_b)``:
        :math:`Q_B^\top M = W_B^\top G_A / s` and :math:`M Q_A = G_B W_A / s`."""
        Qb, s = self.fb.Q, self.scaling
        X = self.fb.W.mT @ grad_a / s
        MQa = grad_b @ self.fa.W / s
        return _Tangent(X, _orthogonal_part(MQa, Qb))

    def factor_gradients(self, t: _Tangent, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        r"""The gradients :math:`(s\,b^\top M, s\,M a^\top)` that M would give factors (b, a) - how
        momentum is carried to new factors."""
        Qb, Qa, s = self.fb.Q, self.fa.Q, self.scaling
        grad_a = s * ((b.mT @ Qb) @ t.X + (b.mT @ t.Y) @ Qa.mT)
        grad_b = s * (Qb @ (t.X @ a.mT) + t.Y @ (a @ Qa).mT)
        return grad_a, grad_b

    def smuon_steps(self, t: _Tangent, polar: dict[str, Any]) -> tuple[Tensor, Tensor]:
        r""":func:`smuon_direction`'s unit factor steps, from H in tangent coordinates.

        :math:`H = Q_B X + Y Q_A^\top` has orthonormal column and row bases :math:`U = [Q_B, Q_Y]` and
        :math:`V = [Q_A, Q_X]`, with :math:`Q_Y` a basis of col(Y) (already orthogonal to :math:`Q_B`) and
        :math:`Q_X` one of the rows of :math:`X_\perp = X(I - P_A)`. In them, with the thin SVDs
        :math:`Y = Q_Y \Sigma_Y V_Y^\top` and :math:`X_\perp^\top = Q_X \Sigma_X V_X^\top`,

        .. math::
            H = U C V^\top,\quad C = \begin{pmatrix} X Q_A & V_X\Sigma_X \\ \Sigma_Y V_Y^\top & 0\end{pmatrix},
            \quad \Omega = U \operatorname{msign}(C) V^\top,

        one polar factor of an at most 2r x 2r core (Newton–Schulz on C is Newton–Schulz on H: an odd
        polynomial, and :math:`\|C\|_F = \|H\|_F`). Since :math:`Q_B^\top U = [I, 0]` and
        :math:`V^\top Q_A = [I; 0]`, with :math:`P = \operatorname{msign}(C)` split after k_B rows and k_A
        columns: :math:`B^+\Omega = W_B P_{1\cdot} V^\top` and :math:`(I - P_B)\Omega A^+ = Q_Y P_{21} W_A^\top`.
        """
        Qb, Qa = self.fb.Q, self.fa.Q
        # Gram-Schmidt twice, so that the bases stay orthogonal when Y or X_perp is small
        fy = _frame(_orthogonal_part(t.Y, Qb))  # (Y had its first pass in project)
        fx = _frame(_orthogonal_part(_orthogonal_part(t.X.mT, Qa), Qa))
        XQa = t.X @ Qa
        kb, ka = Qb.shape[1], Qa.shape[1]
        if kb + fy.Q.shape[1] == 0 or ka + fx.Q.shape[1] == 0:  # H = 0 (or no tangent space): no step
            return torch.zeros_like(self.a), torch.zeros_like(self.b)
        top = torch.cat([XQa, fx.V * fx.sigma], dim=1)
        bottom = torch.cat([fy.sigma[:, None] * fy.V.mT, XQa.new_zeros(fy.Q.shape[1], fx.Q.shape[1])], dim=1)
        P = msign(torch.cat([top, bottom]), **polar).to(XQa.dtype)
        delta_a = self.fb.W @ (P[:kb, :ka] @ Qa.mT + P[:kb, ka:] @ fx.Q.mT)
        delta_b = fy.Q @ (P[kb:, :ka] @ self.fa.W.mT)
        return delta_a / self.scaling, delta_b / self.scaling


def smuon_direction(
    A: Tensor, B: Tensor, grad_A: Tensor, grad_B: Tensor, scaling: float = 1.0, polar: str = "svd", **polar_options
) -> tuple[Tensor, Tensor]:
    r"""sMuon's factor directions :math:`(\delta A, \delta B)` from the factor gradients alone.

    With :math:`H = \operatorname{proj}_T(G)` (module docstring) and :math:`\Omega = \operatorname{msign}(H)`:
    :math:`\delta A = B^+\Omega / s`, :math:`\delta B = (I - P_B)\,\Omega A^+ / s`, so the first-order change
    of W along them is
    :math:`s(\delta B\,A + B\,\delta A) = P_B\Omega + (I-P_B)\Omega P_A = \operatorname{proj}_T(\Omega)`.
    The d_out x d_in matrices G, H and Ω are never formed; the cost is O((d_out + d_in) r²).

    Args:
        A, B: ``r x d_in`` and ``d_out x r``; grad_A, grad_B: their gradients (or momenta).
        scaling: peft's s.
        polar: ``"svd"`` (default here), ``"newton_schulz"`` or ``"polar_express"``; ``polar_options``
            (``steps``, ``dtype``, ``eps``) go to :func:`~curvlab.optim.polar.msign`.

    Returns:
        ``(delta_A, delta_B)`` in the working dtype (float64 for float64 input, else float32).
    """
    dt = torch.promote_types(A.dtype, torch.float32)
    point = _Point(A.to(dt), B.to(dt), scaling)
    return point.smuon_steps(point.project(grad_A.to(dt), grad_B.to(dt)), {"polar": polar, **polar_options})


# ---------------------------------------------------------------------------------------------------
# The optimizers


class _AdapterOptimizer(torch.optim.Optimizer):
    r"""One param group per adapted layer (``params = [A, B]``, plus its ``scaling`` and ``layer`` name).

    Per-parameter state: ``momentum_buffer`` (the EMA of that factor's gradient, in its shape), so the
    state dict round-trips like torch's Muon. Subclasses give the unit directions
    :math:`(d_A, d_B)`, the step being :math:`\Delta A = -\eta\,d_A`, :math:`\Delta B = -\eta\,d_B` at the
    current factors, before split weight decay.
    """

    def __init__(
        self,
        layers: Sequence[AdaptedLayer],
        lr: float = 0.02,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        scale: str = "original",
        polar: str = "newton_schulz",
        polar_dtype: torch.dtype | str = torch.bfloat16,
        eps: float = 1e-7,
    ):
        layers = list(layers)
        if not layers:
            raise CurvlabError(f"{type(self).__name__} needs at least one LoRA layer")
        if lr < 0 or weight_decay < 0 or not 0 <= momentum < 1:
            raise CurvlabError(
                f"need lr >= 0, weight_decay >= 0, 0 <= momentum < 1; got {lr}, {weight_decay}, {momentum}"
            )
        polar_dtype = check_polar_settings(scale, polar, polar_dtype)
        groups = [{"params": [x.A, x.B], "scaling": x.scaling, "layer": x.name} for x in layers]
        defaults = {"lr": lr, "weight_decay": weight_decay, "momentum": momentum, "nesterov": nesterov}
        defaults |= {"ns_steps": ns_steps, "scale": scale, "polar": polar, "polar_dtype": polar_dtype, "eps": eps}
        super().__init__(groups, defaults)

    def _directions(self, group: dict, point: _Point, ua: Tensor, ub: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def _carry(self, point: _Point, ma: Tensor, mb: Tensor, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        """The momenta (factor-gradient EMAs at the old factors) as the new factors (a, b) should see them."""
        return ma, mb

    @torch.no_grad()
    def step(self, closure=None):
        loss = evaluate_closure(closure)
        for group in self.param_groups:  # checked before anything moves
            decay = group["lr"] * group["weight_decay"]
            if decay >= 1:
                raise CurvlabError(f"lr·weight_decay = {decay} >= 1 in layer {group['layer']}: split decay needs < 1")
        for group in self.param_groups:
            A, B = group["params"]
            if A.grad is None and B.grad is None:
                continue
            lr = group["lr"]
            r, dt = A.shape[0], torch.promote_types(A.dtype, torch.float32)
            grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in (A, B)]
            (buf_a, ua), (buf_b, ub) = (ema_momentum(self.state[p], g, group) for p, g in zip((A, B), grads))
            point = _Point(A.reshape(r, -1).to(dt), B.reshape(-1, r).to(dt), group["scaling"])
            da, db = self._directions(group, point, ua.reshape(r, -1).to(dt), ub.reshape(-1, r).to(dt))
            kappa = math.sqrt(1 - lr * group["weight_decay"])
            a = kappa * point.a - (lr / kappa) * da
            b = kappa * point.b - (lr / kappa) * db
            ma, mb = self._carry(point, buf_a.reshape(r, -1).to(dt), buf_b.reshape(-1, r).to(dt), a, b)
            for p, new in ((A, a), (B, b), (buf_a, ma), (buf_b, mb)):
                p.copy_(new.view(p.shape))
        return loss


class SMuon(_AdapterOptimizer):
    r"""sMuon (Anson, Houghton, Milsom 2026): the least-squares fit of the factors' first-order change to
    the Muon step of :math:`H = \operatorname{proj}_T(G)`.

    Per layer, the steps are :math:`-\eta c` times :func:`smuon_direction` of the factor-gradient momenta
    (Nesterov input), with Muon's shape scale :math:`c = c(d_\text{out}, d_\text{in})` of the whole layer
    (``scale``, :func:`~curvlab.optim.muon.muon_scale`): η means what it means for Muon on W, for any s.
    Then split weight decay (module docstring).

    Momentum transport. The buffers hold the factor gradients :math:`(sB^\top M, sMA^\top)` of a momentum
    matrix M in the current tangent space. After the step, M is carried to the new factors (B', A') by
    projection: the buffers become :math:`(sB'^\top M, sMA'^\top)`, the gradients M gives the new factors,
    so that the next EMA is :math:`\operatorname{proj}_{T'}(\mu M + (1-\mu) G')`. This makes the
    momentum independent of how BA is factored (BK, K⁻¹A give the same M).
    """

    def _directions(self, group, point, ua, ub):
        c = muon_scale(torch.Size([point.b.shape[0], point.a.shape[1]]), group["scale"])
        da, db = point.smuon_steps(point.project(ua, ub), polar_options(group))
        return c * da, c * db

    def _carry(self, point, ma, mb, a, b):
        return point.factor_gradients(point.project(ma, mb), a, b)


class LoraMuon(_AdapterOptimizer):
    r"""LoRA-Muon (Cesista, Simal, Crowson, Biderman 2026), mapped to peft's :math:`W_0 + s\,BA`.

    The paper writes :math:`W_\text{pre} + A_c B_c^\top` with :math:`A_c \in \mathbb{R}^{m\times r}`,
    :math:`B_c \in \mathbb{R}^{n\times r}`; here :math:`A_c = sB` and :math:`B_c = A^\top` (how s is split
    doesn't matter). With :math:`R_A = (AA^\top)^{+1/2}`, :math:`R_B = (B^\top B)^{+1/2}` and the momenta
    :math:`m_A, m_B` of peft's factor gradients, their
    :math:`\Delta A_c = -\tfrac\eta2 \operatorname{msign}(m^{A_c} R_{B_c}) R_{B_c}` and its twin become

    .. math::
        \Delta B = -\tfrac{\eta c}{2s} \operatorname{msign}(m_B R_A)\, R_A,\qquad
        \Delta A = -\tfrac{\eta c}{2s} R_B \operatorname{msign}(R_B\, m_A),

    so :math:`s\,\Delta B\,A = -\tfrac{\eta c}2 \operatorname{msign}(G Q_A) Q_A^\top` and
    :math:`s\,B\,\Delta A = -\tfrac{\eta c}2 Q_B \operatorname{msign}(Q_B^\top G)` (Q: orthonormal bases of
    row(A), col(B)): each half has spectral norm at most ηc/2, the step budget split between the
    factors. c is Muon's shape scale of the layer (1 for the paper, which has none, when
    d_out <= d_in under ``scale="original"``). Momentum is a plain EMA per factor (no transport), with
    Nesterov on by default as in curvlab's Muon (the paper's formula is ``nesterov=False``).
    """

    def _directions(self, group, point, ua, ub):
        c = muon_scale(torch.Size([point.b.shape[0], point.a.shape[1]]), group["scale"])
        Ra, Rb, polar = point.fa.inv_sqrt_gram, point.fb.inv_sqrt_gram, polar_options(group)
        half = c / (2 * point.scaling)
        da = Rb @ msign(Rb @ ua, **polar).to(ua.dtype)  # B = 0 gives R_B = 0 and msign(0) = 0: no step
        db = msign(ub @ Ra, **polar).to(ub.dtype) @ Ra
        return half * da, half * db


class PerFactorMuon(_AdapterOptimizer):
    r"""Muon on each factor as a matrix of its own:
    :math:`\Delta A = -\eta\,c(r, d_\text{in}) \operatorname{msign}(m_A)` and
    :math:`\Delta B = -\eta\,c(d_\text{out}, r) \operatorname{msign}(m_B)`, each with Muon's shape scale of
    *its factor's* shape (under ``"original"``, 1 for A and :math:`\sqrt{d_\text{out}/r}` for B).

    s does not enter: the factors are treated as any weights, so the change of W,
    :math:`s(\Delta B\,A + B\,\Delta A)`, grows with s and the factors' norms. With ``weight_decay=0`` a
    step equals :class:`curvlab.optim.muon.Muon`'s on the two factors; with decay, the split rule keeps λ's
    meaning the same across the adapter optimizers (Muon would shrink the product by :math:`(1-\lambda\eta)^2`).
    """

    def _directions(self, group, point, ua, ub):
        polar = polar_options(group)
        da = muon_scale(ua.shape, group["scale"]) * msign(ua, **polar).to(ua.dtype)
        db = muon_scale(ub.shape, group["scale"]) * msign(ub, **polar).to(ub.dtype)
        return da, db


_CLASSES = {"smuon": SMuon, "lora-muon": LoraMuon, "per-factor-muon": PerFactorMuon}


def build_lora_optimizer(name: str, model: nn.Module, **hyperparameters: Any) -> torch.optim.Optimizer:
    """An adapter optimizer by name (``"smuon"``, ``"lora-muon"``, ``"per-factor-muon"``) for a peft LoRA model.

    The factors of every trainable LoRA layer go to it; any other trainable parameter (``modules_to_save``
    copies, LoRA biases) to ``torch.optim.AdamW``, the two combined in a
    :class:`~curvlab.optim.combined.CombinedOptimizer` (only when there are such parameters).

    Options: ``lr`` (0.02), ``momentum`` (0.95), ``nesterov`` (True), ``weight_decay`` (0, split),
    ``ns_steps`` (5), ``scale`` ("original"), ``polar`` ("newton_schulz"), ``polar_dtype`` (bfloat16),
    ``eps``; and ``adam_lr`` (0.0018), ``adam_betas`` ((0.9, 0.95)), ``adam_eps`` (1e-8),
    ``adam_weight_decay`` (0) for the AdamW side (:data:`curvlab.optim.model_optimizer.ADAM_SIDE_DEFAULTS`, as Muon's).

    Raises:
        CurvlabError: an unknown name or option; a model without trainable LoRA layers; a rank larger
            than its layer (see :func:`lora_layers`).
    """
    if name not in _CLASSES:
        raise CurvlabError(f"unknown adapter optimizer {name!r}; choose one of {', '.join(LORA_OPTIMIZERS)}")
    adam = {k: hyperparameters.pop(k, v) for k, v in ADAM_SIDE_DEFAULTS.items()}
    known = ("lr", "momentum", "nesterov", "weight_decay", "ns_steps", "scale", "polar", "polar_dtype", "eps")
    reject_unknown_options(name, {k: v for k, v in hyperparameters.items() if k not in known})
    layers = lora_layers(model)
    optimizer = _CLASSES[name](layers, **hyperparameters)
    factors = {id(p) for layer in layers for p in (layer.A, layer.B)}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in factors]
    if not rest:
        return optimizer
    return CombinedOptimizer({name: optimizer, "adamw": adamw(rest, adam, prefix="adam_")})
