"""The quadratic model's study (``curvlab quadratic``, the reproduction's quadratic stage): the theorem's
worked example under line search and fixed learning rates, and the phase sweep over (ρ, α, σ_H/σ_L), as one
typed record (:class:`QuadraticStudy`, JSON ``QUADRATIC_SCHEMA_VERSION``). The model itself, its
optimizers and the theorem's closed forms are :mod:`curvlab.theory.quadratic_model`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from curvlab.errors import CurvlabError
from curvlab.theory import quadratic_model as qm
from curvlab.util import schema
from curvlab.util.codec import Record, decode, encode, meta


@dataclass(frozen=True, eq=False)
class PhaseSweep(Record):
    """:func:`phase_sweep`'s grid: the axes ρ = w_H/w_L (``rhos``), α = m/q (``alphas``) and σ_H/σ_L
    (``ratios``), the steps T and the size q of every point, and per point (arrays shaped
    ``(len(ratios), len(alphas), len(rhos))``): whether Muon's suboptimality after T steps is below GD's
    (``muon_wins``), below or equal at every step 1..T (``muon_below_every_step``), whether
    :func:`~curvlab.theory.quadratic_model.theorem_condition` holds (``condition``), and log10 of Muon's over GD's
    suboptimality after T steps (``log10_suboptimality_ratio``)."""

    rhos: tuple[float, ...]
    alphas: tuple[float, ...]
    ratios: tuple[float, ...]
    steps: int
    q: int
    muon_wins: np.ndarray = field(metadata=meta(dtype=bool))
    muon_below_every_step: np.ndarray = field(metadata=meta(dtype=bool))
    condition: np.ndarray = field(metadata=meta(dtype=bool))
    log10_suboptimality_ratio: np.ndarray = field(metadata=meta(dtype=float))  # (a null, non-finite: NaN)

    ARRAYS: ClassVar[tuple[str, ...]] = ("muon_wins", "muon_below_every_step", "condition", "log10_suboptimality_ratio")

    def __post_init__(self) -> None:
        shape = (len(self.ratios), len(self.alphas), len(self.rhos))
        for k in self.ARRAYS:
            if getattr(self, k).shape != shape:
                raise CurvlabError(f"phase sweep {k} has shape {getattr(self, k).shape}, its axes {shape}")

    def __eq__(self, other: object) -> bool:
        # arrays compare by value (dataclass equality would ask an array for its truth value)
        if not isinstance(other, PhaseSweep):
            return NotImplemented
        same = (self.rhos, self.alphas, self.ratios, self.steps, self.q)
        return same == (other.rhos, other.alphas, other.ratios, other.steps, other.q) and all(
            np.array_equal(getattr(self, k), getattr(other, k), equal_nan=True) for k in self.ARRAYS
        )

    __hash__ = None  # arrays are not hashable


def phase_sweep(rhos, alphas, ratios, steps: int = 20, q: int = 100) -> PhaseSweep:
    """Where Muon ends below GD after ``steps`` line-search steps, on the scalar model, over a grid of
    ρ = w_H/w_L, α = m/q and σ_H/σ_L; with the theorem's condition at each point.

    Returns the axes and boolean/float arrays shaped ``(len(ratios), len(alphas), len(rhos))``.
    """
    shape = (len(ratios), len(alphas), len(rhos))
    muon_wins, always, condition = (np.zeros(shape, dtype=bool) for _ in range(3))
    log_ratio = np.zeros(shape)
    for a, b, c in np.ndindex(shape):
        m = max(1, round(alphas[b] * q))
        spec = qm.TwoLevelSpec(d1=q, d2=q, q=q, m=m, w_H=float(rhos[c]), w_L=1.0, sigma_H=float(ratios[a]), sigma_L=1.0)
        best = qm.optimal_loss(spec)
        muon = np.array(qm.scalar_two_level(spec, "muon", steps).loss) - best
        gd = np.array(qm.scalar_two_level(spec, "gd", steps).loss) - best
        floor = 1e-12 * gd[0]  # an exactly solved problem counts as solved to 1e-12
        muon, gd = np.maximum(muon, floor), np.maximum(gd, floor)
        k = min(len(muon), len(gd))
        muon_wins[a, b, c] = muon[k - 1] < gd[k - 1]
        always[a, b, c] = bool(np.all(muon[1:k] <= gd[1:k] * (1 + 1e-9)))
        condition[a, b, c] = qm.theorem_condition(spec)
        log_ratio[a, b, c] = math.log10(muon[k - 1] / gd[k - 1])
    axes = [tuple(map(float, x)) for x in (rhos, alphas, ratios)]
    return PhaseSweep(*axes, steps, q, muon_wins, always, condition, log_ratio)


QUADRATIC_SCHEMA_VERSION = 1  # the record of quadratic_study (``quadratic.json``)
DEFAULT_EXAMPLE = qm.TwoLevelSpec()
SWEEP_RHOS = tuple(float(x) for x in np.logspace(0, 3, 13))
SWEEP_ALPHAS = tuple(float(x) for x in np.linspace(0.02, 0.48, 12))
SWEEP_RATIOS = (1.0, 2.0, 4.0)


@dataclass(frozen=True)
class ClosedForms(Record):
    """The theorem's closed forms on one :class:`~curvlab.theory.quadratic_model.TwoLevelSpec` (docs/science.md
    section 7), each by its function in :mod:`curvlab.theory.quadratic_model`: the optimal loss, Muon's NDS, its
    contraction Γ², GD's two-step contraction C(P_0) C(1 - P_0), P_0, and the theorem's condition."""

    optimal_loss: float
    muon_nds: float
    muon_contraction: float
    gd_two_step_contraction: float
    gd_initial_share: float
    theorem_condition: bool

    @classmethod
    def of(cls, spec: qm.TwoLevelSpec) -> ClosedForms:
        P0 = qm.gd_initial_share(spec)
        two_step = qm.gd_contraction(spec, P0) * qm.gd_contraction(spec, 1 - P0)
        return cls(
            qm.optimal_loss(spec),
            qm.muon_nds(spec),
            qm.muon_contraction(spec),
            two_step,
            P0,
            qm.theorem_condition(spec),
        )


EXAMPLE = ("closed_forms", "line_search", "fixed_lr")  # QuadraticStudy's fields under "example", after the spec


@dataclass(frozen=True)
class QuadraticStudy:
    """``quadratic.json`` (``QUADRATIC_SCHEMA_VERSION``): :func:`quadratic_study`'s worked example on
    ``spec`` (its closed forms, and the trajectories by method name: ``line_search`` for GD and Muon
    with each polar factor, ``fixed_lr`` for ``"<method>-fixed-lr"`` at its best learning rate) and the
    phase sweep.

    JSON form: ``{"schema_version", "example": {"spec", "title", "closed_forms", "line_search",
    "fixed_lr"}, "sweep"}``; ``title`` is derived from ``spec`` and not read back."""

    spec: qm.TwoLevelSpec
    closed_forms: ClosedForms
    line_search: dict[str, qm.Trajectory]
    fixed_lr: dict[str, qm.Trajectory]
    sweep: PhaseSweep
    SCHEMA_VERSION: ClassVar[int] = QUADRATIC_SCHEMA_VERSION
    WHAT: ClassVar[str] = "quadratic study"

    @property
    def title(self) -> str:
        spec = self.spec
        return (
            f"q={spec.q}, m={spec.m}, w_H={spec.w_H:g}, w_L={spec.w_L:g}, "
            f"σ_H={spec.sigma_H:g}, σ_L={spec.sigma_L:g} (d={spec.d1}x{spec.d2})"
        )

    @property
    def trajectories(self) -> dict[str, qm.Trajectory]:
        """Every trajectory by name, the line-search ones first."""
        return {**self.line_search, **self.fixed_lr}

    # by hand: the JSON nests the worked example's fields, and its derived title, under "example" (the
    # fields themselves by the codec)
    def to_dict(self) -> dict[str, Any]:
        d = encode(self)
        example = {"spec": d.pop("spec"), "title": self.title, **{k: d.pop(k) for k in EXAMPLE}}
        return {"schema_version": d["schema_version"], "example": example, "sweep": d["sweep"]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuadraticStudy:
        schema.check(d, cls)
        example = d["example"]
        if not isinstance(example, Mapping):
            raise TypeError("example: expected an object")
        known = {"schema_version": d["schema_version"], "spec": example["spec"], "sweep": d["sweep"]}
        return decode(cls, known | {k: example[k] for k in EXAMPLE})

    @classmethod
    def load(cls, path: str | Path) -> QuadraticStudy:
        return schema.load(path, cls)


def quadratic_study(
    spec: qm.TwoLevelSpec = DEFAULT_EXAMPLE,
    steps: int = 30,
    fixed_lr_steps: int = 60,
    lr_grid: tuple[float, ...] = (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1),
    rhos: tuple[float, ...] = SWEEP_RHOS,
    alphas: tuple[float, ...] = SWEEP_ALPHAS,
    ratios: tuple[float, ...] = SWEEP_RATIOS,
    sweep_steps: int = 20,
    outside_theorem: bool = False,
) -> QuadraticStudy:
    """The theorem's worked example (line search: GD, Muon with the exact, Newton–Schulz and Polar
    Express polar factors; fixed learning rates: GD and Muon with momentum, Adam, sign descent, each at
    its best lr of ``lr_grid``), and the phase sweep over (ρ, α, σ_H/σ_L), as a :class:`QuadraticStudy`
    (:func:`curvlab.output.files.write_quadratic` writes it)."""
    problem = qm.two_level(spec, outside_theorem)
    line = {"gd": qm.run_line_search(problem, "gd", steps)}
    for polar in ("svd", "newton_schulz", "polar_express"):
        traj = qm.run_line_search(problem, "muon", steps, polar=polar)
        line[traj.method] = traj
    fixed = {
        f"{method}-fixed-lr": qm.best_fixed_lr(problem, method, lr_grid, fixed_lr_steps)
        for method in ("gd", "muon", "adam", "sign")
    }
    return QuadraticStudy(spec, ClosedForms.of(spec), line, fixed, phase_sweep(rhos, alphas, ratios, steps=sweep_steps))
