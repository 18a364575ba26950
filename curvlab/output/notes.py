"""The caveats a report states up front. A reproduction's (:func:`reproduction_notes`): what its preset
reduced or tied, where its learning rates came from, what its matched levels and trajectory means leave
out, and each arm's final validation loss at equal steps. A fine-tuning's (:func:`finetune_notes`): its
adapters, tuning, curvature batch and matching."""

from __future__ import annotations

import math

import numpy as np

from curvlab.data.corpus import CORPORA
from curvlab.inference.statistics import mean_inference
from curvlab.models.gpt import get_config
from curvlab.studies.design import CONTROL_ARM, FinetunePreset, Preset
from curvlab.studies.records import LevelData
from curvlab.studies.tuning import TuningRecord


def final_loss_note(final: dict[str, dict[str, list]], steps: int) -> str:
    """Each arm's final validation loss at equal steps, mean and 95% t interval over seeds
    (:func:`~curvlab.inference.statistics.mean_inference`), at each s: whether Muon beats AdamW here at all,
    the premise the curvature is to explain. A seed without a finite loss leaves its arm no interval."""
    parts = []
    for s, arms in final.items():
        for arm, values in sorted(arms.items()):
            x = [v for v in values if v is not None]
            if len(x) >= 2 and all(math.isfinite(v) for v in x):
                inf = mean_inference(x)
                lo, hi = inf.ci95
                parts.append(f"{arm} at s = {s}: {inf.value:.4f} [{lo:.4f}, {hi:.4f}] (n = {len(x)})")
            elif len(x):
                alone = "" if len(x) == 1 else ", no interval"
                parts.append(f"{arm} at s = {s}: {np.mean(x):.4f} (n = {len(x)}{alone})")
    return f"Final validation loss at step {steps}, mean [95% t interval over seeds]: " + "; ".join(parts) + "."


def _learning_rate_note(p: Preset, tuning: TuningRecord) -> str:
    """Where the learning rates came from: the committed table, checked here (and whether the optimum moved),
    or a search at this preset's horizon on tuning seeds disjoint from the measured ones."""
    seeds = ", ".join(str(x) for x in tuning.seeds)
    if tuning.mode == "table":
        table = tuning.table
        moved = [arm for arm, m in tuning.moved.items() if m]
        ties = []
        for arm in ("adamw", "muon"):
            search = table.get("searches", {}).get(f"{arm}.lr")
            if search and search["ties"]:
                tied = ", ".join(f"{x:g}" for x in search["ties"])
                ties.append(f"{arm}'s {search['chosen']:g} is within one standard error of {tied}")
        return (
            f"Learning rates from the committed table (the full search at this preset's settings: log2 grids, "
            f"tuning seeds {table.get('seeds')}, {table.get('horizon_steps')}-step runs"
            + (f"; {'; '.join(ties)}" if ties else "")
            + f"), checked here on {p.tuning.check_points} points with check seed(s) {seeds}: "
            + ("the optimum moved for " + ", ".join(moved) + "." if moved else "the optimum did not move.")
        )
    return (
        f"Learning rates searched at s = {p.language.s_values[0]:g} on {tuning.horizon_steps}-step runs (the "
        f"compared horizon) with tuning seeds {seeds}, disjoint from the measurement seeds 0..{p.seeds - 1}"
        + (f" ({tuning.fallback})." if tuning.fallback else ".")
    )


def reproduction_notes(
    preset: Preset,
    tuning: TuningRecord,
    levels: LevelData | None = None,
    plateaus: dict[float, float] | None = None,
    final: dict[str, dict[str, list]] | None = None,
    paper: Preset | None = None,
) -> list[str]:
    """The caveats a reproduction's report states up front (what ``preset`` reduced, what it tied, what the
    trajectory means leave out).

    Args:
        preset: the reproduction's preset.
        tuning: how its learning rates were chosen.
        levels: the matched levels and trajectories of one seed, when measured.
        plateaus: the unigram plateau ceiling of each training s, in nats.
        final: each s's and arm's final validation losses, one a seed.
        paper: the paper's design, whose evaluation batches a smaller number is compared with.

    Returns:
        The notes, one sentence or a few each.
    """
    p, m = preset, preset.measurement
    tokens = f"{p.training.batch_size}x{get_config(p.network.model, **p.network.model_overrides).block_size}"
    notes = []
    if p.seeds < 3:
        notes.append(f"{p.seeds} seeds per optimizer: fewer than 3, so every entry is descriptive (no verdict).")
    if p.tuning.adam_side == "tied":
        notes.append(
            "Muon's AdamW side (embeddings, head, norms) runs at AdamW's learning rate "
            f"({tuning.lr('adamw'):g}): it is tied, not tuned on its own."
        )
    notes.append(_learning_rate_note(p, tuning))
    control = tuning.chosen.get(CONTROL_ARM)
    if control:
        notes.append(
            f"The step-size control arm ({CONTROL_ARM}) is not tuned: its lr {control['lr']:g} is set so that "
            f"its hidden ||Z|| equals AdamW's ({control['adamw_hidden_update_norm']:.3g}) at seed "
            f"{control['set_from_seed']}'s matched levels."
        )
    notes.append(
        f"Matched levels: {m.matching.description()}, checkpoints {p.training.ckpt_every} steps apart"
        + (" (windows share no checkpoint)" if m.matching.window else "")
        + f", each analysed on {m.analysis_batches} batch(es) of {tokens} tokens; trajectories on "
        f"{m.track_batches}, stable phase only"
        + (f"; the A/A comparisons' levels on {p.aa_batches}." if p.aa_batches != m.analysis_batches else ".")
    )
    if plateaus:
        notes.append(
            "Unigram plateau ceilings (a level or checkpoint at or above is left out of aggregates), per training "
            "s: " + ", ".join(f"s = {s:g}: {c:.3f}" for s, c in plateaus.items()) + " nats."
        )
    if levels is not None and levels.tracks:
        counts = {}
        for t in levels.tracks:
            n = counts.setdefault(t.arm, [0, 0])
            n[0] += len(t.rows) - len(t.after_warmup())
            n[1] += len(t.rows)
        if m.track_points == "read":
            notes.append(
                "Trajectories analyse only the tracked checkpoints a claim or control reads, in the stable phase "
                "off the unigram plateau: "
                + ", ".join(f"{arm} {total}" for arm, (_, total) in sorted(counts.items()))
                + "."
            )
        else:
            notes.append(
                "Trajectory means leave out checkpoints on the unigram plateau or outside the stable phase: "
                + ", ".join(f"{arm} {off} of {total}" for arm, (off, total) in sorted(counts.items()))
                + "."
            )
    if final:
        notes.append(final_loss_note(final, p.training.steps))
    if paper is not None and m.analysis_batches < (full := paper.measurement.analysis_batches):
        notes.append(f"{m.analysis_batches} evaluation batch(es) per checkpoint (the paper preset uses {full}).")
    return notes + language_notes(p)


def language_notes(p: Preset) -> list[str]:
    """What the design trained on: natural text (the corpus curvlab made, or a user's data directory), or the
    grammar and the Zipf exponents it swept."""
    lang = p.language
    if lang.corpus in CORPORA:
        bpe = f"a {lang.corpus_vocab}-token byte-level BPE trained on it"
        return [f"Natural text, not the grammar: {lang.corpus} ({bpe}; its one language is labelled s = 0)."]
    if lang.corpus is not None:
        return [f"Natural text, not the grammar: the data directory given with --data ({lang.corpus}), s = 0."]
    notes = []
    if len(lang.s_values) < 3:
        notes.append(f"The Zipf sweep runs s = {', '.join(f'{s:g}' for s in lang.s_values)} only.")
    if lang.grammar.get("n_tokens"):
        notes.append(f"A {lang.grammar['n_tokens']}-token grammar (the paper's has 4412).")
    return notes


def finetune_notes(preset: FinetunePreset) -> list[str]:
    """The caveats of a fine-tuning comparison's report: the adapters, the tuning rule, where the curvature
    is measured, the matching, and what a reduced preset leaves rough.

    Args:
        preset: the fine-tuning comparison's settings.

    Returns:
        The notes, one sentence or a few each.
    """
    p = preset
    notes = [
        f"LoRA rank {p.rank} (alpha {2 * p.rank}) on every attention and MLP linear of `{p.model}`; "
        f"{p.steps} adaptation steps at s = 1, warmup-stable-decay, the same for every optimizer.",
        f"Learning rates tuned on {p.tuning_settings.description()}.",
        f"Curvature of the step taken at each checkpoint of the stable phase ({p.ckpt_every} steps apart), over "
        f"the adapter parameters, on {p.heldout_windows} held-out validation windows at s = 1 (the main "
        "comparison measures on the step's training batches).",
        f"Matched levels: {p.matching.description()}; no level is dropped.",
    ]
    if p.seeds < 3:
        notes.append(f"{p.seeds} seeds per optimizer (3 in the standard preset): the intervals are rough.")
    if p.tuning.grid_points < 5 or p.tuning.tune_seeds < 2:
        notes.append("Reduced tuning (the standard preset: 5-point grids, 2 seeds per point).")
    return notes
