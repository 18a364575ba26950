"""Synthetic per-level data for the statistics tests: matched comparisons and trajectories built from
arrays, in the records' own types (no training, no curvature)."""

from __future__ import annotations

import numpy as np

from curvlab.curvature.scalars import CheckpointScalars
from curvlab.studies.compare import Comparison, Level, WindowSide
from curvlab.studies.records import ComparisonRecord, LevelData, TrackRecord


def ar1(rng: np.random.Generator, n: int, rho: float, sd: float, size: int = 1) -> np.ndarray:
    """``size`` stationary AR(1) series of length ``n`` (marginal sd ``sd``, lag-1 correlation ``rho``)."""
    out = np.empty((size, n))
    out[:, 0] = rng.normal(0, sd, size)
    innovation = sd * np.sqrt(1 - rho**2)
    for k in range(1, n):
        out[:, k] = rho * out[:, k - 1] + rng.normal(0, innovation, size)
    return out


# what every window member holds besides the scalars a test sets (CheckpointScalars' other fields)
FILLER = {
    **{f"{p}{k}": 1.0 for p in ("", "hidden_") for k in ("nds", "first_order", "curvature_penalty", "update_norm")},
    "embed_head_share": 0.5,
    "taylor_error": 0.1,
}


def side(optimizer: str, scalars: dict[str, float], step: int = 10) -> WindowSide:
    """One window of one checkpoint; its own step's cos(G, Z) (``cosine``, ``hidden_cosine``) is the paired one
    of its optimizer where ``scalars`` give that, as an analysed checkpoint's is."""
    keys = {f"{p}cosine": f"paired_cos_{optimizer}_{s}" for p, s in (("", "all"), ("hidden_", "hidden"))}
    own = {k: float(scalars[key]) for k, key in keys.items() if key in scalars}
    given = {k: float(v) for k, v in scalars.items()}
    member = {"step": step, "val_loss": 4.0, "taylor_ok": True, **FILLER, **own, **given}
    return WindowSide(optimizer, step, 4.0, 1.0, 0.01, [CheckpointScalars.from_dict(member)], [])


def record(name: str, seed: int, a_levels: list[dict], b_levels: list[dict]) -> ComparisonRecord:
    """A matched comparison of one seed: side a (the numerator: AdamW's, or the first run of one arm)
    and side b, one dict of window-mean scalars per level."""
    arm_a, arm_b = name.split("/")
    levels = [
        Level(4.0 - 0.1 * k, 0.0, False, side(arm_a, x, 10 + k), side(arm_b, y, 20 + k))
        for k, (x, y) in enumerate(zip(a_levels, b_levels))
    ]
    optimizers = (arm_a, arm_b)
    return ComparisonRecord(name, seed, 0.0, Comparison(levels, name, [], optimizers))


def track(arm: str, s: float, seed: int, nds: np.ndarray, within: np.ndarray | None = None) -> TrackRecord:
    """A trajectory of ``len(nds)`` checkpoints evenly over ``steps = 10 * len(nds)`` (no warmup, no plateau)."""
    n = len(nds)
    within = np.zeros(n) if within is None else within
    rows = [
        CheckpointScalars.from_dict({"step": 10 * (k + 1), "on_plateau": False, "phase": "stable", "taylor_ok": True, "nds": float(nds[k]), "hidden_nds": float(nds[k]),
         "within": float(within[k]), "nds_layers": float(nds[k]), "within_layers": float(within[k])})
        for k in range(n)
    ]  # fmt: skip
    return TrackRecord(arm, s, seed, 10 * n, 0, rows)


def level_data(comparisons=(), tracks=(), s_values=(0.0, 1.0)) -> LevelData:
    return LevelData(list(comparisons), list(tracks), None, list(s_values))
