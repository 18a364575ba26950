"""The learning-rate schedules (``cosine``, ``wsd``, ``constant``): the multiplier at each step, and the
phase a step is in (warmup, stable, decay), which matched comparisons read (docs/science.md section 3).
"""

from __future__ import annotations

import math

from curvlab.runs.config import TrainConfig


def lr_multiplier(step: int, cfg: TrainConfig) -> float:
    """The schedule: linear warmup, then cosine to ``min_lr_frac``, warmup-stable-decay, or constant."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    decay_start = wsd_decay_start(cfg)
    if step < decay_start:
        return 1.0
    progress = (step - decay_start) / max(1.0, cfg.steps - decay_start)
    return 1.0 - (1.0 - cfg.min_lr_frac) * min(progress, 1.0)


def wsd_decay_start(cfg: TrainConfig) -> float:
    """The step where warmup-stable-decay leaves its stable phase: the last ``cooldown_frac`` of the run decays."""
    return cfg.steps * (1 - cfg.cooldown_frac)


def schedule_phase(step: int, cfg: TrainConfig) -> str:
    """``"warmup"``, ``"stable"`` (multiplier 1 after warmup: ``wsd`` before its decay, ``constant``) or
    ``"decay"`` (``cosine`` after warmup, ``wsd`` in its cooldown) for the step taken at ``step``."""
    if step < cfg.warmup_steps:
        return "warmup"
    if cfg.schedule == "constant" or (cfg.schedule == "wsd" and step < wsd_decay_start(cfg)):
        return "stable"
    return "decay"
