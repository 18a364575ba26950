"""Adapter optimizers compared at matched validation loss (``curvlab finetune``'s study): each Muon variant
for adapters (sMuon, LoRA-Muon, per-factor Muon) against AdamW, level by level, as typed records
(:class:`AdapterComparison`, :class:`FinetuneResult`, JSON ``FINETUNE_SCHEMA_VERSION``) and their
seed-level ratio estimates (:func:`estimates`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from curvlab.curvature.scalars import RATIO_KEYS, SCOPE_KEYS
from curvlab.errors import CurvlabError
from curvlab.inference import statistics
from curvlab.runs.adapt import curvature_rows
from curvlab.runs.match import MatchCriteria, match_runs
from curvlab.runs.monitor import MonitorRow
from curvlab.studies.records import JsonFile
from curvlab.util.codec import Record
from curvlab.util.versions import SoftwareVersions

FINETUNE_SCHEMA_VERSION = 1
ADAPTER_ARMS = ("adamw", "smuon", "lora-muon", "per-factor-muon")
MUON_VARIANTS = ("smuon", "lora-muon", "per-factor-muon")  # each compared against AdamW
LEVEL_KEYS = (*SCOPE_KEYS, "within", "cross")  # what a level's window means average


@dataclass(frozen=True)
class AdapterLevel(Record):
    """One matched validation-loss level of AdamW against a Muon variant, in one seed: each side's
    matched step, its window's steps and the window means of :data:`LEVEL_KEYS`."""

    seed: int
    target: float
    mismatch: float
    steps: dict[str, int]
    windows: dict[str, list[int]]
    values: dict[str, dict[str, float]]


@dataclass(frozen=True)
class AdapterComparison(Record):
    """AdamW against one Muon variant at matched loss, over every seed (``refused``: levels and seeds
    without a match, with the reason)."""

    variant: str
    levels: list[AdapterLevel]
    refused: list[str] = field(default_factory=list)

    def seeds(self) -> list[int]:
        return sorted({lv.seed for lv in self.levels})

    def rows(self, num: tuple[str, str], den: tuple[str, str]) -> list[np.ndarray]:
        """Per seed, the ``(levels, 2)`` array of (numerator, denominator) window means, each given as
        ``(arm, key)`` with arm ``"adamw"`` or ``"variant"``."""
        arm = {"adamw": "adamw", "variant": self.variant}
        pick = [(arm[num[0]], num[1]), (arm[den[0]], den[1])]
        return [
            np.array([[lv.values[a][k] for a, k in pick] for lv in self.levels if lv.seed == s]) for s in self.seeds()
        ]


@dataclass(frozen=True)
class FinetuneEntry(Record):
    """One summary number: a ratio of sums over seeds and levels, its 95% seed-level interval (``None``
    with one seed), the numbers of seeds and levels, and the per-level values it comes from."""

    name: str  # e.g. "nds_ratio", "rho_within_adamw"
    variant: str  # the comparison, "adamw/<variant>"
    quantity: str
    value: float
    ci95: list[float] | None
    n_levels: int
    n_seeds: int
    per_level: list[dict[str, Any]]
    note: str = ""


@dataclass
class FinetuneResult(JsonFile):
    """Everything ``curvlab finetune`` measured (``finetune.json``, ``FINETUNE_SCHEMA_VERSION``)."""

    SCHEMA_VERSION: ClassVar[int] = FINETUNE_SCHEMA_VERSION
    WHAT: ClassVar[str] = "fine-tuning results"

    preset: dict[str, Any]
    base: str
    chosen_lr: dict[str, float]
    comparisons: list[AdapterComparison]
    entries: list[FinetuneEntry]
    final_loss: dict[str, list[float]]  # arm -> final validation loss per seed
    notes: list[str]
    timing: dict[str, float] = field(default_factory=dict)
    versions: SoftwareVersions | None = None  # what it was made with (None: a result from before they were kept)

    def entry(self, name: str, variant: str) -> FinetuneEntry:
        found = [e for e in self.entries if e.name == name and e.variant == variant]
        if not found:
            raise CurvlabError(f"no entry {name!r} for adamw/{variant}")
        return found[0]


# (name, quantity, numerator (arm, key), denominator (arm, key)): every summary number is a ratio
ENTRY_SPECS = (
    *((f"{k}_ratio", f"{k} AdamW / variant", ("adamw", k), ("variant", k)) for k in RATIO_KEYS),
    ("rho_within_adamw", "within-layer share of NDS, AdamW", ("adamw", "within"), ("adamw", "nds")),
    ("rho_within_variant", "within-layer share of NDS, variant", ("variant", "within"), ("variant", "nds")),
    ("taylor_adamw", "predicted / realized decrease, AdamW", ("adamw", "predicted"), ("adamw", "realized")),
    ("taylor_variant", "predicted / realized decrease, variant", ("variant", "predicted"), ("variant", "realized")),
)


def estimates(comparisons: list[AdapterComparison]) -> list[FinetuneEntry]:
    """Every summary entry, from the per-level data alone: for each comparison and each of
    :data:`ENTRY_SPECS`, the ratio of sums over seeds and levels of the window means, and each seed's
    median of its per-level ratios averaged over seeds (``_median``), each with its seed-level interval
    (:func:`curvlab.inference.statistics.ratio_estimates`). No level is dropped."""
    entries = []
    for c in comparisons:
        for name, quantity, num, den in ENTRY_SPECS:
            rows = c.rows(num, den)
            levels = sorted(c.levels, key=lambda lv: lv.seed)  # the order of the rows
            stacked = np.concatenate(rows) if rows else np.zeros((0, 2))
            per_level = [
                {"seed": lv.seed, "target": lv.target, "numerator": float(r[0]), "denominator": float(r[1])}
                for lv, r in zip(levels, stacked)
            ]
            if not rows:
                for suffix in ("", "_median"):
                    label = quantity + (" (per-seed median over levels, mean of seeds)" if suffix else "")
                    entries.append(FinetuneEntry(name + suffix, c.variant, label, math.nan, None, 0, 0, [], "no level"))
                continue
            for suffix, est in statistics.ratio_estimates(rows).items():
                label = quantity + (" (per-seed median over levels, mean of seeds)" if suffix else "")
                note = "" if est.ci95 is not None else f"{est.n_seeds} seed(s): no interval"
                if est.denominator_spans_zero:
                    note = statistics.DENOMINATOR_NOTE
                ci = None if est.ci95 is None else list(est.ci95)
                entry = FinetuneEntry(
                    name + suffix, c.variant, label, est.value, ci, est.n_units, est.n_seeds, per_level, note
                )
                entries.append(entry)
    return entries


def _side_means(rows: dict[int, MonitorRow], steps: list[int]) -> dict[str, float]:
    """Window means of :data:`LEVEL_KEYS` over the curvature rows at ``steps`` (a row that is not
    ``ok``, non-finite or a zero step, counts as NaN and makes the mean NaN: nothing is dropped)."""
    window = [rows[s].scalars() if rows[s].ok else None for s in steps]
    return {k: float(np.mean([math.nan if r is None else r.value(k) for r in window])) for k in LEVEL_KEYS}


def compare_adapters(
    runs: dict[tuple[str, int], Path], seeds: list[int], criteria: MatchCriteria
) -> list[AdapterComparison]:
    """Per seed, AdamW's run against each Muon variant's at matched validation loss under ``criteria``
    (the stable phase), each side averaged over its window (:func:`curvlab.runs.match.match_runs`)."""
    comparisons, m = [], criteria
    for variant in MUON_VARIANTS:
        levels, refused = [], []
        for seed in seeds:
            a, b = runs[("adamw", seed)], runs[(variant, seed)]
            try:
                matched = match_runs(a, b, m.levels, m.tolerance, phase=m.phase, window_width=m.window)
            except CurvlabError as e:
                refused.append(f"seed {seed}: {e}")
                continue
            refused += [f"seed {seed}: {r}" for r in matched.refused]
            rows_a, rows_b = curvature_rows(a), curvature_rows(b)
            for pair in matched.pairs:
                wa, wb = [c.step for c in pair.window_a], [c.step for c in pair.window_b]
                steps, windows = {"adamw": pair.a.step, variant: pair.b.step}, {"adamw": wa, variant: wb}
                means = {"adamw": _side_means(rows_a, wa), variant: _side_means(rows_b, wb)}
                levels.append(AdapterLevel(seed, pair.target, pair.mismatch, steps, windows, means))
        comparisons.append(AdapterComparison(variant, levels, refused))
    return comparisons
