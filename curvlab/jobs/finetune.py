r"""The fine-tuning job (``curvlab finetune``): curvature of adapter steps, LoRA fine-tuning under sMuon,
LoRA-Muon, per-factor Muon and AdamW, compared at matched validation loss with the fairness machinery of
the main comparison. Each stage is skipped when its output exists with the same settings:

1. data: the Zipf-PCFG at s = 0 (pretraining) and at s = 1 (adaptation; its validation split at s = 1
   too, since the adapted model is judged on the distribution it adapts to), one grammar;
2. base: ``tiny`` pretrained with AdamW at s = 0 by :func:`curvlab.runs.train.train` (or a given run or
   checkpoint, ``--base``);
3. tune: for every adapter optimizer, its learning rate on the same log2 grid shape, the same seeds
   and the same short horizon, extended at its edges (:func:`curvlab.studies.tuning.search_lr`);
4. adapt (:func:`curvlab.runs.adapt.adapt`): every optimizer and seed, the same steps, batches and
   warmup-stable-decay schedule; peft LoRA on every ``nn.Linear`` inside the transformer blocks, rank r,
   alpha 2r, trained by the loop of full-model runs (a cut run resumes bit for bit). At every checkpoint
   in the stable phase a :class:`curvlab.runs.monitor.CurvatureMonitor` measures the step taken,
   :math:`Z_k = W_k - W_{k+1}` over the adapter parameters, on a fixed held-out batch D:

   .. math::
       I_1 = \langle G_D, Z\rangle,\ I_2 = \tfrac12\langle Z, H_D[Z]\rangle,\
       \text{predicted} = I_1 - I_2,\ \text{realized} = L_D(W) - L_D(W - Z),\
       \mathrm{NDS} = \langle Z, H_D[Z]\rangle / \|Z\|^2,

   and the block matrix :math:`M_{lm} = \langle Z_l, H_{lm}[Z_m]\rangle / \|Z\|^2` with one block per
   adapted layer, its A and B together (:func:`curvlab.optim.lora.adapter_blocks`): within = tr M,
   cross = the rest;
5. compare (:func:`curvlab.studies.adapters.compare_adapters`): per seed, AdamW against each Muon variant
   at matched validation loss in the stable phase, each side averaged over a window of neighbouring
   checkpoints; every level is kept (no filter on NDS, ever);
6. ``finetune.json`` (:class:`curvlab.studies.adapters.FinetuneResult`): the per-level data and, derived
   from it alone (:func:`curvlab.studies.adapters.estimates`), each ratio of means with its seed-level
   interval (:mod:`curvlab.inference.statistics`); ``tuning.json``; a figure; ``report.md``.

Ratios are AdamW over the Muon variant (sum over seeds and levels of AdamW's window means over the
variant's), the orientation of the paper's AdamW/Muon NDS ratio. The presets are
:data:`curvlab.jobs.presets.FINETUNE_PRESETS`.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from curvlab.data.dataset import generate_pcfg_dataset, read_stats
from curvlab.errors import CurvlabError
from curvlab.jobs.job import Job
from curvlab.models.gpt import GPT, get_config
from curvlab.output import plots
from curvlab.output.finetune_text import finetune_section
from curvlab.output.notes import finetune_notes
from curvlab.runs.adapt import adapt, check_rank, check_vocab, load_base
from curvlab.runs.checkpoint import read_index
from curvlab.runs.config import TrainConfig
from curvlab.runs.train import train
from curvlab.studies.adapters import ADAPTER_ARMS, FinetuneResult, compare_adapters, estimates
from curvlab.studies.design import FinetunePreset
from curvlab.studies.tuning import TuningRecord, TuningSettings
from curvlab.util.atomic import atomic_write_text
from curvlab.util.safe_stop import stop_at_safe_points
from curvlab.util.versions import SoftwareVersions

# -- the job ----------------------------------------------------------------------------------------


class Finetune(Job):
    """One fine-tuning comparison in one output directory (see the module docstring)."""

    TAG = "finetune"
    CONFIG_FILE = "finetune-config.json"
    WHAT = "a fine-tuning comparison"
    PATH_KEYS = ("base", "data")

    def __init__(
        self,
        preset: FinetunePreset,
        out: str | Path,
        base: str | Path | None = None,
        data: str | Path | None = None,
        progress: bool = True,
    ):
        preset.validate()
        super().__init__(out, progress)
        self.preset = preset
        self.base = Path(base).resolve() if base else None  # (resolved: the directory's identity, Job.out)
        self.data_dir = Path(data).resolve() if data else None
        self._tuning_base: Path | None = None  # the base checkpoint or run the tuning runs adapt (tune())
        # a missing or incompatible base, or a rank that does not fit, fails now, not after the data
        model = (
            load_base(self.base)[0]
            if self.base is not None
            else GPT(get_config(preset.model, **preset.model_overrides))
        )
        check_rank(model, preset.rank)
        if self.data_dir is not None:
            check_vocab(self.data_dir, model)

    def config(self) -> dict[str, Any]:
        return {"preset": asdict(self.preset), "base": str(self.base), "data": str(self.data_dir)}

    def tuning_settings(self) -> TuningSettings:
        return self.preset.tuning_settings

    def prepare(self) -> tuple[Path, Path]:
        """(the s = 1 adaptation data, the base checkpoint or run): made here unless given."""
        p = self.preset
        if self.base is not None:
            if self.data_dir is not None:
                return self.data_dir, self.base
            _, config = load_base(self.base)
            source = Path(config.get("data", ""))
            made = read_stats(source).get("config") if config.get("data") else None
            if not (isinstance(made, dict) and isinstance(made.get("grammar_options"), dict) and "seed" in made):
                raise CurvlabError(f"{self.base}: its training data is not a Zipf-PCFG directory; pass --data")
            grammar, seed = made["grammar_options"], made["seed"]
        else:
            grammar, seed = p.grammar, 0
        target = self.data_dir or self.out / "data" / "s1"
        if self.data_dir is None:
            generate_pcfg_dataset(
                target,
                1.0,
                p.tokens,
                p.val_tokens,
                val_s=1.0,
                seed=seed,
                grammar_options=grammar,
                progress=self.progress,
            )
        if self.base is not None:
            return target, self.base
        s0 = self.out / "data" / "s0"
        generate_pcfg_dataset(
            s0, 0.0, p.tokens, p.val_tokens, val_s=0.0, seed=seed, grammar_options=grammar, progress=self.progress
        )
        base = self.out / "base"
        cfg = TrainConfig(
            data=str(s0),
            out=str(base),
            model=p.model,
            model_overrides=dict(p.model_overrides),
            optimizer="adamw",
            optimizer_options={"lr": p.pretrain_lr},
            batch_size=p.batch_size,
            steps=p.pretrain_steps,
            warmup_steps=p.warmup_steps,
            schedule="wsd",
            cooldown_frac=p.cooldown_frac,
            eval_every=p.pretrain_steps,
            ckpt_every=p.pretrain_steps,
            val_windows=p.val_windows,
            device=p.device,
        )
        index = read_index(base)
        if not (index and index[-1]["step"] == p.pretrain_steps):
            train(cfg, progress=self.progress)
        self.say(f"base: {base} (AdamW, {p.pretrain_steps} steps at s = 0)")
        return target, base

    def _config(
        self, data: Path, out: Path, arm: str, lr: float, seed: int, steps: int, ckpt_every: int
    ) -> TrainConfig:
        p = self.preset
        return TrainConfig(
            data=str(data),
            out=str(out),
            model=p.model,
            optimizer=arm,
            optimizer_options={"lr": lr},
            batch_size=p.batch_size,
            steps=steps,
            warmup_steps=max(1, p.warmup_steps * steps // p.steps),
            schedule="wsd",
            cooldown_frac=p.cooldown_frac,
            seed=seed,
            eval_every=ckpt_every,
            ckpt_every=ckpt_every,
            val_windows=p.val_windows,
            device=p.device,
        )

    def _short_run(self, data: Path, run: Path, arm: str, options: dict[str, float], seed: int, steps: int) -> float:
        cfg = self._config(data, run, arm, options["lr"], seed, steps, steps)
        return adapt(cfg, self._tuning_base, self.preset.rank, None, progress=self.progress)

    def tune(self, data: Path, base: Path) -> TuningRecord:
        """Every arm's learning rate: the same grid shape, seeds, horizon and extension rule
        (:meth:`curvlab.jobs.job.Job._search`)."""
        saved = self.saved_tuning()
        if saved is not None:
            return saved
        self._tuning_base = base
        t = self.tuning_settings()
        seeds = t.seeds()
        search = self._search
        searches = {
            f"{arm}.lr": search(data, arm, "lr", t.grid(arm), {}, t.max_extensions, seeds) for arm in ADAPTER_ARMS
        }
        chosen = {arm: {"lr": searches[f"{arm}.lr"].chosen} for arm in ADAPTER_ARMS}
        return self.save_tuning(TuningRecord("search", 1.0, t.horizon_steps, seeds, searches, chosen))

    def adapt_all(self, data: Path, base: Path, chosen: dict[str, dict[str, float]]) -> dict[tuple[str, int], Path]:
        p = self.preset
        runs = {}
        for arm in ADAPTER_ARMS:
            for seed in range(p.seeds):
                run = self.out / "runs" / arm / f"seed{seed}"
                cfg = self._config(data, run, arm, chosen[arm]["lr"], seed, p.steps, p.ckpt_every)
                adapt(cfg, base, p.rank, p.heldout_windows, progress=self.progress)
                runs[(arm, seed)] = run
                self.safe_point(f"the {arm} run of seed {seed}")
        self.say(f"adapted {len(runs)} runs")
        return runs

    def run(self) -> FinetuneResult:
        """The whole job (module docstring). A SIGINT or SIGTERM stops it at the next safe point (after a
        training step, a finished adaptation run, or a stage: :mod:`curvlab.util.safe_stop`) with a
        :class:`~curvlab.util.safe_stop.Stopped`; running it again continues from what is saved."""
        with stop_at_safe_points():
            return self._run()

    def _run(self) -> FinetuneResult:
        self.start()
        with self.clock("prepare"):
            data, base = self.prepare()
        with self.clock("tune"):
            tuning = self.tune(data, base)
        self.safe_point("the learning-rate search")
        with self.clock("adapt"):
            runs = self.adapt_all(data, base, tuning.chosen)
        with self.clock("compare"):
            comparisons = compare_adapters(runs, list(range(self.preset.seeds)), self.preset.matching)
            entries = estimates(comparisons)
        final = {
            arm: [float(read_index(runs[(arm, s)])[-1]["val_loss"]) for s in range(self.preset.seeds)]
            for arm in ADAPTER_ARMS
        }
        timing = self.timing()
        result = FinetuneResult(
            asdict(self.preset),
            str(base),
            {a: v["lr"] for a, v in tuning.chosen.items()},
            comparisons,
            entries,
            final,
            finetune_notes(self.preset),
            timing,
            SoftwareVersions.current(),
        )
        result.save(self.out / "finetune.json")
        plots.finetune_ratios(result, self.out / "figures" / "finetune_ratios")
        atomic_write_text(self.out / "report.md", "\n".join(finetune_section(result)) + "\n")
        self.say(f"done in {timing['total']:.0f} s: {self.out / 'finetune.json'}")
        return result
