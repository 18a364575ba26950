r"""Shadow optimizer states: the other arm's state, kept beside a run and never applied.

A reproduction run of one arm (AdamW or Muon) can carry a *shadow* of the other arm on the hidden
matrices (:func:`~curvlab.curvature.groupings.hidden_matrices`). Each training step, after clipping, the
shadow absorbs the same gradient G the real optimizer sees; it is checkpointed with the run, and never
touches the parameters, the gradients, the real optimizer or any RNG, so a run with a shadow is the run
without one, bit for bit.

At a checkpoint, the shadow's step on the next gradient G gives the other arm's direction at the same
W (:mod:`curvlab.analysis.directions`):

* **shadow Muon** (in an AdamW run), per hidden matrix W of shape r x c, as :class:`curvlab.optim.muon.Muon`:

  .. math::
      B \leftarrow \mu B + (1-\mu) G,\quad \tilde B = (1-\mu) G + \mu B \text{ (Nesterov)},\quad
      Z = \eta\lambda W + \eta\, s(r, c)\, \operatorname{msign}(\tilde B)

  with Newton–Schulz (5 steps, bf16, Keller Jordan's quintic), :math:`s = \max(1, r/c)^{1/2}`;
* **shadow Adam** (in a Muon run), as ``torch.optim.AdamW`` does it, with a per-matrix step count t:

  .. math::
      m \leftarrow \beta_1 m + (1-\beta_1) G,\quad v \leftarrow \beta_2 v + (1-\beta_2) G^2,\quad
      Z = \eta\lambda W + \eta\, \hat m / (\sqrt{\hat v} + \epsilon),\quad
      \hat m = m / (1-\beta_1^t),\ \sqrt{\hat v} = \sqrt{v} / (1-\beta_2^t)^{1/2}.

**Controls** (:func:`build_controls`, docs/science.md section 14): shadows of the run's *own* arm, from
step 0: a *twin* with the run's own settings (:func:`own_settings`), whose step must be the real step to
float rounding, and a *hyperparameter twin* with one nudge (:func:`hyperparameter_twin`).

The learning rate :math:`\eta` of a shadow step is a peak lr (``ShadowSettings.lr``: by default the
other arm's default, :data:`DEFAULT_LR`) times the run's current schedule multiplier. NDS and the cosine
on the hidden matrices don't depend on it; ||Z|| does, and so does everything over all parameters.

Checkpoint payload ``"shadow"`` (``SHADOW_SCHEMA_VERSION`` = 1)::

    schema_version, settings{kind, lr, weight_decay, and for muon: momentum, nesterov, ns_steps,
    ns_coefficients, ns_eps, polar, polar_dtype, scale; for adamw: betas, eps}, names[], shapes{name: [rows, cols]},
    state{name: {momentum_buffer} or {exp_avg, exp_avg_sq, step}}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from curvlab.curvature.groupings import hidden_matrices
from curvlab.errors import CurvlabError
from curvlab.models.roles import matrix_shapes
from curvlab.optim.muon import SCALES, as_matrices, muon_scale
from curvlab.optim.polar import NEWTON_SCHULZ_COEFFICIENTS, POLAR_METHODS, msign
from curvlab.util import schema

SHADOW_SCHEMA_VERSION = 1
SHADOW_OF = {"adamw": "muon", "muon": "adamw"}  # the run's optimizer -> the arm its shadow keeps
_MUON_FIELDS = ("lr", "weight_decay", "momentum", "nesterov", "ns_steps", "ns_coefficients", "ns_eps")
_MUON_FIELDS += ("polar", "polar_dtype", "scale")
_ADAM_FIELDS = ("lr", "weight_decay", "betas", "eps")
# the arms' defaults in curvlab.optim.model_optimizer.build_model_optimizer
DEFAULT_LR = {"muon": 0.02, "adamw": 0.0018}


@dataclass(frozen=True)
class ShadowSettings:
    """The shadow arm's hyperparameters. ``kind`` is ``"muon"`` or ``"adamw"``; the fields of the other kind
    are unused."""

    kind: str
    lr: float
    weight_decay: float = 0.0
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = NEWTON_SCHULZ_COEFFICIENTS
    ns_eps: float = 1e-7
    polar: str = "newton_schulz"
    polar_dtype: str = "bfloat16"
    scale: str = "original"
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8

    @classmethod
    def for_kind(cls, kind: str, **options: Any) -> ShadowSettings:
        """The settings of a shadow ``kind`` with ``options`` over its defaults.

        Raises:
            CurvlabError: an unknown kind, an option of the other kind, or a bad value.
        """
        if kind not in DEFAULT_LR:
            raise CurvlabError(f"unknown shadow kind {kind!r}; choose muon or adamw")
        allowed = _MUON_FIELDS if kind == "muon" else _ADAM_FIELDS
        unknown = sorted(set(options) - set(allowed))
        if unknown:
            raise CurvlabError(f"unknown shadow option(s) for {kind}: {', '.join(unknown)}")
        options = dict(options)
        for k in ("ns_coefficients", "betas"):
            if k in options:
                options[k] = tuple(options[k])
        if "polar_dtype" in options:
            options["polar_dtype"] = str(options["polar_dtype"]).removeprefix("torch.")
        settings = cls(kind=kind, **{"lr": DEFAULT_LR[kind], **options})
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.lr < 0 or self.weight_decay < 0:
            raise CurvlabError(f"shadow lr and weight_decay must be >= 0, got {self.lr}, {self.weight_decay}")
        if self.kind == "muon":
            if self.polar not in POLAR_METHODS:
                raise CurvlabError(
                    f"unknown shadow polar method {self.polar!r}; choose one of {', '.join(POLAR_METHODS)}"
                )
            if self.scale not in SCALES:
                raise CurvlabError(f"unknown shadow Muon scale {self.scale!r}; choose one of {', '.join(SCALES)}")
            if not isinstance(getattr(torch, self.polar_dtype, None), torch.dtype):
                raise CurvlabError(f"unknown shadow polar dtype {self.polar_dtype!r}")
            if not 0 <= self.momentum < 1:
                raise CurvlabError(f"shadow momentum must lie in [0, 1), got {self.momentum}")
        elif not all(0 <= b < 1 for b in self.betas):
            raise CurvlabError(f"shadow betas must lie in [0, 1), got {self.betas}")

    # by hand: the JSON holds only the fields of its kind, and reading it validates them (for_kind)
    def to_dict(self) -> dict[str, Any]:
        """``kind`` and the fields of that kind (tuples as lists)."""
        d = asdict(self)
        own = _MUON_FIELDS if self.kind == "muon" else _ADAM_FIELDS
        return {"kind": self.kind, **{k: list(d[k]) if isinstance(d[k], tuple) else d[k] for k in own}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ShadowSettings:
        return cls.for_kind(d["kind"], **{k: v for k, v in d.items() if k != "kind"})


class ShadowState:
    """The shadow arm's per-matrix state over named hidden matrices (see the module docstring).

    Args:
        settings: the shadow arm and its hyperparameters.
        shapes: ``{name: (rows, cols)}``, the mathematical (out, in) shape of each matrix (Muon's scale
            reads it; :func:`curvlab.models.roles.matrix_shapes`).
    """

    SCHEMA_VERSION: ClassVar[int] = SHADOW_SCHEMA_VERSION  # of the checkpoint payload (state_dict)
    WHAT: ClassVar[str] = "shadow state"

    def __init__(self, settings: ShadowSettings, shapes: Mapping[str, tuple[int, int]]):
        settings.validate()
        if not shapes:
            raise CurvlabError("a shadow state needs at least one hidden matrix")
        self.settings = settings
        self.shapes = {n: tuple(int(k) for k in s) for n, s in shapes.items()}
        self.state: dict[str, dict[str, Tensor]] = {}

    @property
    def names(self) -> list[str]:
        return list(self.shapes)

    # -- one training step ---------------------------------------------------------------------

    @torch.no_grad()
    def update(self, grads: Mapping[str, Tensor | None]) -> None:
        """Absorb one step's gradients (``None`` or a missing name: skipped, as torch's optimizers skip
        a parameter without a gradient)."""
        for name in self.names:
            g = grads.get(name)
            if g is not None:
                self._absorb(self.state.setdefault(name, {}), g)

    def update_from(self, model: nn.Module) -> None:
        """:meth:`update` with the ``.grad`` of the model's parameters (after clipping, as the real
        optimizer sees them)."""
        params = dict(model.named_parameters())
        self.update({n: params[n].grad for n in self.names})

    def _absorb(self, state: dict[str, Tensor], g: Tensor) -> None:
        """One step of the shadow's state, in place, with the very ops the real optimizer uses (bit for bit)."""
        s = self.settings
        if s.kind == "muon":
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g, memory_format=torch.preserve_format)
            state["momentum_buffer"].lerp_(g, 1 - s.momentum)
            return
        if "exp_avg" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)  # (torch's AdamW keeps it on the CPU)
            state["exp_avg"] = torch.zeros_like(g, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(g, memory_format=torch.preserve_format)
        beta1, beta2 = s.betas
        state["step"] += 1
        state["exp_avg"].lerp_(g, 1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(g, g.conj(), value=1 - beta2)

    # -- the shadow's step at a point ---------------------------------------------------------

    @torch.no_grad()
    def direction(
        self, grads: Mapping[str, Tensor], params: Mapping[str, Tensor], multiplier: float = 1.0
    ) -> dict[str, Tensor]:
        r"""The shadow's next step :math:`Z = W - W_\text{next}` on the hidden matrices, had it absorbed
        ``grads`` and stepped with lr ``settings.lr * multiplier`` (the state is left as it was).

        Raises:
            CurvlabError: a hidden matrix missing from ``grads`` or ``params``.
        """
        missing = [n for n in self.names if n not in grads or n not in params]
        if missing:
            raise CurvlabError(f"the shadow's matrices {missing[:3]} have no gradient or parameter here")
        s, lr = self.settings, self.settings.lr * multiplier
        out = {}
        for name in self.names:
            w = params[name]
            g = grads[name].to(device=w.device, dtype=w.dtype)
            state = {k: v.clone() for k, v in self.state.get(name, {}).items()}
            state = {k: v.to(w.device) if k != "step" else v for k, v in state.items()}
            self._absorb(state, g)
            if s.kind == "muon":
                buf = state["momentum_buffer"]
                step = muon_step(g.lerp(buf, s.momentum) if s.nesterov else buf, self.shapes[name], s, lr)
            else:
                beta1, beta2 = s.betas
                t = float(state["step"])
                denom = (state["exp_avg_sq"].sqrt() / (1 - beta2**t) ** 0.5).add_(s.eps)
                step = state["exp_avg"] / denom * (lr / (1 - beta1**t))
            out[name] = step + w * (lr * s.weight_decay) if s.weight_decay else step
        return out

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint payload (plain types and tensors: loadable with ``weights_only=True``)."""
        return {
            "schema_version": SHADOW_SCHEMA_VERSION,
            "settings": self.settings.to_dict(),
            "names": self.names,
            "shapes": {n: list(s) for n, s in self.shapes.items()},
            "state": {n: dict(s) for n, s in self.state.items()},
        }

    def load_state_dict(self, d: Mapping[str, Any]) -> None:
        """Put a saved state back (its tensors on the device of the tensors here, if any).

        Raises:
            CurvlabError: another schema version, another shadow arm or other settings, or other matrices.
        """
        schema.check(d, type(self))
        saved = ShadowSettings.from_dict(d["settings"])
        if saved != self.settings:
            raise CurvlabError(f"the saved shadow's settings {saved} differ from this run's {self.settings}")
        if list(d["names"]) != self.names:
            raise CurvlabError("the saved shadow covers other matrices than this run's hidden matrices")
        self.state = {n: {k: v.clone() for k, v in s.items()} for n, s in d["state"].items()}

    @classmethod
    def from_state_dict(cls, d: Mapping[str, Any]) -> ShadowState:
        """A shadow rebuilt from its checkpoint payload alone."""
        schema.check(d, cls)
        shadow = cls(ShadowSettings.from_dict(d["settings"]), {n: tuple(s) for n, s in d["shapes"].items()})
        shadow.load_state_dict(d)
        return shadow

    def to(self, device: torch.device | str) -> ShadowState:
        """Move the moments to ``device`` (Adam's step counts stay on the CPU, as torch keeps them)."""
        self.state = {
            n: {k: v.cpu() if k == "step" else v.to(device) for k, v in s.items()} for n, s in self.state.items()
        }
        return self


def muon_step(update: Tensor, shape: tuple[int, ...], settings: ShadowSettings, lr: float) -> Tensor:
    r""":math:`\eta\, s(r, c)\, \operatorname{msign}(U)` for a momentum-averaged update U of one matrix of
    mathematical shape ``shape`` (a stack of m matrices, shape (m, out, in), one by one), with the polar
    method and scale of ``settings``, as :class:`curvlab.optim.muon.Muon` computes it; in U's dtype."""
    ortho = msign(
        as_matrices(update, shape),
        polar=settings.polar,
        steps=settings.ns_steps,
        dtype=getattr(torch, settings.polar_dtype),
        coefficients=tuple(settings.ns_coefficients),
        eps=settings.ns_eps,
    ).to(update.dtype)
    return ortho.contiguous().view(update.shape) * (lr * muon_scale(shape, settings.scale))


def _hidden_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    names = hidden_matrices(params, model=model)
    if not names:
        raise CurvlabError("the model has no hidden matrices to keep a shadow state on")
    shapes = matrix_shapes(model)
    return {n: shapes[n] for n in names}


def build_shadow(optimizer: str, model: nn.Module, **options: Any) -> ShadowState:
    """The shadow of the other arm (:data:`SHADOW_OF`) for a run of ``optimizer`` over the model's hidden
    matrices, with ``options`` over the other arm's defaults (see :class:`ShadowSettings`).

    Raises:
        CurvlabError: an optimizer with no other arm, bad options, or a model with no hidden matrix.
    """
    if optimizer not in SHADOW_OF:
        raise CurvlabError(f"shadow states exist for the adamw and muon arms, not for {optimizer!r}")
    return ShadowState(ShadowSettings.for_kind(SHADOW_OF[optimizer], **options), _hidden_shapes(model))


# -- controls: shadows of the run's own arm -----------------------------------------------------------

# The hyperparameter twin's one change: small enough that the direction hardly moves, its spread is what
# "no difference" looks like on real curvature (docs/science.md section 14).
MOMENTUM_NUDGE = -0.01
BETA2_NUDGE = 0.001
CONTROLS = ("twin", "hp_twin")  # the control shadows a run keeps (``TrainConfig.controls``)


def own_settings(optimizer: torch.optim.Optimizer, model: nn.Module) -> ShadowSettings:
    """The run's own optimizer on its hidden matrices, as shadow settings (a *twin*): the param group that
    holds them, at its peak lr (``initial_lr``, which torch's schedulers record).

    Raises:
        CurvlabError: the hidden matrices lie in several groups, or in a group that is neither Muon nor
            a plain Adam (AMSGrad, maximize).
    """
    shapes = _hidden_shapes(model)
    params = dict(model.named_parameters())
    group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
    groups = {group_of.get(id(params[n])) for n in shapes}
    if len(groups) != 1 or None in groups:
        raise CurvlabError("the hidden matrices are not all in one param group of the optimizer: no single twin")
    g = optimizer.param_groups[groups.pop()]
    lr = float(g.get("initial_lr", g["lr"]))
    if "ns_steps" in g and "momentum" in g:
        dtype = g.get("polar_dtype", torch.bfloat16)
        return ShadowSettings.for_kind(
            "muon", lr=lr, weight_decay=g["weight_decay"], momentum=g["momentum"], nesterov=g["nesterov"],
            ns_steps=g["ns_steps"], ns_coefficients=g["ns_coefficients"], ns_eps=g["eps"],
            polar=g.get("polar", "newton_schulz"), polar_dtype=str(dtype), scale=g.get("scale", "original"),
        )  # fmt: skip
    if "betas" in g and not g.get("amsgrad") and not g.get("maximize"):
        return ShadowSettings.for_kind("adamw", lr=lr, weight_decay=g["weight_decay"], betas=g["betas"], eps=g["eps"])
    raise CurvlabError(f"{type(optimizer).__name__} keeps neither a Muon nor a plain Adam state: no twin")


def hyperparameter_twin(settings: ShadowSettings) -> ShadowSettings:
    """``settings`` with its one nudge (:data:`MOMENTUM_NUDGE` on Muon's momentum, :data:`BETA2_NUDGE` on
    Adam's beta2): the approximate null of the controls."""
    if settings.kind == "muon":
        return replace(settings, momentum=round(settings.momentum + MOMENTUM_NUDGE, 6))
    beta1, beta2 = settings.betas
    return replace(settings, betas=(beta1, round(beta2 + BETA2_NUDGE, 6)))


def build_controls(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, ShadowState]:
    """The control shadows of a run (:data:`CONTROLS`): its *twin* (its own arm with its own settings) and
    its *hyperparameter twin*, both from step 0, over the hidden matrices."""
    own = own_settings(optimizer, model)
    shapes = _hidden_shapes(model)
    return {"twin": ShadowState(own, shapes), "hp_twin": ShadowState(hyperparameter_twin(own), shapes)}
