"""The stages beside the main comparison, each skipped when its design has none, each resumable:

* :func:`finetune`: LoRA adaptation of the first seed's AdamW model to s = 1 under the adapter optimizers
  (:class:`curvlab.jobs.finetune.Finetune`, in ``finetune/``);
* :func:`fineweb`: Muon against AdamW on the user's FineWeb shards at the paper's learning rates;
* :func:`quadratic`: the paper's Kronecker quadratic model (a derived cache, recomputed when damaged).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from curvlab.errors import CurvlabError
from curvlab.jobs.finetune import Finetune
from curvlab.jobs.job import Job
from curvlab.jobs.measure import settings
from curvlab.jobs.presets import with_preset
from curvlab.output.files import read_quadratic, write_quadratic
from curvlab.runs.train import train
from curvlab.studies.adapters import FinetuneResult
from curvlab.studies.compare import compare_runs
from curvlab.studies.design import FinewebRun, Preset, train_config
from curvlab.studies.summary import FinewebRecord
from curvlab.theory.quadratic import QuadraticStudy, quadratic_study


def finetune(job: Job, preset: Preset, base: Path) -> FinetuneResult | None:
    """The fine-tuning comparison in ``OUT/finetune``, adapting ``base`` (the first seed's AdamW run at the
    first s) to s = 1; ``None`` when the preset has none."""
    if preset.finetune is None:
        return None
    design = replace(with_preset(preset.finetune), device=preset.training.device)
    return Finetune(design, job.out / "finetune", base, None, job.progress).run()


def fineweb(job: Job, preset: Preset, shards: Path | None) -> FinewebRecord | None:
    """Muon against AdamW at the paper's learning rates on the FineWeb ``shards``, compared at matched
    validation loss in the stable phase (the paper's figures 1 and 2 on its own data; one seed, so no
    interval); ``None`` without shards."""
    if shards is None:
        return None
    run = preset.fineweb or FinewebRun()  # (shards given to a design without the run: the paper's settings)
    runs = {}
    for arm in ("muon", "adamw"):
        runs[arm] = job.out / "runs" / "fineweb" / arm
        model = {"model": run.model, "model_overrides": dict(run.model_overrides)}
        schedule = {"steps": run.steps, "batch_size": run.batch_size, "eval_every": run.ckpt_every}
        options = {"optimizer_options": {"lr": run.lr[arm]}, "ckpt_every": run.ckpt_every}
        train(train_config(preset, shards, runs[arm], arm, 0, **model, **schedule, **options), progress=job.progress)
    analysis = job.out / "analysis"
    criteria = replace(preset.measurement.matching, plateau_ceiling=None)
    how = settings(preset, preset.measurement.analysis_batches)
    pair = (runs["adamw"], runs["muon"])
    where = {"progress": job.progress, "cache": analysis / "reports"}
    compared = compare_runs(*pair, analysis / "compare-fineweb", criteria, how, **where)
    job.say(f"FineWeb: compared at {len(compared.levels)} matched levels")
    return FinewebRecord(dict(compared.ratio_of_means), len(compared.headline_levels))


def quadratic(job: Job, preset: Preset) -> QuadraticStudy:
    """The quadratic model's study, read back when done before: a derived cache, so an unreadable,
    truncated or edited one (:mod:`curvlab.util.schema`'s seal) is recomputed, with a note."""
    path = job.out / "quadratic" / "quadratic.json"
    try:
        cached = read_quadratic(path)
    except CurvlabError as e:
        job.say(f"{e}; the quadratic model is recomputed")
        cached = None
    if cached is not None:
        return cached
    study = quadratic_study(**preset.quadratic)
    write_quadratic(study, job.out / "quadratic", figures=False)  # the report's figures draw it
    job.say("quadratic model done")
    return study
