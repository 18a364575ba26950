"""Learning-rate search on a log2 grid that grows while its best point sits at an edge.

Every grid point is trained with several seeds; the score of a point is the mean of its final
validation losses, with the standard error of that mean over seeds. The point with the lowest mean
wins. While the winner is the grid's lowest (or highest) point, the grid is extended by one more
halving (or doubling) and the new point is trained too, up to ``max_extensions`` times: a winner at
an edge says only that the optimum lies beyond it. A run that diverges scores +inf.

The choice is reported with its uncertainty: ``ties`` lists the other learning rates whose mean lies
within one combined standard error of the winner's (sqrt(se_best² + se_other²)); when there are
any, the data do not tell those learning rates apart, and the report says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from curvlab.errors import CurvlabError
from curvlab.inference.statistics import standard_error
from curvlab.util.codec import Record

TUNING_SCHEMA_VERSION = 1


def log2_grid(center: float, points: int) -> list[float]:
    """``points`` learning rates spaced by factors of 2 around ``center`` (``center`` among them;
    with an even count the extra point is on the low side)."""
    if points < 1 or center <= 0:
        raise CurvlabError(f"a log2 grid needs points >= 1 and center > 0, got {points} and {center}")
    low = -(points // 2)
    return [_round(center * 2.0**k) for k in range(low, low + points)]


def _round(lr: float) -> float:
    return float(f"{lr:.6g}")  # 0.004 * 2 ** -2 prints as 0.001, and is the same key when re-derived


@dataclass
class LrSearch:
    """The outcome of one learning-rate search (``tuning.json`` holds one per tuned learning rate)."""

    name: str  # e.g. "adamw.lr", "muon.adam_lr"
    grid: dict[float, list[float]]  # lr -> final validation loss per seed (+inf: diverged)
    chosen: float
    initial: list[float]
    extended: list[float] = field(default_factory=list)  # points added because the best sat at an edge
    at_edge: bool = False  # the winner still sits at an edge after the last allowed extension
    fixed: dict[str, float] = field(default_factory=dict)  # the other settings held fixed (e.g. a tied lr)
    seeds: list[int] = field(default_factory=list)  # the tuning seeds (disjoint from the measured ones)

    def mean(self, lr: float) -> float:
        return float(np.mean(self.grid[lr]))

    def stderr(self, lr: float) -> float:
        finite = [x for x in self.grid[lr] if math.isfinite(x)]
        return standard_error(finite) if len(finite) == len(self.grid[lr]) else float("nan")

    @property
    def ties(self) -> list[float]:
        """Learning rates whose mean is within one combined standard error of the winner's."""
        best, se_best = self.mean(self.chosen), self.stderr(self.chosen)
        others = [lr for lr in sorted(self.grid) if lr != self.chosen and math.isfinite(self.mean(lr))]
        return [lr for lr in others if self.mean(lr) - best <= math.sqrt(se_best**2 + self.stderr(lr) ** 2)]

    # by hand: the JSON keys the grid by each lr's %g text, in lr order (float keys are no JSON), with the
    # per-lr mean and standard error and the ties derived beside it
    def to_dict(self) -> dict:
        lrs = sorted(self.grid)
        return {
            "name": self.name,
            "grid": {f"{lr:g}": self.grid[lr] for lr in lrs},
            "mean": {f"{lr:g}": self.mean(lr) for lr in lrs},
            "stderr": {f"{lr:g}": self.stderr(lr) for lr in lrs},
            "chosen": self.chosen,
            "ties": self.ties,
            "initial": self.initial,
            "extended": self.extended,
            "at_edge": self.at_edge,
            "fixed": self.fixed,
            "seeds": self.seeds,
        }

    @classmethod
    def from_dict(cls, d: dict) -> LrSearch:
        # strict JSON writes a diverged run's +inf as null
        grid = {float(k): [math.inf if x is None else float(x) for x in v] for k, v in d["grid"].items()}
        kept = [d[k] for k in ("initial", "extended", "at_edge")]
        return cls(d["name"], grid, float(d["chosen"]), *kept, d.get("fixed", {}), list(d.get("seeds", [])))


def search_lr(
    objective: Callable[[float, int], float],
    grid: Sequence[float],
    seeds: Sequence[int],
    name: str = "lr",
    max_extensions: int = 3,
    fixed: dict[str, float] | None = None,
) -> LrSearch:
    """Minimize the mean over ``seeds`` of ``objective(lr, seed)`` (a final validation loss) over a
    log2 ``grid`` extended at its edges (module docstring).

    Raises:
        CurvlabError: a grid of fewer than 2 points or with points not spaced by factors of 2, or no seeds.
    """
    grid = sorted(_round(x) for x in grid)
    if len(grid) < 2 or not seeds:
        raise CurvlabError(
            f"{name}: a search needs at least 2 grid points and 1 seed, got {len(grid)} and {len(seeds)}"
        )
    if not np.allclose(np.diff(np.log2(grid)), 1.0, atol=1e-3):
        raise CurvlabError(f"{name}: the grid {grid} is not spaced by factors of 2")
    results: dict[float, list[float]] = {}

    def run(lr: float) -> None:
        values = [float(objective(lr, seed)) for seed in seeds]
        results[lr] = [v if math.isfinite(v) else math.inf for v in values]

    for lr in grid:
        run(lr)
    extended = []

    def best() -> float:
        return min(results, key=lambda lr: (np.mean(results[lr]), lr))

    for _ in range(max_extensions):
        lrs = sorted(results)
        b = best()
        if b == lrs[0]:
            new = _round(lrs[0] / 2)
        elif b == lrs[-1]:
            new = _round(lrs[-1] * 2)
        else:
            break
        run(new)
        extended.append(new)
    b, lrs = best(), sorted(results)
    return LrSearch(name, results, b, grid, extended, b in (lrs[0], lrs[-1]), dict(fixed or {}), list(seeds))


@dataclass(frozen=True)
class TuningSettings:
    """How a job tunes its learning rates (the same rule for every optimizer it compares): a
    ``grid_points``-point log2 grid around each centre, extended up to ``max_extensions`` times at an
    edge, ``tune_seeds`` seeds from ``tune_seed_base`` on (disjoint from the measured seeds), runs of
    ``horizon_steps`` steps (None in a preset: the compared horizon, its ``steps``; :meth:`at` sets it)."""

    lr_centers: dict[str, float]
    grid_points: int = 5
    tune_seeds: int = 2
    tune_seed_base: int = 1000
    horizon_steps: int | None = None
    max_extensions: int = 3

    def at(self, steps: int) -> TuningSettings:
        """These settings with an unset horizon set to ``steps``."""
        return self if self.horizon_steps is not None else replace(self, horizon_steps=steps)

    def seeds(self) -> list[int]:
        return [self.tune_seed_base + i for i in range(self.tune_seeds)]

    def description(self) -> str:
        """The rule in words, for a report's notes."""
        return (
            f"a {self.grid_points}-point log2 grid (extended up to {self.max_extensions} times at an edge), "
            f"{self.tune_seeds} seed(s) per point, {self.horizon_steps}-step runs"
        )

    def grid(self, arm: str) -> list[float]:
        return log2_grid(self.lr_centers[arm], self.grid_points)

    def validate(self, measured: int) -> None:
        """Raises ``CurvlabError`` for too small a search, or tuning seeds among ``0 .. measured - 1``."""
        if self.tune_seeds < 1 or self.grid_points < 2:
            raise CurvlabError("a preset needs tune_seeds >= 1 and grid_points >= 2")
        if set(self.seeds()) & set(range(measured)):
            raise CurvlabError(
                f"tuning seeds {self.seeds()} overlap the measurement seeds 0..{measured - 1}: raise tune_seed_base"
            )


@dataclass(frozen=True)
class TuningRecord(Record):
    """``tuning.json``: how a job's learning rates were chosen, and what they are.

    ``mode`` is ``"search"`` (every lr searched here, :func:`search_lr`), ``"table"`` (a committed
    table's values, ``table`` its entry, checked on a small grid: ``moved[arm]`` says whether the
    check's optimum moved away from it) or ``"rule"`` (set by a rule, ``table`` its entry, checked
    alike). ``chosen`` maps an arm to its optimizer options (``lr``, and
    a hybrid's ``adam_lr``; a set, untuned arm also says how it was set). ``fallback`` says why a
    table was not used, ``adam_side`` how a hybrid's AdamW side was treated (``None``: no hybrid)."""

    SCHEMA_VERSION: ClassVar[int] = TUNING_SCHEMA_VERSION
    WHAT: ClassVar[str] = "tuning"

    mode: str
    tuned_on_s: float
    horizon_steps: int
    seeds: list[int]
    searches: dict[str, LrSearch]
    chosen: dict[str, dict[str, Any]]
    adam_side: str | None = None
    fallback: str | None = None
    table: dict[str, Any] | None = None
    moved: dict[str, bool] = field(default_factory=dict)
    JSON_KEYS: ClassVar[tuple] = ("mode", "tuned_on_s", "horizon_steps", "seeds", "adam_side", "fallback", ...)

    def lr(self, arm: str) -> float:
        return float(self.chosen[arm]["lr"])
