"""The main job: reproduce the paper's curvature analysis end to end, fairly, from data to report.

Stages, each skipped when its output already exists with the same settings (so an interrupted run,
started again, continues from what is done), each timed (``timing.json``):

1. data: Zipf-PCFG at each s (training at s, validation at s = 0);
2. tune: at the first s, each optimizer arm's learning rate on a log2 grid of short runs with the
   same schedule shape, several seeds per point, the grid extended while its best point sits at an
   edge (:mod:`curvlab.tuning`). The arms are AdamW, Muon (the hybrid: Muon on the hidden matrices,
   AdamW on the rest) and the step-size control Muon with RMS-matched scaling (``scale="moonlight"``),
   all tuned alike. The hybrids' Adam-side learning rate is tied to AdamW's tuned value, or tuned on
   its own grid (``adam_side``); ``tuning.json`` holds every grid;
3. train: every arm and seed at the first s (dense checkpoints, for matched levels), AdamW and Muon
   at the other s (for trajectories), all with a warmup-stable-decay schedule;
4. compare: per seed, AdamW against each Muon arm at matched validation loss inside the stable
   phase (:mod:`curvlab.match`), each level averaged over a window of neighbouring checkpoints;
5. track: AdamW and Muon along their trajectories at every s (the Zipf sweep, rho_within over
   training, the equal-step comparison);
6. ``analysis/levels.json``, everything measured (:class:`curvlab.results.LevelData`), and from it
   alone the headline with bootstrap intervals and verdicts (:func:`curvlab.results.headline`);
7. with a fine-tuning preset (``micro``, ``standard``, ``paper``): LoRA adaptation of the first seed's
   AdamW model to s = 1 under the adapter optimizers (:mod:`curvlab.finetune`, in ``finetune/``; its
   section closes ``report.md``);
8. the quadratic model; 9. figures; 10. ``summary.json`` and ``report.md``.

Presets: ``micro`` (the test suite's, seconds), ``quick`` (the CPU default, ten minutes on two cores:
everything at reduced size), ``standard`` (CPU, within an hour: three seeds, the paper's 4412-token
grammar) and ``paper`` (a GPU: ``pcfg-9m`` on the s sweep, and ``gpt2-124m`` on FineWeb shards the
user provides).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from curvlab.analysis import AnalysisSettings
from curvlab.atomic import atomic_write_text
from curvlab.checkpoint import read_index
from curvlab.data.dataset import generate_pcfg_dataset, read_stats
from curvlab.errors import CurvlabError
from curvlab.jobs import StageClock, guard_config, record_invocation
from curvlab.match import PLATEAU_FRACTION, plateau_ceiling
from curvlab.models.gpt import MICRO_OVERRIDES, get_config
from curvlab.paper import REFERENCE_TRAINING
from curvlab.results import ComparisonRecord, LevelData, Summary, TrackRecord, headline, taylor_counts
from curvlab.studies import compare_runs, track_run
from curvlab.train import TrainConfig, TrainingDiverged, train
from curvlab.tuning import TUNING_SCHEMA_VERSION, LrSearch, log2_grid, search_lr

ADAM_SIDES = ("tied", "tuned")


@dataclass(frozen=True)
class Arm:
    """One optimizer as compared: a ``build_optimizer`` name and the options that set it apart."""

    name: str
    optimizer: str
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def hybrid(self) -> bool:
        """Muon on the hidden matrices with an AdamW side (whose lr is ``adam_lr``)."""
        return self.optimizer == "muon"


ARMS = {
    "adamw": Arm("adamw", "adamw"),
    "muon": Arm("muon", "muon"),
    # the step-size control: RMS-matched scaling 0.2 sqrt(max(rows, cols)) (SCIENCE.md section 10, width)
    "muon-moonlight": Arm("muon-moonlight", "muon", {"scale": "moonlight"}),
}


@dataclass(frozen=True)
class Preset:
    name: str
    model: str = "tiny"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    s_values: tuple[float, ...] = (0.0, 0.5, 1.0)
    grammar: dict[str, Any] = field(default_factory=dict)  # make_grammar options (e.g. a smaller vocabulary)
    tokens: str = "2M"
    val_tokens: str = "100k"
    steps: int = 200
    batch_size: int = 16
    warmup_steps: int = 10
    schedule: str = "wsd"
    cooldown_frac: float = 0.2
    seeds: int = 3  # per arm, for the headline
    arms: tuple[str, ...] = ("adamw", "muon", "muon-moonlight")  # at the first s
    sweep_arms: tuple[str, ...] = ("adamw", "muon")  # at every s
    ckpt_every: int = 2  # at the first s: matched levels at a 1% tolerance need dense checkpoints
    sweep_ckpt_every: int = 10  # at the other s (trajectories only)
    val_windows: int = 64
    # tuning (at the first s)
    lr_centers: dict[str, float] = field(
        default_factory=lambda: {"adamw": 0.004, "muon": 0.02, "muon-moonlight": 0.004}
    )
    grid_points: int = 5
    tune_seeds: int = 2
    tune_steps: int = 100
    max_extensions: int = 3
    adam_side: str = "tied"  # the hybrids' Adam-side lr: tied to AdamW's tuned lr, or tuned on its own grid
    # matched comparison
    phase: str = "stable"
    plateau_fraction: float = PLATEAU_FRACTION  # levels within this fraction of the unigram entropy are flagged
    compare_levels: int = 6
    tolerance: float = 0.01
    window: int = 1  # neighbours on each side of a matched checkpoint
    analysis_batches: int = 4  # G, H and ΔD on the step's batch and the next ones
    # trajectories
    track_interval: int = 20  # steps between tracked checkpoints
    track_batches: int = 2
    n_boot: int = 2000  # bootstrap replicates per interval
    quadratic: dict[str, Any] = field(default_factory=dict)
    finetune: str | None = None  # a `curvlab finetune` preset, run on the first seed's AdamW model at the first s
    fineweb: bool = False  # the paper preset also trains gpt2-124m on FineWeb shards
    fineweb_model: str = "gpt2-124m"
    fineweb_model_overrides: dict[str, Any] = field(default_factory=dict)
    fineweb_steps: int = REFERENCE_TRAINING["steps"]  # SCIENCE.md section 4: the modded-nanogpt comparison
    fineweb_batch_size: int = 512  # x 1024 tokens = 524k tokens per step
    fineweb_lr: dict[str, float] = field(default_factory=lambda: dict(_PAPER_LR))
    fineweb_ckpt_every: int = 250  # a gpt2-124m checkpoint with AdamW state is ~1.5 GB
    device: str = "auto"

    def validate(self) -> None:
        if self.adam_side not in ADAM_SIDES:
            raise CurvlabError(f"adam_side must be one of {', '.join(ADAM_SIDES)}, got {self.adam_side!r}")
        unknown = sorted(set(self.arms) - set(ARMS))
        if unknown or "adamw" not in self.arms or "muon" not in self.arms:
            raise CurvlabError(f"arms must include adamw and muon, from {', '.join(ARMS)}; got {self.arms}")
        if not set(self.sweep_arms) <= set(self.arms):
            raise CurvlabError(f"sweep_arms {self.sweep_arms} must be among arms {self.arms}")
        for name, every in (("ckpt_every", self.ckpt_every), ("sweep_ckpt_every", self.sweep_ckpt_every)):
            if self.track_interval % every:
                raise CurvlabError(f"track_interval {self.track_interval} is not a multiple of {name} {every}")
        if self.seeds < 1 or self.tune_seeds < 1 or self.grid_points < 2:
            raise CurvlabError("a preset needs seeds >= 1, tune_seeds >= 1 and grid_points >= 2")


_PAPER_LR = {arm: REFERENCE_TRAINING[arm]["lr"] for arm in ("muon", "adamw")}
PRESETS = {
    "micro": Preset(
        "micro",
        model_overrides=MICRO_OVERRIDES,
        s_values=(0.0, 1.0),
        grammar={"n_tokens": 300},
        tokens="100k",
        val_tokens="10k",
        steps=20,
        batch_size=8,
        warmup_steps=2,
        seeds=2,
        ckpt_every=2,
        sweep_ckpt_every=5,
        val_windows=16,
        plateau_fraction=-0.2,  # its toy runs never leave the unigram plateau: flag only far above it
        lr_centers={"adamw": 0.008, "muon": 0.04, "muon-moonlight": 0.008},
        grid_points=2,
        tune_seeds=1,
        tune_steps=4,
        max_extensions=1,
        compare_levels=2,
        tolerance=0.05,
        window=1,
        analysis_batches=1,
        track_interval=10,
        track_batches=1,
        n_boot=200,
        finetune="micro",
        quadratic={
            "steps": 8,
            "fixed_lr_steps": 10,
            "sweep_steps": 8,
            "rhos": (2.0, 20.0, 200.0),
            "alphas": (0.1, 0.3),
            "ratios": (1.0, 2.0),
        },
        device="cpu",
    ),
    # A 1024-token version of the grammar: with the paper's 4412 tokens, 70% of `tiny` is embedding and
    # head, and two CPUs for a few minutes don't get it past unigram statistics. Reduced sizes
    # throughout (2 seeds, s = 0 and 1, short tuning runs, 1 evaluation batch per checkpoint): the
    # report says so, and `standard` runs the full design.
    "quick": Preset(
        "quick",
        model_overrides={"vocab_size": 1088},
        grammar={"n_tokens": 1024},
        s_values=(0.0, 1.0),
        steps=200,
        seeds=2,
        tune_steps=100,
        analysis_batches=1,
        track_interval=20,
        track_batches=1,
        device="cpu",
    ),
    # The full design on the paper's 4412-token grammar (three seeds, s = 0, 0.5, 1, four evaluation
    # batches per checkpoint), on a CPU within an hour.
    "standard": Preset(
        "standard",
        model_overrides={"vocab_size": 4416},
        tokens="4M",
        val_tokens="200k",
        steps=400,
        seeds=3,
        ckpt_every=4,
        sweep_ckpt_every=20,
        val_windows=64,
        tune_steps=150,
        analysis_batches=4,
        track_interval=40,
        track_batches=1,  # a trajectory mean already averages 10 checkpoints
        # the quick-sized adaptation (about 6 minutes) keeps the preset within the hour; the full
        # fine-tuning design is `curvlab finetune --preset standard` (about half an hour on its own)
        finetune="quick",
        device="cpu",
    ),
    "paper": Preset(
        "paper",
        model="pcfg-9m",
        tokens="200M",
        val_tokens="5M",
        steps=5000,
        batch_size=64,
        warmup_steps=100,
        seeds=3,
        ckpt_every=50,
        sweep_ckpt_every=250,
        val_windows=512,
        # the paper's learning rates; the RMS-matched Muon's steps are AdamW-sized, so it starts from AdamW's
        lr_centers={"adamw": _PAPER_LR["adamw"], "muon": _PAPER_LR["muon"], "muon-moonlight": _PAPER_LR["adamw"]},
        tune_steps=1000,
        adam_side="tuned",
        compare_levels=10,
        window=2,
        track_interval=250,
        track_batches=4,
        finetune="standard",
        fineweb=True,
    ),
}


def _s_name(s: float) -> str:
    return f"s{s:g}"


def unigram_entropy_nats(data_dir: str | Path) -> float:
    """The unigram entropy of a Zipf-PCFG data directory's validation tokens, in nats: the loss of a
    model that has learned only token frequencies (the unigram plateau)."""
    return read_stats(data_dir)["val"]["entropy_bits"] * math.log(2)


class Reproduction:
    """One reproduction in one output directory (see the module docstring)."""

    def __init__(self, preset: Preset, out: str | Path, fineweb: str | Path | None = None, progress: bool = True):
        preset.validate()
        self.preset, self.out, self.progress = preset, Path(out), progress
        self.fineweb = Path(fineweb) if fineweb else None
        if preset.fineweb:
            if self.fineweb is None:
                raise CurvlabError("the paper preset trains gpt2-124m on FineWeb: pass --fineweb DIR with its shards")
            from curvlab.data.shards import find_shards

            for split in ("train", "val"):  # fail now, not after hours of training
                find_shards(self.fineweb, split)
        self.log: list[str] = []
        self.clock = StageClock()

    # -- bookkeeping ------------------------------------------------------------------------

    def _check_config(self) -> None:
        config = {"preset": asdict(self.preset), "fineweb": str(self.fineweb) if self.fineweb else None}
        guard_config(self.out / "reproduce.json", config, f"the results of preset {self.preset.name!r}")

    def _say(self, message: str) -> None:
        self.log.append(message)
        if self.progress:
            print(f"[reproduce] {message}", flush=True)

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
                d, s=s, tokens=p.tokens, val_tokens=p.val_tokens, val_s=0.0, grammar_options=p.grammar,
                progress=self.progress,
            )  # fmt: skip
            dirs[s] = d
        self._say(f"data ready: s = {', '.join(f'{s:g}' for s in p.s_values)}")
        return dirs

    def _tuning_loss(self, data: Path, arm: str, options: dict[str, float], seed: int) -> float:
        """The final validation loss of one short tuning run (+inf if it diverges); its checkpoints
        are deleted once it is done (the index, config and metrics stay)."""
        p = self.preset
        tag = "-".join(f"{k}{v:g}" for k, v in sorted(options.items()))
        run = self.out / "runs" / "tune" / arm / f"{tag}-seed{seed}"
        diverged = run / "diverged.json"
        if diverged.is_file():
            return math.inf
        index = read_index(run)
        if index and index[-1]["step"] == p.tune_steps and not (run / index[-1]["path"]).exists():
            return float(index[-1]["val_loss"])  # finished before; its checkpoints were cleaned up
        cfg = self._train_config(
            data, run, arm, options, seed, steps=p.tune_steps, eval_every=p.tune_steps, ckpt_every=p.tune_steps
        )
        try:
            loss = train(cfg, progress=self.progress).val_loss
        except TrainingDiverged as e:
            atomic_write_text(diverged, json.dumps({"error": str(e)}))
            loss = math.inf
        for ckpt in run.glob("ckpt_*.pt"):
            ckpt.unlink()
        return loss if math.isfinite(loss) else math.inf

    def tune(self, data: Path) -> dict[str, Any]:
        """Every arm's learning rate on an extended log2 grid at the first s (module docstring)."""
        p = self.preset
        path = self.out / "tuning.json"
        if path.is_file():
            return json.loads(path.read_text())
        seeds = list(range(p.tune_seeds))
        searches: dict[str, LrSearch] = {}
        chosen: dict[str, dict[str, float]] = {}

        def search(arm: str, knob: str, centre: float, fixed: dict[str, float]) -> LrSearch:
            result = search_lr(
                lambda lr, seed: self._tuning_loss(data, arm, {**fixed, knob: lr}, seed),
                log2_grid(centre, p.grid_points), seeds, f"{arm}.{knob}", p.max_extensions, fixed,
            )  # fmt: skip
            grid = ", ".join(f"{x:g}" for x in sorted(result.grid))
            self._say(f"tuned {arm} {knob}: {result.chosen:g} (grid {grid})")
            return result

        searches["adamw.lr"] = search("adamw", "lr", p.lr_centers["adamw"], {})
        adam_lr = searches["adamw.lr"].chosen
        chosen["adamw"] = {"lr": adam_lr}
        for arm in (a for a in p.arms if ARMS[a].hybrid):
            s = searches[f"{arm}.lr"] = search(arm, "lr", p.lr_centers[arm], {"adam_lr": adam_lr})
            chosen[arm] = {"lr": s.chosen, "adam_lr": adam_lr}
            if p.adam_side == "tuned":  # a second, one-dimensional search at the chosen Muon lr
                s = searches[f"{arm}.adam_lr"] = search(arm, "adam_lr", adam_lr, {"lr": chosen[arm]["lr"]})
                chosen[arm]["adam_lr"] = s.chosen
        tuning = {
            "schema_version": TUNING_SCHEMA_VERSION,
            "tuned_on_s": p.s_values[0],
            "horizon_steps": p.tune_steps,
            "seeds": seeds,
            "adam_side": p.adam_side,
            "searches": {k: v.to_dict() for k, v in searches.items()},
            "chosen": chosen,
        }
        atomic_write_text(path, json.dumps(tuning, indent=1))
        return tuning

    def _runs(self) -> list[tuple[float, str, int]]:
        p = self.preset
        return [
            (s, arm, seed)
            for s in p.s_values
            for arm in (p.arms if s == p.s_values[0] else p.sweep_arms)
            for seed in range(p.seeds)
        ]

    def _ckpt_every(self, s: float) -> int:
        return self.preset.ckpt_every if s == self.preset.s_values[0] else self.preset.sweep_ckpt_every

    def train_all(self, data: dict[float, Path], chosen: dict[str, dict[str, float]]) -> dict[tuple, Path]:
        runs = {}
        for s, arm, seed in self._runs():
            run = self.out / "runs" / _s_name(s) / arm / f"seed{seed}"
            every = self._ckpt_every(s)
            cfg = self._train_config(data[s], run, arm, chosen[arm], seed, eval_every=every, ckpt_every=every)
            train(cfg, progress=self.progress)
            runs[(s, arm, seed)] = run
        self._say(f"trained {len(runs)} runs")
        return runs

    def _settings(self, batches: int) -> AnalysisSettings:
        return AnalysisSettings(blocks="layer", batch="train", batches=batches)

    def compare(self, runs: dict[tuple, Path], plateau: float) -> list[ComparisonRecord]:
        p = self.preset
        s0 = p.s_values[0]
        records = []
        for seed in range(p.seeds):
            for arm in (a for a in p.arms if a != "adamw"):
                name = f"adamw/{arm}"
                try:
                    c = compare_runs(
                        runs[(s0, "adamw", seed)], runs[(s0, arm, seed)],
                        self.out / "analysis" / f"compare-{arm}-seed{seed}", p.compare_levels, p.tolerance,
                        self._settings(p.analysis_batches), progress=self.progress, phase=p.phase, window=p.window,
                        plateau_ceiling=plateau, cache=self.out / "analysis" / "reports",
                    )  # fmt: skip
                    records.append(ComparisonRecord(name, seed, s0, c))
                except CurvlabError as e:  # no stable phase, no overlap, no level within tolerance
                    records.append(ComparisonRecord(name, seed, s0, None, str(e)))
                    self._say(f"{name} seed {seed}: no comparison ({e})")
        n = sum(len(r.comparison.headline_levels) for r in records if r.comparison)
        self._say(f"compared {len(records)} run pairs at {n} matched levels off the plateau")
        return records

    def track(self, runs: dict[tuple, Path], plateau: float) -> list[TrackRecord]:
        p = self.preset
        records = []
        for s, arm, seed in self._runs():
            if arm not in p.sweep_arms:
                continue
            steps = list(range(p.track_interval, p.steps + 1, p.track_interval))
            rows = track_run(
                runs[(s, arm, seed)], self.out / "analysis" / f"track-{_s_name(s)}-{arm}-seed{seed}",
                settings=self._settings(p.track_batches), progress=self.progress, plateau_ceiling=plateau,
                cache=self.out / "analysis" / "reports", steps=steps,
            )  # fmt: skip
            records.append(TrackRecord(arm, s, seed, p.steps, p.warmup_steps, rows))
        self._say(f"tracked {len(records)} runs")
        return records

    def fineweb_comparison(self) -> dict[str, Any] | None:
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
            runs["adamw"], runs["muon"], self.out / "analysis" / "compare-fineweb", p.compare_levels, p.tolerance,
            self._settings(p.analysis_batches), progress=self.progress, phase=p.phase, window=p.window,
            cache=self.out / "analysis" / "reports",
        )  # fmt: skip
        self._say(f"FineWeb: compared at {len(compare.levels)} matched levels")
        return {
            "ratio_of_means": compare.ratio_of_means,
            "levels": len(compare.headline_levels),
            "seeds": 1,
            "note": "one seed: no interval",
        }

    def finetune(self, runs: dict[tuple, Path]):
        """The fine-tuning comparison (:mod:`curvlab.finetune`) in ``OUT/finetune``, adapting the first
        seed's AdamW model at the first s to s = 1; ``None`` when the preset has none."""
        from curvlab.finetune import Finetune, with_preset

        p = self.preset
        if p.finetune is None:
            return None
        base = runs[(p.s_values[0], "adamw", 0)]
        result = Finetune(
            replace(with_preset(p.finetune), device=p.device), self.out / "finetune", base, None, self.progress
        )
        return result.run()

    def quadratic(self) -> dict[str, Any]:
        from curvlab.quadratic import quadratic_study

        path = self.out / "quadratic" / "quadratic.json"
        if path.is_file():
            return json.loads(path.read_text())
        result = quadratic_study(**self.preset.quadratic)
        atomic_write_text(path, json.dumps(result))
        self._say("quadratic model done")
        return result

    def figures(self, data: LevelData, summary: Summary, tuning: dict[str, Any], quadratic: dict[str, Any]):
        from curvlab import plots

        fig = self.out / "figures"
        written = plots.reproduction_figures(data, summary, tuning, quadratic, fig)
        return {k: [str(p.relative_to(self.out)) for p in v] for k, v in written.items()}

    def notes(self, tuning: dict[str, Any], levels: LevelData | None = None) -> list[str]:
        """The caveats the report states up front (what this preset reduced, what it tied, what the
        trajectory means leave out)."""
        p = self.preset
        tokens = f"{p.batch_size}x{get_config(p.model, **p.model_overrides).block_size}"
        notes = []
        if p.seeds < 3:
            notes.append(
                f"{p.seeds} seeds per optimizer (fewer than the 3 of the standard preset): the intervals "
                "resample few seeds and are rough."
            )
        if p.adam_side == "tied":
            notes.append(
                "The hybrid Muon arms' AdamW side (embeddings, head, norms) runs at AdamW's tuned learning rate "
                f"({tuning['chosen']['adamw']['lr']:g}); it is not tuned on its own."
            )
        notes.append(
            f"Learning rates were tuned at s = {p.s_values[0]:g} on {p.tune_steps}-step runs with the same "
            f"schedule shape ({p.tune_seeds} seeds per grid point); the compared runs train {p.steps} steps."
        )
        notes.append(
            f"Matched levels: {p.compare_levels} targets in the {p.phase} phase, tolerance {p.tolerance:.0%}, each "
            f"averaged over a window of up to {2 * p.window + 1} checkpoints {p.ckpt_every} steps apart, each "
            f"analysed on {p.analysis_batches} batch(es) of {tokens} tokens; trajectories on {p.track_batches}."
        )
        if levels is not None and levels.tracks:
            counts = {}
            for t in levels.tracks:
                n = counts.setdefault(t.arm, [0, 0])
                n[0] += len(t.rows) - len(t.off_plateau())
                n[1] += len(t.rows)
            notes.append(
                "Trajectory means (the Zipf sweep, rho_within by thirds) leave out checkpoints on the unigram "
                "plateau, as the matched levels do: "
                + ", ".join(f"{arm} {off} of {total}" for arm, (off, total) in sorted(counts.items()))
                + "."
            )
        if p.analysis_batches < 4:
            notes.append(f"{p.analysis_batches} evaluation batch(es) per checkpoint (the standard preset uses 4).")
        if len(p.s_values) < 3:
            notes.append(f"The Zipf sweep runs s = {', '.join(f'{s:g}' for s in p.s_values)} only.")
        if p.grammar.get("n_tokens"):
            notes.append(f"A {p.grammar['n_tokens']}-token grammar (the paper's has 4412).")
        return notes

    # -- the whole job ----------------------------------------------------------------------

    def run(self) -> Summary:
        from curvlab import report

        self.clock = StageClock()
        self._check_config()
        p = self.preset
        with self.clock("data"):
            data = self.data()
        plateau = plateau_ceiling(unigram_entropy_nats(data[p.s_values[0]]), p.plateau_fraction)
        with self.clock("tune"):
            tuning = self.tune(data[p.s_values[0]])
        with self.clock("train"):
            runs = self.train_all(data, tuning["chosen"])
        with self.clock("compare"):
            comparisons = self.compare(runs, plateau)
        with self.clock("track"):
            tracks = self.track(runs, plateau)
        levels = LevelData(comparisons, tracks, plateau, list(p.s_values))
        levels.save(self.out / "analysis" / "levels.json")
        with self.clock("finetune"):
            finetune = self.finetune(runs)
        with self.clock("fineweb"):
            fineweb = self.fineweb_comparison()
        with self.clock("quadratic"):
            quadratic = self.quadratic()
        with self.clock("summary"):
            entries, zipf = headline(levels, p.n_boot)
        final = {}
        for (s, arm, _), run in runs.items():
            index = read_index(run)
            final.setdefault(f"{s:g}", {}).setdefault(arm, []).append(index[-1]["val_loss"] if index else None)
        closed = quadratic["example"]["closed_forms"]
        summary = Summary(
            p.name, entries, zipf, taylor_counts(levels), tuning, self.notes(tuning, levels), final,
            {k: closed[k] for k in ("muon_nds", "muon_contraction", "gd_two_step_contraction")}, fineweb=fineweb,
        )  # fmt: skip
        with self.clock("figures"):
            summary.figures = self.figures(levels, summary, tuning, quadratic)
        summary.timing = record_invocation(self.out / "timing.json", self.clock.invocation())
        summary.seconds = summary.timing["total"]  # over every invocation, when a run was interrupted and resumed
        summary.invocations = int(summary.timing["invocations"])
        atomic_write_text(self.out / "summary.json", json.dumps(summary.to_dict(), indent=1))
        text = report.render_report(summary, levels)
        if finetune is not None:
            text += "\n" + "\n".join(report.finetune_section(finetune)) + "\n"
        atomic_write_text(self.out / "report.md", text)
        self._say(f"done in {summary.seconds:.0f} s: {self.out / 'report.md'}")
        return summary
