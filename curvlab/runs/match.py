"""Matched validation loss, in a chosen schedule phase: pairing two runs' checkpoints (docs/science.md
sections 3 and 10).

Optimizers are compared at equal validation loss, not at equal step. But the step Z contains the
scheduled learning rate, so a pair that puts the faster optimizer at the start of its schedule and the
slower one at the end of its decay compares learning rates, not optimizers. ``phase`` says which
checkpoints may pair:

* ``"stable"`` (what the reproduction uses): both checkpoints in their schedule's stable phase
  (multiplier 1 after warmup: ``wsd`` before its cooldown, or ``constant``). A run without one
  (``cosine``) is refused.
* ``"multiplier"``: any two checkpoints whose schedule multipliers are equal (within
  ``multiplier_tolerance``, relative).
* ``"any"``: matched loss alone, whatever the schedule (the comparison the paper describes, and the
  one the confound above affects).

For each target level the pair is the candidate (one checkpoint of each run, losses within ``tolerance``
of each other, relative) whose mean loss lies nearest the target; a number of levels spaces the targets
evenly over the loss range both runs reach in the phase, below the unigram plateau when its ceiling is
given. A level at or above ``plateau_ceiling`` (:func:`plateau_ceiling`) is flagged ``on_plateau``: there
the models have learned only token frequencies, NDS is tiny and changes sign, and aggregates leave it out.

Each side of a pair carries a *window*: the matched checkpoint and up to ``window`` neighbours on each
side in the same phase, over which the analysis averages (a single step's NDS is noisy). The windows of
one run's levels share no checkpoint, so that a single noisy step cannot sway two levels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np

from curvlab.errors import CurvlabError
from curvlab.runs.checkpoint import read_index
from curvlab.runs.config import TrainConfig
from curvlab.runs.schedule import lr_multiplier, schedule_phase
from curvlab.util import schema
from curvlab.util.codec import Record

PHASES = ("stable", "multiplier", "any")
PLATEAU_FRACTION = 0.05  # a loss within 5% of the unigram entropy sits on the unigram plateau


class NoMatchedLevel(CurvlabError):
    """Two runs that can't be compared at matched loss (no stable phase, losses that never overlap): a fact
    about the runs, not a broken file, which a study records and goes on."""


def plateau_ceiling(unigram_entropy: float, fraction: float = PLATEAU_FRACTION) -> float:
    """The loss at and above which a model sits on the unigram plateau: ``(1 - fraction) * H_unigram``
    (a model that has learned only token frequencies has loss H_unigram, in nats)."""
    return (1 - fraction) * unigram_entropy


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """One checkpoint of a run, with the schedule of the step it takes next."""

    step: int
    val_loss: float
    path: str
    multiplier: float | None = None  # None: the run's schedule is unknown (no config.json)
    lr: float | None = None  # the main parameter group's learning rate at this step (base lr x multiplier)
    phase: str = "unknown"  # "warmup", "stable", "decay" or "unknown"


@dataclass(frozen=True, kw_only=True)
class MatchedPair(Record):
    """Run A's and run B's checkpoints at one matched validation-loss level (and their windows)."""

    target: float
    a: Checkpoint
    b: Checkpoint
    on_plateau: bool = False
    window_a: tuple[Checkpoint, ...] = field(default=(), repr=False)
    window_b: tuple[Checkpoint, ...] = field(default=(), repr=False)
    JSON_KEYS: ClassVar[tuple] = (..., "mismatch")  # (derived, for readers: not read back)

    @property
    def mismatch(self) -> float:
        """Relative validation-loss mismatch |L_a - L_b| / target."""
        return abs(self.a.val_loss - self.b.val_loss) / self.target


@dataclass(frozen=True, kw_only=True)
class MatchCriteria:
    """Which checkpoints of two runs pair, and over which windows: :func:`match_runs`'s arguments (``window``
    its ``window_width``), for :func:`curvlab.studies.compare.compare_runs` and ``curvlab compare``."""

    levels: int | tuple[float, ...] = 8
    tolerance: float = 0.01
    phase: str = "stable"
    window: int = 0
    plateau_ceiling: float | None = None

    def description(self) -> str:
        """The criteria in words, for a report's notes."""
        levels = f"{self.levels} targets" if isinstance(self.levels, int) else f"the targets {list(self.levels)}"
        each = (
            "each a single checkpoint"
            if self.window == 0
            else f"each averaged over a window of up to {2 * self.window + 1} checkpoints"
        )
        return f"{levels} in the {self.phase} phase, tolerance {self.tolerance:.0%}, {each}"

    def validate(self) -> None:
        if self.phase not in PHASES:
            raise CurvlabError(f"unknown phase {self.phase!r}; choose one of {', '.join(PHASES)}")
        if isinstance(self.levels, int) and self.levels < 1:
            raise CurvlabError(f"levels must be >= 1, got {self.levels}")
        if not isinstance(self.levels, int) and not self.levels:
            raise CurvlabError("no target levels given")
        if not self.tolerance > 0:
            raise CurvlabError(f"tolerance must be > 0, got {self.tolerance}")
        if self.window < 0:
            raise CurvlabError(f"window must be >= 0, got {self.window}")


@dataclass(frozen=True)
class Matching:
    pairs: list[MatchedPair]
    refused: list[str]  # one message per refused level
    low: float  # the loss range both runs reach in the phase
    high: float
    phase: str = "any"
    plateau_ceiling: float | None = None  # losses at or above this are on the unigram plateau


def _run_config(run_dir: Path) -> TrainConfig | None:
    """The run's ``config.json`` (``None`` if it has none; a ``CurvlabError`` if it is no training config)."""
    path = run_dir / "config.json"
    if not path.is_file():
        return None
    d = schema.read_json(path, "a training config")
    if not isinstance(d, dict):
        raise CurvlabError(f"{path}: not a training config (a JSON object expected, found {type(d).__name__})")
    try:
        return TrainConfig.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:  # (from_dict's refusals: a field missing, a value's type)
        raise CurvlabError(f"{path}: not a training config ({type(e).__name__}: {e})") from None


def run_checkpoints(run_dir: str | Path) -> list[Checkpoint]:
    """Every checkpoint of a run that has a validation loss, in step order, with its schedule (from the
    run's ``config.json``; without one, multiplier, lr and phase are unknown)."""
    run_dir = Path(run_dir)
    entries = read_index(run_dir)
    if not entries:
        raise CurvlabError(f"{run_dir}: no checkpoints (index.json is missing or empty)")
    cfg = _run_config(run_dir)
    base_lr = None if cfg is None else cfg.optimizer_options.get("lr")
    out = []
    for e in entries:
        if e.get("val_loss") is None:
            continue
        step, schedule = int(e["step"]), {}
        if cfg is not None:
            m = lr_multiplier(step, cfg)
            lr = None if base_lr is None else base_lr * m
            schedule = {"multiplier": m, "lr": lr, "phase": schedule_phase(step, cfg)}
        out.append(Checkpoint(step=step, val_loss=float(e["val_loss"]), path=str(run_dir / e["path"]), **schedule))
    if not out:
        raise CurvlabError(f"{run_dir}: no checkpoint has a validation loss")
    return out


def in_phase(checkpoints: list[Checkpoint], phase: str, run: str | Path, min_step: int = 1) -> list[Checkpoint]:
    """The checkpoints (at step >= ``min_step``) that may pair under ``phase``."""
    if phase not in PHASES:
        raise CurvlabError(f"unknown phase {phase!r}; choose one of {', '.join(PHASES)}")
    kept = [c for c in checkpoints if c.step >= min_step]
    if phase != "any" and any(c.multiplier is None for c in kept):
        raise CurvlabError(f"{run}: no config.json, so its schedule is unknown; match with phase 'any'")
    if phase == "stable":
        kept = [c for c in kept if c.phase == "stable"]
        if not kept:
            raise NoMatchedLevel(
                f"{run} never reaches a stable phase with a checkpoint (a cosine schedule has none): train with "
                "--schedule wsd (or constant), or match with phase 'multiplier' or 'any'"
            )
    if not kept:
        raise CurvlabError(f"no checkpoint at step >= {min_step} in {run}")
    return kept


def window(checkpoints: list[Checkpoint], i: int, width: int) -> tuple[Checkpoint, ...]:
    """``checkpoints[i]`` and up to ``width`` neighbours on each side (fewer at the ends)."""
    return tuple(checkpoints[max(0, i - width) : i + width + 1])


def _candidate_pairs(
    a: list[Checkpoint],
    b: list[Checkpoint],
    mismatch: np.ndarray,
    common: tuple[float, float],
    ceiling: float | None,
    tolerance: float,
    phase: str,
    multiplier_tolerance: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The pairs ``(i, j)`` of checkpoints of ``a`` and ``b`` a level may take, with their mean losses: losses
    within ``tolerance`` of each other (and, for ``phase="multiplier"``, equal multipliers), centred inside the
    ``common`` range and below ``ceiling`` when given."""
    la, lb = np.array([c.val_loss for c in a]), np.array([c.val_loss for c in b])
    allowed = mismatch <= tolerance
    if phase == "multiplier":
        ma, mb = np.array([c.multiplier for c in a]), np.array([c.multiplier for c in b])
        allowed &= np.abs(ma[:, None] - mb[None, :]) <= multiplier_tolerance * np.maximum(ma[:, None], mb[None, :])
    ii, jj = np.nonzero(allowed)
    centres = (la[ii] + lb[jj]) / 2
    inside = (centres >= common[0]) & (centres <= common[1])
    if ceiling is not None:
        inside &= centres < ceiling
    return ii[inside], jj[inside], centres[inside]


def match_runs(
    run_a: str | Path,
    run_b: str | Path,
    levels: int | list[float] = 8,
    tolerance: float = 0.01,
    min_step: int = 1,
    phase: str = "any",
    plateau_ceiling: float | None = None,
    window_width: int = 0,
    multiplier_tolerance: float = 0.02,
) -> Matching:
    """Pair the checkpoints of two runs at matched validation loss, in a schedule phase (module docstring).

    Args:
        levels: how many evenly spaced targets inside the common range (below ``plateau_ceiling``), or
            the targets themselves.
        tolerance: largest accepted relative mismatch |L_a - L_b| / target.
        min_step: ignore checkpoints before this step (step 0 is the shared initialization).
        phase: ``"stable"``, ``"multiplier"`` or ``"any"``.
        plateau_ceiling: levels at or above this loss are flagged ``on_plateau`` (see :func:`plateau_ceiling`).
        window_width: neighbours on each side of a matched checkpoint in its window.
        multiplier_tolerance: for ``phase="multiplier"``, the largest relative multiplier difference.

    Raises:
        CurvlabError: runs without checkpoints, without a stable phase (``"stable"``), or whose
            validation losses never overlap in the phase.
    """
    a = in_phase(run_checkpoints(run_a), phase, run_a, min_step)
    b = in_phase(run_checkpoints(run_b), phase, run_b, min_step)
    la, lb = np.array([c.val_loss for c in a]), np.array([c.val_loss for c in b])
    low, high = max(la.min(), lb.min()), min(la.max(), lb.max())
    where = "" if phase == "any" else f" in the {phase} phase" if phase == "stable" else " at equal multipliers"
    if low > high:
        raise NoMatchedLevel(
            f"the validation losses never overlap{where}: {run_a} spans [{la.min():.4f}, {la.max():.4f}], "
            f"{run_b} spans [{lb.min():.4f}, {lb.max():.4f}]"
        )
    ceiling = plateau_ceiling
    mismatch = np.abs(la[:, None] - lb[None, :]) / ((la[:, None] + lb[None, :]) / 2)
    off_plateau = ceiling if isinstance(levels, int) else None  # spaced targets stay off the plateau
    ii, jj, centres = _candidate_pairs(a, b, mismatch, (low, high), off_plateau, tolerance, phase, multiplier_tolerance)
    if isinstance(levels, int):
        top = high if ceiling is None else min(high, ceiling)
        if top <= low:
            plateau = (
                f"the common range{where} [{low:.4f}, {high:.4f}] lies on the unigram plateau (losses >= {ceiling:.4f})"
            )
            return Matching([], [plateau], float(low), float(high), phase, plateau_ceiling)
        targets = np.linspace(top, low, levels)
        reach = [(top - low) / max(1, levels - 1) / 2] * levels
    else:
        targets = np.asarray(levels, dtype=float)
        reach = [tolerance * t for t in targets]
    pairs, refused, used_a, used_b = [], [], set(), set()

    def free(used: set[int], i: int) -> bool:
        # windows share no checkpoint: a level's window must not touch another level's window
        return used.isdisjoint(range(i - window_width, i + window_width + 1))

    for t, r in zip(targets, reach):
        order = np.argsort(np.abs(centres - t) + 1e-9 * mismatch[ii, jj])
        candidates = (k for k in order if free(used_a, int(ii[k])) and free(used_b, int(jj[k])))
        pick = next((k for k in candidates if abs(centres[k] - t) <= r), None)
        if pick is None:
            refused.append(
                f"level {t:.4f}: no pair of checkpoints{where} within {tolerance:.1%} of each other near it; "
                "save denser checkpoints (a smaller --ckpt-every) or raise --tolerance"
            )
            continue
        i, j = int(ii[pick]), int(jj[pick])
        used_a.update(range(i - window_width, i + window_width + 1))
        used_b.update(range(j - window_width, j + window_width + 1))
        target = float((la[i] + lb[j]) / 2)
        pairs.append(
            MatchedPair(
                target=target,
                a=a[i],
                b=b[j],
                on_plateau=ceiling is not None and target >= ceiling,
                window_a=window(a, i, window_width),
                window_b=window(b, j, window_width),
            )
        )
    return Matching(pairs, refused, float(low), float(high), phase, plateau_ceiling)
