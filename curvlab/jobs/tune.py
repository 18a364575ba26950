"""The tuning stage of a design: AdamW's and Muon's learning rates at the first s, on tuning seeds disjoint
from the measured ones and at the compared horizon (:func:`tune`), and the step-size control arm's lr,
*set* from the first seed's measurement rather than tuned (:func:`control_lr`).

The learning rates come either from the committed table (``lr_source="table"``, made by the full search,
:func:`curvlab.jobs.reproduce.search_lr_table`), checked on a ``check_points`` grid around each, or from the
full search here (log2 grids extended while the best point sits at an edge, :mod:`curvlab.studies.tuning`).
Muon's AdamW side is tied to AdamW's lr, or tuned on its own grid (``adam_side``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from curvlab.errors import CurvlabError
from curvlab.jobs.job import Job
from curvlab.jobs.lr_table import optimum_moved, read_lr_table
from curvlab.models.gpt import GPT, get_config
from curvlab.optim.model_optimizer import default_muon_rule
from curvlab.optim.muon import matrix_shape, muon_scale
from curvlab.studies.design import Preset
from curvlab.studies.records import ComparisonRecord
from curvlab.studies.tuning import LrSearch, TuningRecord, log2_grid


def tune(job: Job, preset: Preset, data: Path) -> TuningRecord:
    """AdamW's and Muon's learning rates at the first s (module docstring), read back when a previous
    invocation saved them (``tuning.json``)."""
    saved = job.saved_tuning()
    if saved is not None:
        return saved
    t = preset.tuning
    table = _table_entry(preset) if t.lr_source == "table" else None
    fallback = None
    if table is not None and table.get("fingerprint") != preset.tuning_fingerprint():
        table, fallback = None, "the committed table's entry was made under other settings"
    elif table is None and t.lr_source == "table":
        fallback = "the committed table has no entry for this preset"
    if fallback:
        job.say(f"{fallback}: the full search runs here")
    if table is None:
        seeds = preset.tuning_settings.seeds()
        searches, moved = _search(job, preset, data, seeds), {}
        chosen = {"adamw": {"lr": searches["adamw.lr"].chosen}, "muon": {"lr": searches["muon.lr"].chosen}}
        chosen["muon"]["adam_lr"] = searches.get("muon.adam_lr", searches["adamw.lr"]).chosen
    else:
        seeds = t.check_seed_list()
        searches, chosen, moved = _check(job, preset, data, seeds, table)
    horizon = preset.tuning_settings.horizon_steps
    s0 = preset.language.s_values[0]
    mode = "search" if table is None else "table"
    record = TuningRecord(mode, s0, horizon, seeds, searches, chosen, t.adam_side, fallback, table, moved)
    return job.save_tuning(record)


def _table_entry(preset: Preset) -> dict | None:
    """The committed table's entry for ``preset``: its own, or else one made under the same tuning settings
    (the same fingerprint: a design that adds only measurements, as mechanism does to quick, runs at its
    base's learning rates)."""
    entries = read_lr_table()
    own = entries.get(preset.name)
    if own is not None:
        return own
    fingerprint = preset.tuning_fingerprint()
    return next((e for e in entries.values() if e.get("fingerprint") == fingerprint), None)


def _search(job: Job, preset: Preset, data: Path, seeds: list[int]) -> dict[str, LrSearch]:
    """The full search: AdamW's lr, then Muon's with its AdamW side at AdamW's, then (``adam_side="tuned"``)
    a one-dimensional search of that side at the chosen Muon lr."""
    rule = preset.tuning_settings
    extend = rule.max_extensions
    searches = {"adamw.lr": job._search(data, "adamw", "lr", rule.grid("adamw"), {}, extend, seeds)}
    adam_lr = searches["adamw.lr"].chosen
    searches["muon.lr"] = job._search(data, "muon", "lr", rule.grid("muon"), {"adam_lr": adam_lr}, extend, seeds)
    if preset.tuning.adam_side == "tuned":
        grid = log2_grid(adam_lr, rule.grid_points)
        fixed = {"lr": searches["muon.lr"].chosen}
        searches["muon.adam_lr"] = job._search(data, "muon", "adam_lr", grid, fixed, extend, seeds)
    return searches


def _check(job: Job, preset: Preset, data: Path, seeds: list[int], table: dict[str, Any]):
    """The pre-registered values, and a check on a ``check_points`` grid that the optimum has not moved:
    (searches, chosen, moved)."""
    if set(seeds) & set(table["seeds"]):
        raise CurvlabError(f"check seeds {seeds} overlap the table's {table['seeds']}: raise check_seed_base")
    chosen = {arm: dict(table["chosen"][arm]) for arm in ("adamw", "muon")}
    searches, moved = {}, {}
    for arm in ("adamw", "muon"):
        knob = "hidden_lr" if "hidden_lr" in chosen[arm] else "lr"  # the hidden matrices' lr, which a width rule sets
        fixed = {k: v for k, v in chosen[arm].items() if k != knob}
        grid = log2_grid(chosen[arm][knob], preset.tuning.check_points)
        s = searches[f"{arm}.{knob}"] = job._search(data, arm, knob, grid, fixed, 0, seeds)
        moved[arm] = optimum_moved(s, chosen[arm][knob], table.get("searches", {}).get(f"{arm}.{knob}"))
        if moved[arm]:
            job.say(f"{arm}: the check's best {knob} {s.chosen:g} beats the set {chosen[arm][knob]:g}")
    return searches, chosen, moved


def check_rule(job: Job, preset: Preset, data: Path, entry: dict[str, Any]) -> TuningRecord:
    """Learning rates set by a rule rather than tuned (``entry["chosen"]``; the scaling design's transfer across
    widths), checked on a ``check_points`` grid around each arm's hidden-matrix lr (``moved``: the grid's best is
    another point; with no table search behind the rule there is no noise estimate to compare with), and used
    as set. Read back when saved, and refused when saved for other values.

    Raises:
        CurvlabError: the job's directory holds a check of other values.
    """
    saved = job.saved_tuning()
    if saved is not None:
        if saved.mode != "rule" or saved.chosen != entry["chosen"]:
            raise CurvlabError(
                f"{job.out} holds learning rates checked for another rule ({saved.chosen}, not {entry['chosen']}): "
                "choose a fresh --out"
            )
        return saved
    seeds = preset.tuning.check_seed_list()
    searches, chosen, moved = _check(job, preset, data, seeds, {"seeds": [], **entry})
    horizon, s0 = preset.tuning_settings.horizon_steps, preset.language.s_values[0]
    record = TuningRecord("rule", s0, horizon, seeds, searches, chosen, preset.tuning.adam_side, None, entry, moved)
    return job.save_tuning(record)


def muon_shapes(model: str, overrides: dict[str, Any]) -> list[tuple[int, int]]:
    """The (rows, cols) of every matrix Muon updates in a curvlab GPT (by structural role)."""
    net = GPT(get_config(model, **overrides))
    use_muon = default_muon_rule(net)
    return [matrix_shape(q) for n, q in net.named_parameters() if use_muon(n, q)]


def muon_norm_per_lr(shapes: list[tuple[int, int]], scale: str) -> float:
    r""":math:`\|Z\|_F / \eta` of a Muon step with an exactly orthogonal factor: each matrix
    contributes :math:`s_i^2 \min(m_i, n_i)` (its polar factor has that many unit singular values)."""
    return math.sqrt(sum(muon_scale(shape, scale) ** 2 * min(shape) for shape in shapes))


def control_lr(preset: Preset, record: ComparisonRecord, chosen: dict[str, dict[str, float]]) -> dict[str, float]:
    r"""The step-size control arm's learning rate, *set* (not tuned) so that its hidden-matrix
    :math:`\|Z\|` equals AdamW's at the matched levels of ``record`` (AdamW against Muon, the first
    seed). Muon's hidden :math:`\|Z\|` is its lr times a constant of the shapes and the scale rule
    (:math:`\sum_i s_i^2 \min(m_i, n_i)` under the square root, the Newton–Schulz factor having
    near-unit singular values), so the ratio AdamW/Muon measured at lr :math:`\eta_M` gives
    :math:`\eta_C = \eta_M \cdot (\|Z_A\| / \|Z_M\|) \cdot c_\text{original} / c_\text{moonlight}`."""
    c = record.comparison
    if c is None or not c.headline_levels:
        raise CurvlabError(f"no matched level of {record.name} seed {record.seed} to set the control arm's lr from")
    z_a = np.mean([lv.a.mean["hidden_update_norm"] for lv in c.headline_levels])
    z_m = np.mean([lv.b.mean["hidden_update_norm"] for lv in c.headline_levels])
    shapes = muon_shapes(preset.network.model, preset.network.model_overrides)
    ratio = muon_norm_per_lr(shapes, "original") / muon_norm_per_lr(shapes, "moonlight")
    lr = float(f"{chosen['muon']['lr'] * (z_a / z_m) * ratio:.4g}")
    norms = {"adamw_hidden_update_norm": float(z_a), "muon_hidden_update_norm": float(z_m)}
    return {"lr": lr, "adam_lr": chosen["muon"]["adam_lr"], "set_from_seed": record.seed, **norms}
