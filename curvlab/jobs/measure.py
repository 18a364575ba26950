"""The measurement stage of a design: one measurement seed's runs and everything measured on them
(:func:`measure_seed`, ``analysis/seed<k>.json``), and the pruning of its checkpoints once that is saved
(:func:`prune_seed`). Each function takes the job whose directory it works in (:class:`~curvlab.jobs.job.Job`:
its ``out``, clock and progress lines) and the :class:`~curvlab.studies.design.Preset` it measures, so
that any design composes them: the reproduction per seed, the robustness design per setting and seed.

Per seed: every arm's run at the first s and the sweep's arms at the other s (each with a shadow of the
other arm, and its twins where the controls read them); AdamW against each Muon arm at matched validation
loss inside the stable phase; the trajectories (with the stability context every ``stability_interval``
steps); and the A/A comparisons whose later seed this is. The first seed sets the step-size control arm's
lr (:func:`curvlab.jobs.tune.control_lr`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from curvlab.analysis.targets import AnalysisSettings
from curvlab.jobs.job import Job
from curvlab.jobs.pruning import prune_run, window_checkpoints
from curvlab.jobs.tune import control_lr
from curvlab.runs.match import Checkpoint, NoMatchedLevel, run_checkpoints
from curvlab.runs.train import train
from curvlab.studies.compare import compare_runs
from curvlab.studies.design import ARMS, CONTROL_ARM, Preset, train_config
from curvlab.studies.records import PRIMARY_COMPARISON, ComparisonRecord, LevelData, TrackRecord
from curvlab.studies.track import track_run
from curvlab.studies.tuning import TuningRecord


def s_name(s: float) -> str:
    """A training exponent's directory name (``s0``, ``s0.5``)."""
    return f"s{s:g}"


def run_dir(out: Path, s: float, arm: str, seed: int) -> Path:
    """Where a design in ``out`` trains ``arm`` at ``s`` and ``seed``."""
    return out / "runs" / s_name(s) / arm / f"seed{seed}"


def controlled(preset: Preset, s: float, arm: str) -> bool:
    """Whether a run keeps the controls: AdamW's and Muon's at the first s, the paired claim's runs and the
    only ones the controls read (at the sweep's s and in the control arm, twins and Lanczos took a third
    of `standard`'s time and fed no number)."""
    return preset.measurement.controls and s == preset.language.s_values[0] and arm in ("adamw", "muon")


def settings(
    preset: Preset, batches: int, tracked: bool = False, controls: bool = True, paired: bool = True
) -> AnalysisSettings:
    """How a checkpoint is analysed: with the controls' directions, the held-out H and the exchangeable twins
    at every point where the preset keeps controls (not in the A/A and control-arm comparisons, whose points
    the controls don't read: the twins there tripled their cost), with the factorial there where the preset
    measures it; with the shadow's direction unless ``paired`` is off (an A/A comparison's claims read each
    run's own step only); and at a tracked checkpoint of
    :func:`stability_steps` also the stability context (a subset: its Lanczos runs cost more than everything
    else at a point)."""
    m = preset.measurement
    kept = m.controls and controls
    stability = m.stability_iterations if tracked and m.controls else 0
    return AnalysisSettings(
        blocks="layer",
        batch="train",
        batches=batches,
        paired=paired,
        controls=kept,
        held_out=kept,
        stability=stability,
        factorial=kept and m.factorial,
        gauss_newton=paired and m.gauss_newton,
    )


def track_steps(preset: Preset) -> list[int]:
    """The tracked checkpoints' steps: every ``track_interval``."""
    interval = preset.measurement.track_interval
    return list(range(interval, preset.training.steps + 1, interval))


def stability_steps(preset: Preset) -> list[int]:
    """The tracked steps that take the controls' held-out H and stability context: every
    ``stability_interval`` steps inside the stable phase (the aggregates read no other)."""
    m, tr = preset.measurement, preset.training
    if not m.controls:
        return []
    inside = range(tr.warmup_steps, tr.stable_end() + 1)
    return [k for k in track_steps(preset) if k % m.stability_interval == 0 and k in inside]


def read_steps(checkpoints: list[Checkpoint], steps: list[int], plateau: float, warmup: int) -> list[int]:
    """Of ``steps``, those whose checkpoint a claim or control reads: in the stable phase, off the unigram
    plateau (a loss below ``plateau``) and after ``warmup`` (:meth:`~curvlab.studies.records.TrackRecord.after_warmup`'s
    rule, decided before the analysis from the run's index)."""
    read = {c.step for c in checkpoints if c.phase == "stable" and c.val_loss < plateau and c.step >= warmup}
    return [k for k in steps if k in read]


def train_arm(job: Job, preset: Preset, data: dict[float, Path], s: float, arm: str, seed: int, chosen) -> Path:
    """Train one measured run. It carries a shadow of the other arm (docs/science.md section 11): an AdamW
    run a Muon momentum at Muon's chosen lr, a Muon run Adam's moments at AdamW's; and its twins where the
    controls read them (:func:`controlled`)."""
    run = run_dir(job.out, s, arm, seed)
    tr = preset.training
    every = tr.ckpt_every if s == preset.language.s_values[0] else tr.sweep_ckpt_every
    options = {k: v for k, v in chosen[arm].items() if k in ("lr", "adam_lr", "hidden_lr")}
    other = "muon" if ARMS[arm].optimizer == "adamw" else "adamw"
    # the shadow steps the hidden matrices only: an AdamW shadow takes AdamW's lr on them, its hidden_lr if set
    shadow_lr = chosen[other].get("hidden_lr", chosen[other]["lr"])
    shadow = {"shadow": True, "shadow_options": {"lr": shadow_lr}, "controls": controlled(preset, s, arm)}
    schedule = {"optimizer_options": options, "eval_every": every, "ckpt_every": every}
    cfg = train_config(preset, data[s], run, arm, seed, **schedule, **shadow)
    with job.clock("train"):
        train(cfg, progress=job.progress)
    return run


def compare(job: Job, preset: Preset, name: str, seed: int, runs: tuple[Path, Path], plateau: float, out: str):
    """One matched comparison at the first s (``name`` "adamw/<arm>", or "<arm>/<arm>" for an A/A pair
    of two seeds) as a :class:`ComparisonRecord`, or the reason there is none."""
    s0 = preset.language.s_values[0]
    first, second = name.split("/")
    batches = preset.aa_batches if first == second else preset.measurement.analysis_batches
    criteria = replace(preset.measurement.matching, plateau_ceiling=plateau)
    analysis = job.out / "analysis"
    # an A/A comparison feeds the between-run claims only, which read each run's own step: no shadow (the
    # shadow's direction was half its cost, and quick's A/A were 188 of its 315 s of comparisons)
    how = settings(preset, batches, controls=name == PRIMARY_COMPARISON, paired=first != second)
    try:
        with job.clock("compare"):
            c = compare_runs(*runs, analysis / out, criteria, how, progress=job.progress, cache=analysis / "reports")
        return ComparisonRecord(name, seed, s0, c)
    except NoMatchedLevel as e:  # no stable phase, no overlap, no level within tolerance (a broken file raises)
        job.say(f"{name} seed {seed}: no comparison ({e})")
        return ComparisonRecord(name, seed, s0, None, str(e))


def track(job: Job, preset: Preset, s: float, arm: str, seed: int, plateau: float) -> TrackRecord:
    """The trajectory of one run: every tracked checkpoint analysed (with ``track_points`` "read", those inside
    the stable phase and off the unigram plateau alone: what the claims and controls read), the stability
    context where due."""
    m, tr = preset.measurement, preset.training
    run = run_dir(job.out, s, arm, seed)
    steps = track_steps(preset)
    if m.track_points == "read":
        steps = read_steps(run_checkpoints(run), steps, plateau, tr.warmup_steps)
        if not steps:
            return TrackRecord(arm, s, seed, tr.steps, tr.warmup_steps, [])
    keeps = controlled(preset, s, arm)
    tracked = dict.fromkeys(stability_steps(preset) if keeps else [], settings(preset, m.track_batches, True))
    plain = settings(preset, m.track_batches, controls=keeps)
    where = {"cache": job.out / "analysis" / "reports", "steps": steps, "plateau_ceiling": plateau}
    where |= {"progress": job.progress, "settings_at": tracked}
    analysis = job.out / "analysis" / f"track-{s_name(s)}-{arm}-seed{seed}"
    with job.clock("track"):
        rows = track_run(run, analysis, plain, **where)
    return TrackRecord(arm, s, seed, tr.steps, tr.warmup_steps, rows)


def measure_seed(
    job: Job, preset: Preset, seed: int, data: dict[float, Path], tuning: TuningRecord, plateaus: dict[float, float]
) -> tuple[LevelData, TuningRecord]:
    """Everything measured on one measurement seed (``analysis/seed<k>.json``; a re-run reads it): its runs
    at every s, AdamW against each Muon arm at matched loss, the trajectories, and the A/A comparisons
    whose later seed this is (:meth:`~curvlab.studies.design.Preset.aa_seed_pairs`).

    Returns:
        The seed's :class:`LevelData`, and ``tuning`` with the control arm's lr, which the first seed that
        trains the control arm sets (and saves in ``tuning.json``).
    """
    path = job.out / "analysis" / f"seed{seed}.json"
    if path.is_file():
        return LevelData.load(path), tuning
    s_values = preset.language.s_values
    s0 = s_values[0]
    for s in s_values:
        for arm in preset.arms_at(s):
            if arm != CONTROL_ARM:
                train_arm(job, preset, data, s, arm, seed, tuning.chosen)
    adamw = run_dir(job.out, s0, "adamw", seed)
    muon = run_dir(job.out, s0, "muon", seed)
    records = [compare(job, preset, "adamw/muon", seed, (adamw, muon), plateaus[s0], f"compare-muon-seed{seed}")]
    if CONTROL_ARM in preset.arms:
        if CONTROL_ARM not in tuning.chosen:  # the first seed sets it; later seeds and re-runs read it back
            lr = control_lr(preset, records[0], tuning.chosen)
            tuning = job.save_tuning(replace(tuning, chosen={**tuning.chosen, CONTROL_ARM: lr}))
            job.say(f"{CONTROL_ARM}: lr set to {lr['lr']:g} (AdamW's hidden ||Z||)")
        for s in (s for s in s_values if CONTROL_ARM in preset.arms_at(s)):
            train_arm(job, preset, data, s, CONTROL_ARM, seed, tuning.chosen)
        control = (adamw, run_dir(job.out, s0, CONTROL_ARM, seed))
        name = f"compare-{CONTROL_ARM}-seed{seed}"
        records.append(compare(job, preset, f"adamw/{CONTROL_ARM}", seed, control, plateaus[s0], name))
    tracks = [track(job, preset, s, arm, seed, plateaus[s]) for s in s_values for arm in preset.sweep_arms]
    for first, second in (pair for pair in preset.aa_seed_pairs() if pair[1] == seed):
        for arm in ("adamw", "muon"):
            pair = (run_dir(job.out, s0, arm, first), run_dir(job.out, s0, arm, second))
            name = f"aa-{arm}-seed{first}-{second}"
            records.append(compare(job, preset, f"{arm}/{arm}", seed, pair, plateaus[s0], name))
    result = LevelData(records, tracks, plateaus[s0], list(s_values))
    result.save(path)
    return result, tuning


def prune_seed(job: Job, preset: Preset, seed: int, levels: list[LevelData]) -> None:
    """Delete the checkpoints of ``seed``'s runs but each run's last (and, with ``keep="windows"``, the
    matched windows' members), once all its analyses (the A/A ones with its neighbours included, in
    ``levels``) are done and saved: every number is then in ``analysis/seed<k>.json``, which a re-run
    reads, and every analysed checkpoint's report stays in ``analysis/reports`` for a look. An analysis
    with other settings needs the checkpoints again (a report's cache key names its checkpoint file):
    use ``keep="all"`` for that."""
    keep_rule = preset.measurement.keep
    if keep_rule == "all":
        return
    keep = set()
    if keep_rule == "windows":
        keep = window_checkpoints([r for lv in levels for r in lv.comparisons], job.out / "analysis" / "reports")
    freed = 0
    for s in preset.language.s_values:
        for arm in preset.arms_at(s):
            run = run_dir(job.out, s, arm, seed)
            if run.is_dir():
                freed += prune_run(run, keep)
    if freed:
        job.say(f"seed {seed}: deleted {freed / 2**20:.0f} MB of checkpoints (keeping {keep_rule})")


def measure_seeds(
    job: Job, preset: Preset, seeds: list[int], data: dict[float, Path], tuning: TuningRecord, plateaus
) -> tuple[LevelData, TuningRecord]:
    """:func:`measure_seed` for every seed in turn, a safe point after each, and each seed's checkpoints
    pruned as soon as no later comparison reads them (an A/A pair reads its earlier seed's).

    Returns:
        The seeds' measurements as one :class:`LevelData` (what ``levels.json`` holds), and the tuning
        with the control arm's lr.
    """
    per_seed: list[LevelData] = []
    paired = bool(preset.aa_seed_pairs())
    for k, seed in enumerate(seeds):
        levels, tuning = measure_seed(job, preset, seed, data, tuning, plateaus)
        per_seed.append(levels)
        job.safe_point(f"seed {seed}'s analysis")
        if not paired:
            prune_seed(job, preset, seed, per_seed[-1:])
        elif k > 0:  # the earlier seed's last analysis (its A/A with this one) is done
            prune_seed(job, preset, seeds[k - 1], per_seed[-2:])
    if paired:
        prune_seed(job, preset, seeds[-1], per_seed[-1:])
    s_values = list(preset.language.s_values)
    comparisons = [r for lv in per_seed for r in lv.comparisons]
    return LevelData(comparisons, [t for lv in per_seed for t in lv.tracks], plateaus[s_values[0]], s_values), tuning
