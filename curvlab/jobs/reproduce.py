"""The main job: reproduce the paper's curvature analysis end to end, fairly, from data to report.

Stages, each skipped when its output already exists with the same settings (so an interrupted run,
started again, continues from what is done), each timed (``timing.json``):

1. data: Zipf-PCFG at each s (training at s, validation at s = 0), and each s's unigram plateau: the
   validation loss of a model that learned only that s's training frequencies;
2. tune, at the first s, on tuning seeds disjoint from the measured ones and at the compared horizon:
   AdamW's and Muon's learning rates, either from the committed table (``lr_source="table"``, made by
   the full search, :func:`search_lr_table`) and checked on a 3-point grid, or by the full search here
   (log2 grids extended while the best point sits at an edge, :mod:`curvlab.studies.tuning`). Muon's AdamW
   side is tied to AdamW's lr, or tuned on its own grid (``adam_side``). The step-size control arm
   (Muon with RMS-matched scaling, ``scale="moonlight"``) is not tuned: its lr is *set* so that its
   hidden ||Z|| equals AdamW's at the first seed's matched levels (:meth:`Reproduction.control_lr`);
3. per measurement seed (``analysis/seed<k>.json``): every arm's run at the first s and AdamW and Muon
   at the other s, all under a warmup-stable-decay schedule; AdamW against each Muon arm at matched
   validation loss inside the stable phase (:mod:`curvlab.runs.match`, each level averaged over a window
   of checkpoints that no other level shares); the trajectories (every ``stability_interval`` steps with
   the controls' held-out H, lambda_max and injected directions); and the A/A comparisons whose later
   seed this is (AdamW vs AdamW, Muon vs Muon: neighbouring or disjoint seed pairs, ``aa_pairs``), which
   calibrate the verdicts. Every run keeps its twins (``controls``), measured at every analysed point.
   Then the previous seed's checkpoints are deleted but each run's last (``keep``);
4. ``analysis/levels.json``, everything measured (:class:`curvlab.studies.records.LevelData`), and from it
   alone the headline with its intervals and verdicts (:func:`curvlab.studies.headline.headline`);
5. with a fine-tuning preset: LoRA adaptation of the first seed's AdamW model to s = 1 under the
   adapter optimizers (:mod:`curvlab.jobs.finetune`, in ``finetune/``; its section closes ``report.md``);
6. the quadratic model; 7. figures; 8. ``summary.json`` and ``report.md``.

Presets (:data:`curvlab.jobs.presets.PRESETS`): ``micro`` (the test suite's, seconds), ``quick`` (the CPU
default, ten minutes on two cores: AdamW and Muon, 6 seeds, s = 0, the paired design and its
controls), ``standard`` (CPU, about 75 minutes: 8 seeds with disjoint A/A pairs, the paper's 4412-token
grammar, the Zipf sweep and the control arm) and ``paper`` (a GPU: ``pcfg-9m`` on the s sweep, and
``gpt2-124m`` on FineWeb shards the user provides). The robustness design, quick's paired ratio across the
settings a reviewer would change, is :mod:`curvlab.jobs.robustness`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

from curvlab.analysis.targets import AnalysisSettings
from curvlab.data.dataset import generate_pcfg_dataset, unigram_plateau_nats
from curvlab.data.shards import find_shards
from curvlab.errors import CurvlabError
from curvlab.jobs.finetune import Finetune
from curvlab.jobs.job import Job
from curvlab.jobs.lr_table import LR_TABLE, LrTable, optimum_moved, read_lr_table
from curvlab.jobs.presets import ARMS, CONTROL_ARM, Preset, with_preset
from curvlab.jobs.pruning import prune_run, window_checkpoints
from curvlab.jobs.reproduction_notes import reproduction_notes
from curvlab.models.gpt import GPT, get_config
from curvlab.optim.model_optimizer import default_muon_rule
from curvlab.optim.muon import matrix_shape, muon_scale
from curvlab.output import plots
from curvlab.output import text as report
from curvlab.output.files import read_quadratic, write_quadratic
from curvlab.output.finetune_text import finetune_section
from curvlab.runs.checkpoint import read_index
from curvlab.runs.config import TrainConfig
from curvlab.runs.match import MatchCriteria, NoMatchedLevel, plateau_ceiling
from curvlab.runs.train import train
from curvlab.studies.compare import compare_runs
from curvlab.studies.controls import controls, stability
from curvlab.studies.headline import headline, taylor_counts
from curvlab.studies.primary import calibration, primary_family
from curvlab.studies.records import PRIMARY_COMPARISON, ComparisonRecord, LevelData, TrackRecord
from curvlab.studies.summary import FinewebRecord, QuadraticRecord, Summary
from curvlab.studies.track import track_run
from curvlab.studies.tuning import LrSearch, TuningRecord, TuningSettings, log2_grid
from curvlab.theory.quadratic import QuadraticStudy, quadratic_study
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_text
from curvlab.util.safe_stop import stop_at_safe_points
from curvlab.util.versions import SoftwareVersions


def _s_name(s: float) -> str:
    return f"s{s:g}"


def search_lr_table(preset: Preset, out: str | Path, progress: bool = True) -> dict[str, Any]:
    """The committed table's entry for ``preset``, made by the full protocol: ``grid_points``-point log2
    grids extended at their edges, 2 tuning seeds per point (disjoint from the measured ones), runs at the
    compared horizon. Writes it into :data:`LR_TABLE` (other presets' entries are kept)."""
    full = replace(
        preset, lr_source="search", tuning=replace(preset.tuning, tune_seeds=max(2, preset.tuning.tune_seeds))
    )
    if set(full.tuning_seeds()) & set(full.check_seed_list()):
        raise CurvlabError(f"the table's seeds {full.tuning_seeds()} overlap the check's {full.check_seed_list()}")
    job = Reproduction(full, out, progress=progress)
    job._check_config()
    tuning = job.tune(job.data()[full.s_values[0]])
    entry = {
        "fingerprint": preset.tuning_fingerprint(),
        "chosen": {arm: tuning.chosen[arm] for arm in ("adamw", "muon")},
        "seeds": tuning.seeds,
        "horizon_steps": tuning.horizon_steps,
        "adam_side": tuning.adam_side,
        "searches": {k: v.to_dict() for k, v in tuning.searches.items()},
    }
    schema.save(LR_TABLE, LrTable({**read_lr_table(), preset.name: entry}))
    return entry


def muon_shapes(model: str, overrides: dict[str, Any]) -> list[tuple[int, int]]:
    """The (rows, cols) of every matrix Muon updates in a curvlab GPT (by structural role)."""
    net = GPT(get_config(model, **overrides))
    use_muon = default_muon_rule(net)
    return [matrix_shape(q) for n, q in net.named_parameters() if use_muon(n, q)]


def muon_norm_per_lr(shapes: list[tuple[int, int]], scale: str) -> float:
    r""":math:`\|Z\|_F / \eta` of a Muon step with an exactly orthogonal factor: each matrix
    contributes :math:`s_i^2 \min(m_i, n_i)` (its polar factor has that many unit singular values)."""
    return math.sqrt(sum(muon_scale(shape, scale) ** 2 * min(shape) for shape in shapes))


class Reproduction(Job):
    """One reproduction in one output directory (see the module docstring)."""

    TAG = "reproduce"
    CONFIG_FILE = "reproduce.json"
    PATH_KEYS = ("fineweb",)

    def __init__(self, preset: Preset, out: str | Path, fineweb: str | Path | None = None, progress: bool = True):
        preset.validate()
        super().__init__(out, progress)
        self.preset = preset
        self.fineweb = Path(fineweb).resolve() if fineweb else None  # (resolved, as Job.out)
        if preset.fineweb:
            if self.fineweb is None:
                raise CurvlabError("the paper preset trains gpt2-124m on FineWeb: pass --fineweb DIR with its shards")

            for split in ("train", "val"):  # fail now, not after hours of training
                find_shards(self.fineweb, split)
        self.tuning: TuningRecord | None = None  # set by tune(); the first seed adds the control arm's lr

    # -- bookkeeping ------------------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        preset = asdict(self.preset)
        del preset["keep"]  # what stays on disk changes no result: a re-run may prune further
        if not preset["grammar_seed"]:  # the first draw: a directory made before the field existed continues
            del preset["grammar_seed"]
        return {"preset": preset, "fineweb": str(self.fineweb) if self.fineweb else None}

    def what(self) -> str:
        return f"the results of preset {self.preset.name!r}"

    def tuning_settings(self) -> TuningSettings:
        return self.preset.tuning_settings

    def _train_config(self, data: Path, out: Path, arm: str, options: dict[str, Any], seed: int, **overrides):
        p = self.preset
        fields = dict(
            data=str(data), out=str(out), model=p.model, model_overrides=dict(p.model_overrides),
            optimizer=ARMS[arm].optimizer, optimizer_options={**ARMS[arm].options, **options},
            batch_size=p.batch_size, steps=p.steps, warmup_steps=p.warmup_steps, schedule=p.schedule,
            cooldown_frac=p.cooldown_frac, eval_every=p.ckpt_every, ckpt_every=p.ckpt_every,
            val_windows=p.val_windows, seed=seed, device=p.device,
        )  # fmt: skip
        fields.update(overrides)
        return TrainConfig(**fields)

    # -- stages -----------------------------------------------------------------------------

    def data(self) -> dict[float, Path]:
        p = self.preset
        dirs = {}
        for s in p.s_values:
            d = self.out / "data" / _s_name(s)
            generate_pcfg_dataset(
                d, s=s, tokens=p.tokens, val_tokens=p.val_tokens, val_s=0.0, seed=p.grammar_seed,
                grammar_options=p.grammar, progress=self.progress,
            )  # fmt: skip
            dirs[s] = d
        self._say(f"data ready: s = {', '.join(f'{s:g}' for s in p.s_values)}")
        return dirs

    def _short_run(self, data: Path, run: Path, arm: str, options: dict[str, float], seed: int, steps: int) -> float:
        cfg = self._train_config(data, run, arm, options, seed, steps=steps, eval_every=steps, ckpt_every=steps)
        return train(cfg, progress=self.progress).val_loss

    def tune(self, data: Path) -> TuningRecord:
        """AdamW's and Muon's learning rates at the first s (module docstring): the full search
        (``lr_source="search"``, or a preset the table lacks) or the committed table's values, checked
        on a ``check_points`` grid around each. The step-size control arm is not tuned: its lr is set
        later (:meth:`control_lr`)."""
        p = self.preset
        self.tuning = self.saved_tuning()
        if self.tuning is not None:
            return self.tuning
        table = read_lr_table().get(p.name) if p.lr_source == "table" else None
        fallback = None
        if table is not None and table.get("fingerprint") != p.tuning_fingerprint():
            table, fallback = None, "the committed table's entry was made under other settings"
        elif table is None and p.lr_source == "table":
            fallback = "the committed table has no entry for this preset"
        if fallback:
            self._say(f"{fallback}: the full search runs here")
        searches: dict[str, LrSearch] = {}
        seeds = p.tuning_seeds() if table is None else p.check_seed_list()
        t = p.tuning_settings
        if table is None:
            mode = "search"
            searches["adamw.lr"] = self._search(data, "adamw", "lr", t.grid("adamw"), {}, t.max_extensions, seeds)
            chosen = {"adamw": {"lr": searches["adamw.lr"].chosen}}
            adam_lr = chosen["adamw"]["lr"]
            s = searches["muon.lr"] = self._search(
                data, "muon", "lr", t.grid("muon"), {"adam_lr": adam_lr}, t.max_extensions, seeds
            )
            chosen["muon"] = {"lr": s.chosen, "adam_lr": adam_lr}
            if p.adam_side == "tuned":  # a second, one-dimensional search at the chosen Muon lr
                s = searches["muon.adam_lr"] = self._search(
                    data, "muon", "adam_lr", log2_grid(adam_lr, t.grid_points), {"lr": chosen["muon"]["lr"]},
                    t.max_extensions, seeds,
                )  # fmt: skip
                chosen["muon"]["adam_lr"] = s.chosen
            moved = {}
        else:  # the pre-registered values, and a check that the optimum has not moved
            mode = "table"
            if set(seeds) & set(table["seeds"]):
                raise CurvlabError(f"check seeds {seeds} overlap the table's {table['seeds']}: raise check_seed_base")
            chosen = {arm: dict(table["chosen"][arm]) for arm in ("adamw", "muon")}
            moved = {}
            for arm in ("adamw", "muon"):
                fixed = {k: v for k, v in chosen[arm].items() if k != "lr"}
                s = searches[f"{arm}.lr"] = self._search(
                    data, arm, "lr", log2_grid(chosen[arm]["lr"], p.check_points), fixed, 0, seeds
                )
                moved[arm] = optimum_moved(s, chosen[arm]["lr"], table.get("searches", {}).get(f"{arm}.lr"))
                if moved[arm]:
                    self._say(f"{arm}: the check's best lr {s.chosen:g} beats the table's {chosen[arm]['lr']:g}")
        record = TuningRecord(
            mode, p.s_values[0], p.tuning_steps, seeds, searches, chosen, p.adam_side, fallback, table, moved
        )
        self.tuning = self.save_tuning(record)
        return self.tuning

    def control_lr(self, record: ComparisonRecord, chosen: dict[str, dict[str, float]]) -> dict[str, float]:
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
        shapes = muon_shapes(self.preset.model, self.preset.model_overrides)
        ratio = muon_norm_per_lr(shapes, "original") / muon_norm_per_lr(shapes, "moonlight")
        lr = float(f"{chosen['muon']['lr'] * (z_a / z_m) * ratio:.4g}")
        return {"lr": lr, "adam_lr": chosen["muon"]["adam_lr"], "set_from_seed": record.seed,
                "adamw_hidden_update_norm": float(z_a), "muon_hidden_update_norm": float(z_m)}  # fmt: skip

    def _run_dir(self, s: float, arm: str, seed: int) -> Path:
        return self.out / "runs" / _s_name(s) / arm / f"seed{seed}"

    def _arms_at(self, s: float) -> tuple[str, ...]:
        return self.preset.arms if s == self.preset.s_values[0] else self.preset.sweep_arms

    def _ckpt_every(self, s: float) -> int:
        return self.preset.ckpt_every if s == self.preset.s_values[0] else self.preset.sweep_ckpt_every

    def _train(self, data: dict[float, Path], s: float, arm: str, seed: int, chosen: dict[str, dict]) -> Path:
        """Train one measured run. It carries a shadow of the other arm (docs/science.md section 11): an
        AdamW run a Muon momentum at Muon's chosen lr, a Muon run Adam's moments at AdamW's; and its twins
        where the controls read them (:meth:`_controlled`)."""
        run = self._run_dir(s, arm, seed)
        every = self._ckpt_every(s)
        options = {k: v for k, v in chosen[arm].items() if k in ("lr", "adam_lr")}
        other = "muon" if ARMS[arm].optimizer == "adamw" else "adamw"
        cfg = self._train_config(
            data[s], run, arm, options, seed, eval_every=every, ckpt_every=every, shadow=True,
            shadow_options={"lr": chosen[other]["lr"]}, controls=self._controlled(s, arm),
        )  # fmt: skip
        with self.clock("train"):
            train(cfg, progress=self.progress)
        return run

    def _controlled(self, s: float, arm: str) -> bool:
        """Whether a run keeps the controls: AdamW's and Muon's at the first s, the paired claim's runs and the
        only ones the controls read (at the sweep's s and in the control arm, twins and Lanczos took a third
        of `standard`'s time and fed no number)."""
        return self.preset.controls and s == self.preset.s_values[0] and arm in ("adamw", "muon")

    def _settings(self, batches: int, tracked: bool = False, controls: bool = True) -> AnalysisSettings:
        """How a checkpoint is analysed: with the controls' directions where the preset keeps controls (not
        in the A/A and control-arm comparisons, whose points the controls don't read: the twins there
        tripled their cost), and at a tracked checkpoint of :meth:`_stability_steps` also the held-out H
        and the stability context (a subset: their Lanczos runs cost more than everything else at a point)."""
        p = self.preset
        extra = tracked and p.controls
        return AnalysisSettings(
            blocks="layer", batch="train", batches=batches, controls=p.controls and controls,
            stability=p.stability_iterations if extra else 0, held_out=extra,
        )  # fmt: skip

    def _stability_steps(self) -> list[int]:
        """The tracked steps that take the controls' held-out H and stability context: every
        ``stability_interval`` steps inside the stable phase (the aggregates read no other)."""
        p = self.preset
        stable_end = p.steps - int(p.cooldown_frac * p.steps) if p.schedule == "wsd" else p.steps
        return [
            k for k in self._track_steps()
            if p.controls and k % p.stability_interval == 0 and p.warmup_steps <= k <= stable_end
        ]  # fmt: skip

    def _criteria(self, plateau: float | None) -> MatchCriteria:
        return replace(self.preset.matching, plateau_ceiling=plateau)

    def _compare(self, name: str, seed: int, run_a: Path, run_b: Path, plateau: float, out: str) -> ComparisonRecord:
        """One matched comparison at the first s (``name`` "adamw/<arm>", or "<arm>/<arm>" for an A/A
        pair of two seeds), or the reason there is none."""
        p = self.preset
        s0 = p.s_values[0]
        first, second = name.split("/")
        batches = p.aa_batches if first == second else p.analysis_batches
        try:
            with self.clock("compare"):
                c = compare_runs(
                    run_a, run_b, self.out / "analysis" / out, self._criteria(plateau),
                    self._settings(batches, controls=name == PRIMARY_COMPARISON), progress=self.progress,
                    cache=self.out / "analysis" / "reports",
                )  # fmt: skip
            return ComparisonRecord(name, seed, s0, c)
        except NoMatchedLevel as e:  # no stable phase, no overlap, no level within tolerance (a broken file raises)
            self._say(f"{name} seed {seed}: no comparison ({e})")
            return ComparisonRecord(name, seed, s0, None, str(e))

    def _track_steps(self) -> list[int]:
        p = self.preset
        return list(range(p.track_interval, p.steps + 1, p.track_interval))

    def _track(self, s: float, arm: str, seed: int, plateau: float) -> TrackRecord:
        p = self.preset
        controlled = self._controlled(s, arm)
        stability_steps = self._stability_steps() if controlled else []
        with self.clock("track"):
            rows = track_run(
                self._run_dir(s, arm, seed), self.out / "analysis" / f"track-{_s_name(s)}-{arm}-seed{seed}",
                settings=self._settings(p.track_batches, controls=controlled), progress=self.progress,
                plateau_ceiling=plateau,
                settings_at=dict.fromkeys(stability_steps, self._settings(p.track_batches, tracked=True)),
                cache=self.out / "analysis" / "reports", steps=self._track_steps(),
            )  # fmt: skip
        return TrackRecord(arm, s, seed, p.steps, p.warmup_steps, rows)

    def seed(self, seed: int, data: dict[float, Path], tuning: TuningRecord, plateaus: dict[float, float]) -> LevelData:
        """Everything measured on one measurement seed (``analysis/seed<k>.json``; a re-run reads it):
        its runs at every s, AdamW against each Muon arm at matched loss, the trajectories, and the A/A
        comparisons whose later seed this is (:meth:`~curvlab.jobs.presets.Preset.aa_seed_pairs`). The first seed also
        sets the control arm's lr (:meth:`control_lr`), into ``tuning.json`` and :attr:`tuning`."""
        p = self.preset
        path = self.out / "analysis" / f"seed{seed}.json"
        if path.is_file():
            return LevelData.load(path)
        s0 = p.s_values[0]
        chosen = tuning.chosen
        for s in p.s_values:
            for arm in self._arms_at(s):
                if arm != CONTROL_ARM:
                    self._train(data, s, arm, seed, chosen)
        adamw = self._run_dir(s0, "adamw", seed)
        records = [self._compare("adamw/muon", seed, adamw, self._run_dir(s0, "muon", seed), plateaus[s0],
                                 f"compare-muon-seed{seed}")]  # fmt: skip
        if CONTROL_ARM in p.arms:
            if CONTROL_ARM not in chosen:  # the first seed sets it; later seeds and re-runs read it back
                chosen = {**chosen, CONTROL_ARM: self.control_lr(records[0], chosen)}
                self.tuning = self.save_tuning(replace(tuning, chosen=chosen))
                self._say(f"{CONTROL_ARM}: lr set to {chosen[CONTROL_ARM]['lr']:g} (AdamW's hidden ||Z||)")
            for s in (s for s in p.s_values if CONTROL_ARM in self._arms_at(s)):
                self._train(data, s, CONTROL_ARM, seed, chosen)
            records.append(self._compare(f"adamw/{CONTROL_ARM}", seed, adamw, self._run_dir(s0, CONTROL_ARM, seed),
                                         plateaus[s0], f"compare-{CONTROL_ARM}-seed{seed}"))  # fmt: skip
        tracks = [self._track(s, arm, seed, plateaus[s]) for s in p.s_values for arm in p.sweep_arms]
        for first, second in (pair for pair in p.aa_seed_pairs() if pair[1] == seed):
            for arm in ("adamw", "muon"):
                records.append(
                    self._compare(
                        f"{arm}/{arm}",
                        seed,
                        self._run_dir(s0, arm, first),
                        self._run_dir(s0, arm, second),
                        plateaus[s0],
                        f"aa-{arm}-seed{first}-{second}",
                    )
                )
        result = LevelData(records, tracks, plateaus[s0], list(p.s_values))
        result.save(path)
        return result

    def prune(self, seed: int, levels: list[LevelData]) -> None:
        """Delete the checkpoints of ``seed``'s runs but each run's last (and, with ``keep="windows"``, the
        matched windows' members), once all its analyses (the A/A ones with its neighbours included, in
        ``levels``) are done and saved: every number is then in ``analysis/seed<k>.json``, which a re-run
        reads, and every analysed checkpoint's report stays in ``analysis/reports`` for a look. An analysis
        with other settings needs the checkpoints again (a report's cache key names its checkpoint file):
        use ``keep="all"`` for that."""
        if self.preset.keep == "all":
            return
        keep = set()
        if self.preset.keep == "windows":
            keep = window_checkpoints([r for lv in levels for r in lv.comparisons], self.out / "analysis" / "reports")
        freed = 0
        for s in self.preset.s_values:
            for arm in self._arms_at(s):
                run = self._run_dir(s, arm, seed)
                if run.is_dir():
                    freed += prune_run(run, keep)
        if freed:
            self._say(f"seed {seed}: deleted {freed / 2**20:.0f} MB of checkpoints (keeping {self.preset.keep})")

    def fineweb_comparison(self) -> FinewebRecord | None:
        """Muon vs AdamW at the paper's learning rates on the user's FineWeb shards, compared at
        matched validation loss in the stable phase (the paper's figures 1 and 2 on its own data;
        one seed, so no interval)."""
        if self.fineweb is None:
            return None
        p = self.preset
        runs = {}
        for arm in ("muon", "adamw"):
            run = self.out / "runs" / "fineweb" / arm
            cfg = self._train_config(
                self.fineweb, run, arm, {"lr": p.fineweb_lr[arm]}, 0, model=p.fineweb_model,
                model_overrides=dict(p.fineweb_model_overrides), steps=p.fineweb_steps,
                batch_size=p.fineweb_batch_size, eval_every=p.fineweb_ckpt_every, ckpt_every=p.fineweb_ckpt_every,
            )  # fmt: skip
            train(cfg, progress=self.progress)
            runs[arm] = run
        compare = compare_runs(
            runs["adamw"], runs["muon"], self.out / "analysis" / "compare-fineweb", self._criteria(None),
            self._settings(p.analysis_batches), progress=self.progress, cache=self.out / "analysis" / "reports",
        )  # fmt: skip
        self._say(f"FineWeb: compared at {len(compare.levels)} matched levels")
        return FinewebRecord(dict(compare.ratio_of_means), len(compare.headline_levels))

    def finetune(self, runs: dict[tuple, Path]):
        """The fine-tuning comparison (:mod:`curvlab.jobs.finetune`) in ``OUT/finetune``, adapting the first
        seed's AdamW model at the first s to s = 1; ``None`` when the preset has none."""
        p = self.preset
        if p.finetune is None:
            return None
        base = runs[(p.s_values[0], "adamw", 0)]
        result = Finetune(
            replace(with_preset(p.finetune), device=p.device), self.out / "finetune", base, None, self.progress
        )
        return result.run()

    def quadratic(self) -> QuadraticStudy:
        """The quadratic model's study, read back when done before: a derived cache, so an unreadable,
        truncated or edited one (:mod:`curvlab.util.schema`'s seal) is recomputed, with a note."""
        path = self.out / "quadratic" / "quadratic.json"
        try:
            cached = read_quadratic(path)
        except CurvlabError as e:
            self._say(f"{e}; the quadratic model is recomputed")
            cached = None
        if cached is not None:
            return cached
        study = quadratic_study(**self.preset.quadratic)
        write_quadratic(study, self.out / "quadratic", figures=False)  # the report's figures draw it
        self._say("quadratic model done")
        return study

    def figures(self, data: LevelData, summary: Summary, tuning: TuningRecord, quadratic: QuadraticStudy):
        fig = self.out / "figures"
        written = plots.reproduction_figures(data, summary, tuning, quadratic, fig)
        return {k: [str(p.relative_to(self.out)) for p in v] for k, v in written.items()}

    def notes(
        self,
        tuning: TuningRecord,
        levels: LevelData | None = None,
        plateaus: dict[float, float] | None = None,
        final: dict[str, dict[str, list]] | None = None,
    ) -> list[str]:
        """The caveats the report states up front (what this preset reduced, what it tied, what the
        trajectory means leave out)."""
        return reproduction_notes(self.preset, tuning, levels, plateaus, final)

    # -- the whole job ----------------------------------------------------------------------

    def run(self) -> Summary:
        """The whole job (module docstring). A SIGINT or SIGTERM stops it at the next safe point (after
        a training step, a cached report or a seed's analysis: :mod:`curvlab.util.safe_stop`) with a
        :class:`~curvlab.util.safe_stop.Stopped`; running it again continues from what is saved."""
        with stop_at_safe_points():
            return self._run()

    def _run(self) -> Summary:
        self.start()
        p = self.preset
        with self.clock("data"):
            data = self.data()
        s0 = p.s_values[0]
        # a model that has learned only its training frequencies scores this on the s = 0 validation data
        plateaus = {s: plateau_ceiling(unigram_plateau_nats(data[s]), p.plateau_fraction) for s in p.s_values}
        with self.clock("tune"):
            tuning = self.tune(data[s0])
        per_seed: list[LevelData] = []
        for seed in range(p.seeds):
            per_seed.append(self.seed(seed, data, self.tuning, plateaus))
            self.safe_point(f"seed {seed}'s analysis")
            if seed > 0:  # the previous seed's last analysis (its A/A with this one) is done
                self.prune(seed - 1, per_seed[-2:])
        self.prune(p.seeds - 1, per_seed[-1:])
        levels = LevelData(
            [r for lv in per_seed for r in lv.comparisons], [t for lv in per_seed for t in lv.tracks],
            plateaus[s0], list(p.s_values),
        )  # fmt: skip
        levels.save(self.out / "analysis" / "levels.json")
        runs = {(s, arm, seed): self._run_dir(s, arm, seed) for s in p.s_values for arm in self._arms_at(s)
                for seed in range(p.seeds)}  # fmt: skip
        with self.clock("finetune"):
            finetune = self.finetune(runs)
        with self.clock("fineweb"):
            fineweb = self.fineweb_comparison()
        with self.clock("quadratic"):
            quadratic = self.quadratic()
        with self.clock("summary"):
            entries, zipf = headline(levels)
            primary, calibrated = (
                primary_family(levels, judged=p.primary),
                calibration(levels.comparisons, data=levels, pairs=p.aa_seed_pairs()),
            )
            checks, context = controls(levels), stability(levels)
        final = {}
        for (s, arm, _), run in runs.items():
            index = read_index(run)
            final.setdefault(f"{s:g}", {}).setdefault(arm, []).append(index[-1]["val_loss"] if index else None)
        tuning = self.tuning  # with the control arm's lr, once the first seed set it
        notes = self.notes(tuning, levels, plateaus, final)
        summary = Summary(
            p.name, entries, zipf, taylor_counts(levels), tuning, notes, final, QuadraticRecord.from_study(quadratic),
            fineweb=fineweb, primary=primary, calibration=calibrated, versions=SoftwareVersions.current(),
            controls=checks, edge_of_stability=context,
        )  # fmt: skip
        with self.clock("figures"):
            summary.figures = self.figures(levels, summary, tuning, quadratic)
        summary.timing = self.timing()
        summary.seconds = summary.timing["total"]  # over every invocation, when a run was interrupted and resumed
        summary.invocations = int(summary.timing["invocations"])
        summary.disk_bytes = sum(f.stat().st_size for f in self.out.rglob("*") if f.is_file())
        schema.save(self.out / "summary.json", summary)  # NaN as null (strict JSON), sealed
        text = report.render_report(summary, levels)
        if finetune is not None:
            text += "\n" + "\n".join(finetune_section(finetune)) + "\n"
        atomic_write_text(self.out / "report.md", text)
        mb = summary.disk_bytes / 2**20
        self._say(f"done in {summary.seconds:.0f} s, {mb:.0f} MB left on disk: {self.out / 'report.md'}")
        return summary
