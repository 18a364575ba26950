"""Matched validation loss: pairing two runs' checkpoints at equal validation loss (SCIENCE.md section 3).

Optimizers are compared at equal validation loss, not at equal step. Target levels are spaced evenly
inside the range both runs reach (or given); for each, each run contributes the checkpoint whose
validation loss is nearest. A pair whose losses differ by more than ``tolerance`` (relative to the
target) is refused, with a message saying how to get denser checkpoints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from curvlab.checkpoint import read_index
from curvlab.errors import CurvlabError


@dataclass(frozen=True)
class MatchedPair:
    target: float
    step_a: int
    loss_a: float
    path_a: str
    step_b: int
    loss_b: float
    path_b: str

    @property
    def mismatch(self) -> float:
        """Relative validation-loss mismatch |L_a - L_b| / target."""
        return abs(self.loss_a - self.loss_b) / self.target

    def to_dict(self) -> dict:
        return {**asdict(self), "mismatch": self.mismatch}


@dataclass(frozen=True)
class Matching:
    pairs: list[MatchedPair]
    refused: list[str]  # one message per refused level
    low: float
    high: float


def run_losses(run_dir: str | Path) -> list[tuple[int, float, str]]:
    """``(step, val_loss, checkpoint path)`` of every checkpoint of a run with a validation loss."""
    run_dir = Path(run_dir)
    entries = read_index(run_dir)
    if not entries:
        raise CurvlabError(f"{run_dir}: no checkpoints (index.json is missing or empty)")
    out = [
        (e["step"], float(e["val_loss"]), str(run_dir / e["path"])) for e in entries if e.get("val_loss") is not None
    ]
    if not out:
        raise CurvlabError(f"{run_dir}: no checkpoint has a validation loss")
    return out


def match_runs(
    run_a: str | Path,
    run_b: str | Path,
    levels: int | list[float] = 8,
    tolerance: float = 0.01,
    min_step: int = 1,
) -> Matching:
    """Pair the checkpoints of two runs at matched validation loss.

    Args:
        levels: how many evenly spaced targets inside the common range, or the targets themselves.
        tolerance: largest accepted relative mismatch |L_a - L_b| / target.
        min_step: ignore checkpoints before this step (step 0 is the shared initialization).

    Raises:
        CurvlabError: runs without checkpoints, or whose validation losses never overlap.
    """
    a = [x for x in run_losses(run_a) if x[0] >= min_step]
    b = [x for x in run_losses(run_b) if x[0] >= min_step]
    if not a or not b:
        raise CurvlabError(f"no checkpoint at step >= {min_step} in {run_a if not a else run_b}")
    la, lb = np.array([x[1] for x in a]), np.array([x[1] for x in b])
    low, high = max(la.min(), lb.min()), min(la.max(), lb.max())
    if low > high:
        raise CurvlabError(
            f"the validation losses never overlap: {run_a} spans [{la.min():.4f}, {la.max():.4f}], "
            f"{run_b} spans [{lb.min():.4f}, {lb.max():.4f}]"
        )
    targets = np.linspace(high, low, levels) if isinstance(levels, int) else np.asarray(levels, dtype=float)
    pairs, refused, seen = [], [], set()
    for t in targets:
        i, j = int(np.abs(la - t).argmin()), int(np.abs(lb - t).argmin())
        pair = MatchedPair(float(t), a[i][0], a[i][1], a[i][2], b[j][0], b[j][1], b[j][2])
        if pair.mismatch > tolerance:
            refused.append(
                f"level {t:.4f}: nearest checkpoints differ by {pair.mismatch:.1%} (> {tolerance:.1%}): "
                f"step {pair.step_a} at {pair.loss_a:.4f} vs step {pair.step_b} at {pair.loss_b:.4f}; "
                "save denser checkpoints (a smaller --ckpt-every) or raise --tolerance"
            )
        elif (pair.step_a, pair.step_b) not in seen:
            seen.add((pair.step_a, pair.step_b))
            pairs.append(pair)
    return Matching(pairs, refused, float(low), float(high))
