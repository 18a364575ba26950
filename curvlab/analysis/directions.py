r"""Counterfactual directions at one point: several steps judged at the same W, batch and Hessian.

The paper's mechanism is that Muon's *direction* is less sharp. Between two runs, NDS also changes
because the two runs stand at different W (the landscape). Here the landscape is held fixed: at one
checkpoint, every direction is measured at one :class:`~curvlab.engine.hvp.CurvaturePoint`, two second
backwards a direction. For each direction Z and each scope (:data:`~curvlab.curvature.scope.SCOPES`: ``"all"``
parameters, ``"hidden"`` matrices only), a :class:`~curvlab.curvature.scope.DirectionCurvature`:

.. math::
    \mathrm{NDS} = \frac{\langle Z, H Z\rangle}{\|Z\|^2},\qquad
    \cos = \frac{\langle G, Z\rangle}{\|G\|\,\|Z\|},\qquad
    q = \frac{\cos^2}{\mathrm{NDS}},

where q is free of the lr: along Z the best one-step decrease of the quadratic model,
:math:`\max_\eta\, \eta\langle G, Z\rangle - \tfrac{\eta^2}{2}\langle Z, HZ\rangle = \tfrac{q}{2}\|G\|^2`
(for NDS > 0; NDS <= 0 gives q <= 0: the model has no minimum along Z, and the value is kept, not dropped).
On the hidden matrices each direction also takes the model's optimal step, :math:`\eta^* = \langle G_h, Z_h\rangle
/ \langle Z_h, H Z_h\rangle` (for :math:`\langle Z_h, HZ_h\rangle > 0`), which the loss is evaluated at: the
predicted optimal decrease :math:`\tfrac{q}{2}\|G_h\|^2` beside the realized one, :math:`L(W) - L(W - \eta^* Z_h)`
on the point's batch (:class:`PairedCurvature`; one forward per direction, no HVP): is the advantage q predicts
realized? With ``gauss_newton``, the two arms' NDS on both scopes is also split into its Gauss–Newton part and
the residual (:mod:`curvlab.curvature.gauss_newton`; one forward-mode product per direction and scope).

**The directions** (:data:`DIRECTIONS`) differ on the hidden matrices only; on every other parameter
(embeddings, head, norms, biases) each of them is the run's own next step, so that scope ``"all"`` asks
what the whole step would be with another rule on the hidden matrices. On the hidden matrices:

From an Adam-family state (an AdamW run; m, v after the next gradient G):

* ``adamw``: the real next step, :math:`\eta\,\hat m / (\sqrt{\hat v} + \epsilon)`;
* ``muon``: the shadow Muon's step (:mod:`curvlab.steps.shadow`) when the checkpoint carries one; else
  :math:`\eta_\mu\, s\, \operatorname{msign}(m)`, **an approximation**: Adam's first moment (an EMA
  with :math:`\beta_1`, without Nesterov) stands in for Muon's momentum;
* ``sgd``: the first moment m (momentum SGD); ``sign``: :math:`\operatorname{sign}(m)`.

From a Muon state (B, the momentum after G):

* ``muon``: the real next step; ``sgd``: B; ``sign``: :math:`\operatorname{sign}(B)`;
* ``adamw``: the shadow Adam's step, only when the checkpoint carries a shadow Adam state (Adam's
  second moment can't be recovered from Muon's state).

**Scale.** On the hidden matrices NDS, cos and q don't depend on a direction's length; over all
parameters they do. ``adamw`` and ``muon`` take their arm's lr (the real step's own; a shadow's or the
approximation's: the shadow's peak lr (the other arm's default, or the lr the run set) times the run's
current schedule multiplier, Muon's shape scale included). Momentum SGD and sign descent have no lr in
these runs: ``sgd`` and ``sign`` are scaled to the Frobenius norm of the real step on the hidden matrices
(``scaling = "matched"``).

**Direction and landscape.** For an AdamW checkpoint a and a Muon checkpoint b, write
:math:`N_x(W)` for the NDS of direction x at W. The between-run ratio splits exactly:

.. math::
    \frac{N_\text{adamw}(W_a)}{N_\text{muon}(W_b)}
    = \underbrace{\frac{N_\text{adamw}(W_a)}{N_\text{muon}(W_a)}}_{\text{direction at } a}
      \underbrace{\frac{N_\text{muon}(W_a)}{N_\text{muon}(W_b)}}_{\text{landscape along muon}}
    = \underbrace{\frac{N_\text{adamw}(W_b)}{N_\text{muon}(W_b)}}_{\text{direction at } b}
      \underbrace{\frac{N_\text{adamw}(W_a)}{N_\text{adamw}(W_b)}}_{\text{landscape along adamw}}

(:class:`DirectionLandscape`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from math import inf, isnan, nan
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from curvlab.curvature.gauss_newton import gauss_newton_at
from curvlab.curvature.groupings import hidden_matrices
from curvlab.curvature.scope import SCOPES, DirectionCurvature
from curvlab.engine import params as param_dicts
from curvlab.engine.hvp import DEFAULT_METHOD, CurvaturePoint
from curvlab.errors import CurvlabError
from curvlab.models.roles import matrix_shapes
from curvlab.steps.shadow import ShadowSettings, ShadowState, muon_step
from curvlab.util.codec import Record

DIRECTIONS = ("adamw", "muon", "sgd", "sign")
PAIRED = ("adamw", "muon")  # the two arms, paired at every checkpoint that carries a shadow
# what a paired direction's JSON keeps of each scope's record (see PairedDirection.to_dict)
DIRECTION_KEYS = ("nds", "first_order", "curvature_penalty", "update_norm", "grad_norm", "cosine", "q")
DIRECTION_KEYS += ("optimal_predicted", "optimal_realized")  # (the hidden scope's; null on "all", absent before)
DIRECTION_KEYS += ("nds_gauss_newton",)  # (the arms', where asked for; null otherwise, absent before)
BASES = {"adam": "adamw", "muon": "muon"}  # the optimizer state on the hidden matrices -> its real direction
PAIRED_SCHEMA_VERSION = 1
NOT_FINITE = "the loss is not finite"  # (curvlab.engine.checks.finite_loss's error)
APPROXIMATE_MUON = (
    "approximation: msign of Adam's first moment m (an EMA with beta1, no Nesterov) stands in for Muon's "
    "momentum, at the Muon arm's lr and shape scale"
)


@dataclass(frozen=True)
class PairedCurvature(DirectionCurvature):
    r"""A direction's curvature over one scope at the point, with the quadratic model's optimal step along it
    (module docstring), measured on the hidden scope only: NaN on ``"all"``, where
    :math:`\langle Z_h, HZ_h\rangle \le 0` (no optimum), and in reports made before it was measured.

    Attributes:
        optimal_predicted: :math:`\tfrac12\|G_h\|^2 q = \tfrac12 \langle G_h, Z_h\rangle^2 / \langle Z_h, H Z_h\rangle`,
            the model's decrease at :math:`\eta^*`.
        optimal_realized: :math:`L(W) - L(W - \eta^* Z_h)` on the point's batch.
        nds_gauss_newton: the Gauss–Newton part of the NDS, :math:`\langle JZ, H_\ell JZ\rangle / \|Z\|^2` (NaN where
            not measured); the residual is ``nds - nds_gauss_newton``.
    """

    optimal_predicted: float = nan
    optimal_realized: float = nan
    nds_gauss_newton: float = nan


@dataclass(frozen=True)
class PairedDirection:
    """One direction at the point, over both scopes.

    Attributes:
        name: one of :data:`DIRECTIONS`.
        source: how it was formed (``"real step"``, ``"shadow muon state"``, an approximation...).
        scaling: ``"lr"`` (its optimizer's lr) or ``"matched"`` (to the real step's norm on the hidden matrices).
    """

    name: str
    source: str
    scaling: str
    all: DirectionCurvature
    hidden: DirectionCurvature  # (a PairedCurvature: with the optimal step)

    def scope(self, scope: str) -> DirectionCurvature:
        if scope not in SCOPES:
            raise CurvlabError(f"unknown scope {scope!r}; choose one of {', '.join(SCOPES)}")
        return self.all if scope == "all" else self.hidden

    # by hand: each scope's object is a view of its DirectionCurvature, DIRECTION_KEYS: no realized or
    # predicted decrease of the step itself (it is not taken here: read back as NaN and I1 - I2) but the derived
    # q and the optimal step's decreases (NaN where not measured)
    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": self.source,
            "scaling": self.scaling,
            **{s: {k: getattr(self.scope(s), k, nan) for k in DIRECTION_KEYS} for s in SCOPES},
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PairedDirection:
        return cls(d["name"], d["source"], d["scaling"], *(_unstepped(d[s]) for s in SCOPES))


def _unstepped(d: Mapping[str, Any]) -> PairedCurvature:
    """A paired direction's scope (DIRECTION_KEYS; ``q`` is derived, not read; null reads as NaN, and so do the
    optimal step's keys where a report made before they were measured lacks them)."""
    first_order, penalty = _float(d["first_order"]), _float(d["curvature_penalty"])
    rest = {k: _float(d[k]) for k in ("nds", "update_norm", "grad_norm", "cosine")}
    rest |= {k: _float(d.get(k)) for k in ("optimal_predicted", "optimal_realized", "nds_gauss_newton")}
    return PairedCurvature(
        first_order=first_order, curvature_penalty=penalty, predicted=first_order - penalty, realized=nan, **rest
    )


def _float(x: Any) -> float:
    return nan if x is None else float(x)


@dataclass(frozen=True)
class PairedDirections(Record):
    """Several directions measured at one W, on one batch, under one H.

    Attributes:
        base: ``"adam"`` or ``"muon"``, the optimizer state the run keeps on its hidden matrices.
        real: the name of the run's own direction (``adamw`` or ``muon``).
        directions: in the order asked for.
        hidden_names: the hidden matrices (scope ``"hidden"``, and where the directions differ).
        multiplier: the run's schedule multiplier at the step (scales the lr of shadow steps).
        shadow: the settings of the shadow state a direction came from (:class:`~curvlab.steps.shadow.ShadowSettings`
            as a dict: arm, peak lr, momentum or betas...), or ``None``.
    """

    base: str
    real: str
    directions: tuple[PairedDirection, ...]
    hidden_names: tuple[str, ...]
    multiplier: float
    shadow: dict[str, Any] | None = None
    SCHEMA_VERSION: ClassVar[int] = PAIRED_SCHEMA_VERSION
    WHAT: ClassVar[str] = "paired-directions"
    JSON_KEYS: ClassVar[tuple] = ("schema_version", "base", "real", "multiplier", "hidden_names", "shadow", ...)

    def get(self, name: str) -> PairedDirection:
        for d in self.directions:
            if d.name == name:
                return d
        raise CurvlabError(f"no direction {name!r} here (have {', '.join(d.name for d in self.directions)})")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.directions)

    def scalars(self) -> dict[str, float]:
        """``paired_{nds,cos,q}_{direction}_{scope}`` for every direction and scope (the keys of
        :class:`curvlab.curvature.scalars.CheckpointScalars`), plus ``paired_norm_...``, and on the hidden scope
        the optimal step's decreases, ``paired_optpred_{direction}_hidden`` and ``paired_optreal_...``
        (:class:`PairedCurvature`), only where measured: a direction without a quadratic optimum (NDS <= 0), or
        a report from before they were, has neither (no NaN in a window's mean); nor has a scope a direction was
        not measured on (:func:`measure_hidden`'s ``all``, whose norm is NaN where a measured one never is)."""
        keys = {"nds": "nds", "cos": "cosine", "q": "q", "norm": "update_norm"}
        out = {
            f"paired_{key}_{d.name}_{scope}": getattr(d.scope(scope), attribute)
            for d in self.directions
            for scope in SCOPES
            if not isnan(d.scope(scope).update_norm)
            for key, attribute in keys.items()
        }
        optimal = {"optpred": "optimal_predicted", "optreal": "optimal_realized"}
        for d in self.directions:
            for scope in SCOPES:
                if not isnan(gn := getattr(d.scope(scope), "nds_gauss_newton", nan)):
                    out[f"paired_ndsgn_{d.name}_{scope}"] = gn
            values = {key: getattr(d.hidden, attribute, nan) for key, attribute in optimal.items()}
            if not any(isnan(v) for v in values.values()):
                out |= {f"paired_{key}_{d.name}_hidden": v for key, v in values.items()}
        return out


# -- the directions from an optimizer's state ---------------------------------------------------


def parse_directions(text: str | Sequence[str]) -> tuple[str, ...]:
    """``"adamw,muon"`` (or a list) as a tuple of known direction names, in order, without repeats.

    Raises:
        CurvlabError: an empty list or an unknown name.
    """
    names = [n.strip() for n in (text.split(",") if isinstance(text, str) else text) if n.strip()]
    if not names:
        raise CurvlabError(f"no direction named; choose from {', '.join(DIRECTIONS)}")
    unknown = [n for n in names if n not in DIRECTIONS]
    if unknown:
        raise CurvlabError(f"unknown direction {unknown[0]!r}; choose from {', '.join(DIRECTIONS)}")
    return tuple(dict.fromkeys(names))


def _hidden_state(optimizer: torch.optim.Optimizer, params: Mapping[str, Tensor], hidden: Sequence[str]):
    """(base, {name: (group, state)}) of the hidden matrices: the Adam or Muon state each is in."""
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    found, kinds = {}, set()
    for name in hidden:
        p = params[name]
        group = group_of.get(id(p))
        if group is None:
            raise CurvlabError(f"the optimizer doesn't hold the hidden matrix {name!r}")
        if "ns_steps" in group and "momentum" in group:
            kinds.add("muon")
        elif "amsgrad" in group and "betas" in group:
            if group["amsgrad"]:
                raise CurvlabError("directions from an AMSGrad state are not supported (its v is a running max)")
            kinds.add("adam")
        else:
            raise CurvlabError(
                f"{type(optimizer).__name__} keeps neither an Adam nor a Muon state on {name!r}: "
                "counterfactual directions need one of them"
            )
        found[name] = (group, optimizer.state.get(p, {}))
    if len(kinds) != 1:
        raise CurvlabError("the hidden matrices are under both Adam and Muon: no single base state")
    return kinds.pop(), found


def schedule_multiplier(group: Mapping[str, Any]) -> float:
    """The current lr over the peak lr of a param group (``initial_lr``, which torch's schedulers
    record; 1 without a scheduler)."""
    initial = group.get("initial_lr")
    return float(group["lr"]) / float(initial) if initial else 1.0


@dataclass(frozen=True)
class Direction:
    """A direction over all (trainable) parameters, with how it was formed."""

    name: str
    z: dict[str, Tensor]
    source: str
    scaling: str


def counterfactual_directions(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    G: Mapping[str, Tensor],
    Z: Mapping[str, Tensor],
    names: Sequence[str],
    *,
    shadow: ShadowState | None = None,
    controls: Mapping[str, ShadowState] | None = None,
) -> tuple[str, float, list[Direction]]:
    r"""The directions ``names`` at the model's current W (see the module docstring), from the
    optimizer's state on the hidden matrices after the next gradient G, and the shadow's; then one
    direction per control shadow (``controls``: the run's twins, :func:`curvlab.steps.shadow.build_controls`),
    named by its key, at its own peak lr times the schedule multiplier.

    Args:
        G: the next step's gradient (clipped, as the optimizer sees it) and Z: the real next step,
            both from :func:`~curvlab.steps.update.next_update`.
        shadow: the run's shadow state, if it has one (the exact other arm).
        controls: shadow states of the run's own arm, by name (``twin``, ``hp_twin``).

    Returns:
        ``(base, multiplier, directions)``: ``"adam"`` or ``"muon"``, the schedule multiplier, and the
        directions in the order of ``names``, each over Z's parameters, in the parameters' dtype.

    Raises:
        CurvlabError: an unknown name, a state that is neither Adam nor Muon, ``adamw`` asked of a Muon
            state without a shadow Adam, or a direction that is zero on the hidden matrices.
    """
    names = parse_directions(names)
    params = {n: p for n, p in model.named_parameters() if n in Z}
    hidden = hidden_matrices(params, model=model)
    if not hidden:
        raise CurvlabError("the model has no hidden matrices: the directions differ only there")
    base, held = _hidden_state(optimizer, params, hidden)
    multiplier = schedule_multiplier(next(iter(held.values()))[0])
    W = {n: params[n].detach() for n in hidden}
    Gh = {n: G[n].to(device=W[n].device, dtype=W[n].dtype) for n in hidden}
    first = _first_moments(base, held, Gh)
    real_norm = param_dicts.norm(Z, hidden)
    shapes = matrix_shapes(model)

    def whole(on_hidden: Mapping[str, Tensor]) -> dict[str, Tensor]:  # the real step Z off the hidden matrices
        return {n: on_hidden.get(n, t).to(params[n].dtype) for n, t in Z.items()}

    out = []
    for name in names:
        if name == BASES[base]:
            out.append(Direction(name, whole({}), "real step", "lr"))
        elif name in PAIRED:  # the other arm
            on_hidden, source = _other_arm(name, base, first, W, Gh, shapes, multiplier, shadow)
            out.append(Direction(name, whole(on_hidden), source, "lr"))
        else:
            on_hidden = {n: first[n] if name == "sgd" else torch.sign(first[n]) for n in hidden}
            norm = param_dicts.norm(on_hidden)
            if norm == 0.0:
                raise CurvlabError(f"the {name} direction is zero on the hidden matrices")
            moment = "Adam's first moment m" if base == "adam" else "Muon's momentum buffer B"
            source = f"{moment}{'' if name == 'sgd' else ', its sign'}, scaled to the real step's hidden norm"
            out.append(Direction(name, whole(param_dicts.scale(on_hidden, real_norm / norm)), source, "matched"))
    for name, control in (controls or {}).items():
        if set(control.names) != set(W):
            raise CurvlabError(f"the {name} shadow covers other matrices than the model's hidden ones")
        on_hidden = control.direction(Gh, W, multiplier)
        out.append(Direction(name, whole(on_hidden), f"{name} shadow ({control.settings.kind})", "lr"))
    return base, multiplier, out


def _first_moments(base: str, held, G: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Adam's m or Muon's B after absorbing G, as the optimizer's own step would (zeros before any step)."""
    out = {}
    for n, (group, state) in held.items():
        key, beta = ("exp_avg", group["betas"][0]) if base == "adam" else ("momentum_buffer", group["momentum"])
        m = state.get(key)
        m = torch.zeros_like(G[n]) if m is None else m.to(device=G[n].device, dtype=G[n].dtype)
        out[n] = m.lerp(G[n], 1 - beta)
    return out


def _other_arm(name, base, first, W, G, shapes, multiplier, shadow):
    """The other arm's step on the hidden matrices: the shadow's, or (muon from an Adam state) the approximation."""
    if shadow is not None and shadow.settings.kind == name:
        if set(shadow.names) != set(W):
            raise CurvlabError("the shadow state covers other matrices than the model's hidden ones")
        return shadow.direction(G, W, multiplier), f"shadow {name} state"
    if name == "adamw":
        raise CurvlabError(
            "adamw needs Adam's second moment, which a Muon state doesn't hold: this checkpoint carries no "
            "shadow Adam state (train with shadow on)"
        )
    settings = ShadowSettings.for_kind("muon")
    lr = settings.lr * multiplier
    return {n: muon_step(first[n], shapes[n], settings, lr) for n in W}, APPROXIMATE_MUON


# -- measuring them at one point ----------------------------------------------------------------


def measure_directions(
    point: CurvaturePoint,
    directions: Sequence[Direction],
    hidden: Sequence[str],
    *,
    optimal: bool = False,
    gauss_newton: bool = False,
) -> tuple[PairedDirection, ...]:
    r"""Every direction over both scopes at one point: each direction's curvature whole and restricted to
    ``hidden`` from the interactions of its two parts (:meth:`~curvlab.engine.hvp.CurvaturePoint.interactions`:
    two second backwards, the hidden matrices' on every parameter, then the rest's on the rest alone), and
    its first-order sums over both scopes from one float64 table. With ``optimal``, each direction's optimal
    step on the hidden scope too (:func:`_optimal_step`: one forward each, on the point's batch); with
    ``gauss_newton``, the Gauss–Newton part of each scope's NDS
    (:func:`~curvlab.curvature.gauss_newton.gauss_newton_at`).

    Raises:
        CurvlabError: a direction that doesn't match the point's parameters, is non-finite, or is zero
            on a scope.
    """
    if not directions:
        raise CurvlabError("no direction to measure")
    names, keep = list(point.params), set(hidden)
    unknown = [n for n in hidden if n not in point.params]
    if unknown or not hidden:
        raise CurvlabError(
            f"the hidden scope names unknown parameters: {param_dicts.names_text(unknown)}"
            if unknown
            else "no hidden matrices"
        )
    rest = [n for n in names if n not in keep]
    g = point.gradient
    gg = param_dicts.group_sums(
        param_dicts.dot_table([(g, g)], names)[:, 0], names, [names, hidden]
    ).tolist()  # (all, hidden)
    out = []
    for d in directions:
        full = {n: d.z[n] if n in d.z else torch.zeros_like(point.params[n]) for n in names}
        param_dicts.check_like(point.params, full, f"direction {d.name}")
        full = param_dicts.cast(full, point.dtype)
        # the hidden matrices first, their second backward on every parameter, then the rest's on the rest
        # alone, so that the hidden matrices' weight adjoints are taken once (as the Taylor split's scopes)
        parts = [{n: full[n] for n in hidden}] + ([{n: full[n] for n in rest}] if rest else [])
        R = point.interactions(parts)
        # <G, Z> and <Z, Z> over all parameters and over the hidden matrices
        sums = param_dicts.group_sums(
            param_dicts.dot_table([(g, full), (full, full)], names), names, [names, hidden]
        ).tolist()
        scopes = [
            PairedCurvature.of(gz, float(zhz), zz, gg_scope)
            for (gz, zz), zhz, gg_scope in zip(sums, (R.sum(), R[0, 0]), gg)
        ]
        if optimal:
            scopes[1] = _optimal_step(point, scopes[1], {n: full[n] for n in hidden})
        if gauss_newton:
            on_hidden = {n: full[n] if n in keep else torch.zeros_like(full[n]) for n in names}
            scopes = [
                replace(c, nds_gauss_newton=gauss_newton_at(point, part) / c.update_norm**2)
                for c, part in zip(scopes, (full, on_hidden))
            ]
        out.append(PairedDirection(d.name, d.source, d.scaling, *scopes))
    return tuple(out)


def _optimal_step(point: CurvaturePoint, hidden: PairedCurvature, z: Mapping[str, Tensor]) -> PairedCurvature:
    r"""``hidden`` (Z's record on the hidden matrices, ``z`` there) with the quadratic model's optimal step:
    :math:`\eta^* = \langle G_h, Z_h\rangle / \langle Z_h, HZ_h\rangle`, the predicted decrease
    :math:`\eta^*\langle G_h, Z_h\rangle - \tfrac{\eta^{*2}}{2}\langle Z_h, HZ_h\rangle = \tfrac12 \|G_h\|^2 q`, and
    the realized one, :math:`L(W) - L(W - \eta^* Z_h)` on the point's batches, as the Taylor split evaluates
    its own (:meth:`~curvlab.engine.hvp.CurvaturePoint.loss_at`). Left NaN where
    :math:`\langle Z_h, HZ_h\rangle \le 0`: the model has no optimum along Z, and no forward is spent. Where the
    loss at :math:`W - \eta^* Z_h` is not finite (a tiny positive curvature, a huge step), the realized decrease
    is -inf rather than a failed analysis."""
    gz, zhz = hidden.first_order, 2.0 * hidden.curvature_penalty
    if not zhz > 0:
        return hidden
    eta = gz / zhz
    stepped = {n: w - eta * z[n] if n in z else w for n, w in point.params.items()}
    try:
        realized = point.loss - point.loss_at(stepped)
    except CurvlabError as e:
        if NOT_FINITE not in str(e):
            raise
        realized = -inf
    return replace(hidden, optimal_predicted=0.5 * gz * gz / zhz, optimal_realized=realized)


def measure_hidden(
    point: CurvaturePoint, directions: Sequence[Direction], hidden: Sequence[str]
) -> tuple[PairedDirection, ...]:
    """Every direction on the hidden matrices alone (its ``all`` scope NaN), by one batched HVP over the
    stacked directions: a control's direction, which the aggregates read there only, at a fraction of
    :func:`measure_directions`' two second backwards a direction.

    Raises:
        CurvlabError: a direction that doesn't match the point's parameters, or is zero on the hidden matrices.
    """
    rows = []
    for d in directions:
        row = {n: d.z[n] if n in hidden else torch.zeros_like(p) for n, p in point.params.items()}
        param_dicts.check_like(point.params, row, f"direction {d.name}")
        rows.append(row)
    stacked = {n: torch.stack([r[n].to(point.dtype) for r in rows]) for n in point.params}
    gz, zhz = point.quadratic_forms(stacked)
    zz = param_dicts.stacked_dot(stacked, stacked, list(point.params))
    gg = param_dicts.dot(point.gradient, point.gradient, hidden)
    if zero := [d.name for k, d in enumerate(directions) if not zz[k] > 0]:
        raise CurvlabError(f"the direction {zero[0]} is zero on the hidden matrices")
    nan_scope = PairedCurvature(*(nan,) * 8)
    return tuple(
        PairedDirection(
            d.name, d.source, d.scaling, nan_scope, PairedCurvature.of(float(gz[k]), float(zhz[k]), float(zz[k]), gg)
        )
        for k, d in enumerate(directions)
    )


def measured_directions(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn,
    params: Mapping[str, Tensor],
    batch: Any,
    G: Mapping[str, Tensor],
    Z: Mapping[str, Tensor],
    *,
    names: Sequence[str] = PAIRED,
    shadow: ShadowState | None = None,
    controls: Mapping[str, ShadowState] | None = None,
    extra: Sequence[Direction] = (),
    hidden_only: Sequence[str] = (),
    method: str = DEFAULT_METHOD,
    dtype: torch.dtype | None = None,
    gauss_newton: bool = False,
) -> tuple[PairedDirections, list[Direction]]:
    """The directions ``names`` and one per control shadow (:func:`counterfactual_directions`), then ``extra``
    (directions made elsewhere: the exchangeable twins), measured at ``params`` on ``batch``
    (:func:`measure_directions`, with the two arms' optimal steps on the hidden matrices), over all parameters
    and the hidden matrices, but those named in ``hidden_only`` on the hidden matrices alone
    (:func:`measure_hidden`): the record, and the directions of ``names`` and the controls (for measures
    beyond this point's H); with ``gauss_newton``, the two arms' Gauss–Newton parts too."""
    base, multiplier, directions = counterfactual_directions(
        model, optimizer, G, Z, names, shadow=shadow, controls=controls
    )
    hidden = hidden_matrices({n: params[n] for n in params}, model=model)
    every = [*directions, *extra]
    with CurvaturePoint(loss_fn, params, batch, method=method, dtype=dtype) as point:
        arms = [d for d in every if d.name in PAIRED]
        arms = measure_directions(point, arms, hidden, optimal=True, gauss_newton=gauss_newton)
        rest = [d for d in every if d.name not in PAIRED and d.name not in hidden_only]
        others = measure_directions(point, rest, hidden) if rest else ()
        controls_only = [d for d in every if d.name not in PAIRED and d.name in hidden_only]
        others += measure_hidden(point, controls_only, hidden) if controls_only else ()
    by_name = {d.name: d for d in (*arms, *others)}
    measured = tuple(by_name[d.name] for d in every)
    used = shadow is not None and any(d.source.startswith("shadow") for d in directions)
    paired = PairedDirections(
        base, BASES[base], measured, tuple(hidden), multiplier, shadow.settings.to_dict() if used else None
    )
    return paired, directions


# -- between runs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class DirectionLandscape(Record):
    r"""The split of a between-run NDS ratio into direction and landscape terms (module docstring):
    ``between = direction_at_adamw * landscape_along_muon = direction_at_muon * landscape_along_adamw``.

    Attributes:
        between: :math:`N_\text{adamw}(W_a) / N_\text{muon}(W_b)`.
        direction_at_adamw: :math:`N_\text{adamw}(W_a) / N_\text{muon}(W_a)`, at the AdamW checkpoint.
        direction_at_muon: :math:`N_\text{adamw}(W_b) / N_\text{muon}(W_b)`, at the Muon checkpoint.
        landscape_along_muon: :math:`N_\text{muon}(W_a) / N_\text{muon}(W_b)`.
        landscape_along_adamw: :math:`N_\text{adamw}(W_a) / N_\text{adamw}(W_b)`.
        sign_agreement: whether the four NDS values have one sign (else the ratios mix signs: read them
            with the values, never through a log).
    """

    between: float
    direction_at_adamw: float
    direction_at_muon: float
    landscape_along_muon: float
    landscape_along_adamw: float
    sign_agreement: bool

    @classmethod
    def of(cls, adamw_at_a: float, muon_at_a: float, adamw_at_b: float, muon_at_b: float) -> DirectionLandscape:
        """From the four paired NDS values (a: the AdamW checkpoint, b: the Muon one)."""

        def ratio(x: float, y: float) -> float:
            return x / y if y != 0 else float("nan")

        values = (adamw_at_a, muon_at_a, adamw_at_b, muon_at_b)
        return cls(
            between=ratio(adamw_at_a, muon_at_b),
            direction_at_adamw=ratio(adamw_at_a, muon_at_a),
            direction_at_muon=ratio(adamw_at_b, muon_at_b),
            landscape_along_muon=ratio(muon_at_a, muon_at_b),
            landscape_along_adamw=ratio(adamw_at_a, adamw_at_b),
            sign_agreement=all(v > 0 for v in values) or all(v < 0 for v in values),
        )
