"""The main job: reproduce the paper's curvature analysis end to end, fairly, from data to report.

:class:`Reproduction` only orders the stages, owns the output directory and resumes; each stage is a
function over the design's records (:mod:`curvlab.studies.design`), skipped when its output already
exists with the same settings (so an interrupted run, started again, continues from what is done), each
timed (``timing.json``):

1. data (:func:`make_data`): the Zipf-PCFG at each s (training at s, validation at s = 0), and each s's
   unigram plateau: the validation loss of a model that learned only that s's training frequencies;
2. tuning (:func:`curvlab.jobs.tune.tune`), at the first s, on seeds disjoint from the measured ones;
3. measurement per seed (:func:`curvlab.jobs.measure.measure_seed`, ``analysis/seed<k>.json``), each
   seed's checkpoints then pruned (:func:`curvlab.jobs.measure.prune_seed`);
4. ``analysis/levels.json``, everything measured (:class:`curvlab.studies.records.LevelData`);
5. the side studies (:mod:`curvlab.jobs.side_studies`): fine-tuning, FineWeb, the quadratic model;
6. inference and report (:func:`conclude`): from ``levels.json`` alone the headline with its intervals and
   verdicts, the primary family, the A/A calibration and the controls; figures; ``summary.json`` and
   ``report.md`` (its prose: :mod:`curvlab.output.notes`, :mod:`curvlab.output.text`).

Presets (:data:`curvlab.jobs.presets.PRESETS`): ``micro`` (the test suite's, seconds), ``quick`` (the CPU
default, ten minutes on two cores), ``standard`` (CPU, about 75 minutes) and ``paper`` (a GPU, and
``gpt2-124m`` on FineWeb shards the user provides). The robustness design composes the same stages
(:mod:`curvlab.jobs.robustness`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from curvlab.data.corpus import write_corpus
from curvlab.data.dataset import generate_pcfg_dataset, read_stats, unigram_plateau_nats
from curvlab.data.shards import data_vocab_size, find_shards
from curvlab.data.text import text_to_shards
from curvlab.errors import CurvlabError
from curvlab.jobs import measure, side_studies
from curvlab.jobs.job import Design, Job
from curvlab.jobs.lr_table import LR_TABLE, LrTable, entry_or_centres, read_lr_table
from curvlab.jobs.presets import PRESETS
from curvlab.jobs.tune import tune
from curvlab.models.gpt import get_config
from curvlab.output import plots
from curvlab.output import text as report
from curvlab.output.finetune_text import finetune_section
from curvlab.output.mechanism import mechanism_figures
from curvlab.output.notes import reproduction_notes
from curvlab.runs.checkpoint import read_index
from curvlab.runs.match import plateau_ceiling
from curvlab.runs.train import train
from curvlab.studies import mechanism
from curvlab.studies.controls import controls, stability
from curvlab.studies.design import Preset, train_config
from curvlab.studies.headline import headline, taylor_counts
from curvlab.studies.primary import calibration, primary_family
from curvlab.studies.records import LevelData
from curvlab.studies.summary import QuadraticRecord, Summary
from curvlab.studies.tuning import TuningSettings
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_text
from curvlab.util.versions import SoftwareVersions


def make_data(job: Job, preset: Preset) -> dict[float, Path]:
    """The Zipf-PCFG of each training s in ``data/s<s>`` (validation at s = 0), made once; or the one language
    of a corpus (:func:`make_text`)."""
    lang = preset.language
    if lang.corpus is not None:
        return {lang.s_values[0]: make_text(job, preset)}
    dirs = {}
    for s in lang.s_values:
        dirs[s] = job.out / "data" / measure.s_name(s)
        sizes = {"tokens": lang.tokens, "val_tokens": lang.val_tokens, "val_s": 0.0}
        grammar = {"seed": lang.grammar_seed, "grammar_options": lang.grammar}
        generate_pcfg_dataset(dirs[s], s=s, **sizes, **grammar, progress=job.progress)
    job.say(f"data ready: s = {', '.join(f'{s:g}' for s in lang.s_values)}")
    return dirs


def make_text(job: Job, preset: Preset) -> Path:
    """The corpus's data directory: a user's (``--data``, as given), or ``data/text`` made once from the corpus
    curvlab makes (``data/corpus.txt``, its record in ``data/corpus.json``), by a byte-level BPE trained on it."""
    data = getattr(job, "data", None)
    if data is not None:
        return data
    lang, out = preset.language, job.out / "data"
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "corpus.json").is_file():  # (written last: a killed run makes the corpus again)
        record = write_corpus(lang.corpus, out / "corpus.txt")
        atomic_write_text(out / "corpus.json", json.dumps(record, indent=1))
    options = {"vocab_size": lang.corpus_vocab, "val_fraction": lang.corpus_val_fraction, "seed": lang.grammar_seed}
    text_to_shards([out / "corpus.txt"], out / "text", progress=job.progress, **options)
    job.say(f"data ready: {lang.corpus}")
    return out / "text"


def plateaus(preset: Preset, data: dict[float, Path]) -> dict[float, float]:
    """Each s's plateau ceiling: a model that has learned only its training frequencies scores the unigram
    entropy on the s = 0 validation data; levels above the ceiling are flagged."""
    fraction = preset.measurement.plateau_fraction
    return {s: plateau_ceiling(unigram_plateau_nats(data[s]), fraction) for s in preset.language.s_values}


def reproduction_config(preset: Preset, fineweb: Path | None = None) -> dict[str, Any]:
    """What a reproduction's directory holds results of (``reproduce.json``): the preset, flat (the form
    every curvlab since presets embedded their tuning wrote), and the FineWeb shards."""
    flat = preset.flat()
    del flat["keep"]  # what stays on disk changes no result: a re-run may prune further
    if not flat["grammar_seed"]:  # the first draw: a directory made before the field existed continues
        del flat["grammar_seed"]
    return {"preset": flat, "fineweb": str(fineweb) if fineweb else None}


def on_user_data(preset: Preset, data: Path) -> Preset:
    """``preset`` on a user's data directory (``curvlab data text``'s, or any with ``stats.json``): its corpus is
    the directory's, named by the digest of its stats (so no committed learning rate applies: the full search
    runs), at one s.

    Raises:
        CurvlabError: a preset with a Zipf sweep (several s), a directory without stats.json or shards, or a
            vocabulary larger than the preset's model has.
    """
    if len(preset.language.s_values) != 1:
        raise CurvlabError(f"--data replaces the grammar: the {preset.name} design sweeps s, choose one that doesn't")
    for split in ("train", "val"):
        find_shards(data, split)
    if not (data / "stats.json").is_file():
        raise CurvlabError(f"{data}: no stats.json (not a directory written by `curvlab data text`)")
    vocab, model = data_vocab_size(data), get_config(preset.network.model, **preset.network.model_overrides)
    if vocab is None or vocab > model.vocab_size:
        raise CurvlabError(
            f"{data}: a vocabulary of {vocab} tokens, more than the {preset.name} design's model has "
            f"({model.vocab_size}): make the data with `curvlab data text ... --vocab-size {model.vocab_size}` or less"
        )
    digest = hashlib.sha256(json.dumps(read_stats(data), sort_keys=True).encode()).hexdigest()[:16]
    language = replace(preset.language, corpus=f"data stats sha256:{digest}")
    return replace(preset, language=language, tuning=replace(preset.tuning, lr_source="search"))


def search_lr_table(preset: Preset, out: str | Path, progress: bool = True) -> dict[str, Any]:
    """The committed table's entry for ``preset``, made by the full protocol: ``grid_points``-point log2
    grids extended at their edges, 2 tuning seeds per point (disjoint from the measured ones), runs at the
    compared horizon. Writes it into :data:`LR_TABLE` (other presets' entries are kept)."""
    rule = preset.tuning.rule
    full = preset.changed(lr_source="search", tuning=replace(rule, tune_seeds=max(2, rule.tune_seeds)))
    if set(full.tuning_settings.seeds()) & set(full.tuning.check_seed_list()):
        seeds, check = full.tuning_settings.seeds(), full.tuning.check_seed_list()
        raise CurvlabError(f"the table's seeds {seeds} overlap the check's {check}")
    job = Reproduction(full, out, progress=progress)
    job._check_config()
    tuning = tune(job, full, make_data(job, full)[full.language.s_values[0]])
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


class Reproduction(Design):
    """One reproduction in one output directory (module docstring): it orders the stages, owns the
    directory and resumes."""

    TAG = "reproduce"
    CONFIG_FILE = "reproduce.json"
    PATH_KEYS = ("fineweb", "data")

    def __init__(
        self,
        preset: Preset,
        out: str | Path,
        fineweb: str | Path | None = None,
        progress: bool = True,
        data: str | Path | None = None,
    ):
        if data is not None:  # a user's data directory: the design's one language, tuned afresh on it
            preset = on_user_data(preset, Path(data))
        preset.validate()
        super().__init__(out, progress)
        self.preset = preset
        self.data = Path(data).resolve() if data else None
        self.fineweb = Path(fineweb).resolve() if fineweb else None  # (resolved, as Job.out)
        if preset.fineweb:
            if self.fineweb is None:
                raise CurvlabError("the paper preset trains gpt2-124m on FineWeb: pass --fineweb DIR with its shards")
            for split in ("train", "val"):  # fail now, not after hours of training
                find_shards(self.fineweb, split)

    def config(self) -> dict[str, Any]:
        config = reproduction_config(self.preset, self.fineweb)
        return config | ({"data": str(self.data)} if self.data else {})

    def tuning_settings(self) -> TuningSettings:
        return self.preset.tuning_settings

    def _short_run(self, data: Path, run: Path, arm: str, options: dict[str, float], seed: int, steps: int) -> float:
        short = {"steps": steps, "eval_every": steps, "ckpt_every": steps}
        cfg = train_config(self.preset, data, run, arm, seed, optimizer_options=options, **short)
        return train(cfg, progress=self.progress).val_loss

    def _run(self) -> Summary:
        self.start()
        p = self.preset
        with self.clock("data"):
            data = make_data(self, p)
        ceilings = plateaus(p, data)
        s0 = p.language.s_values[0]
        with self.clock("tune"):
            tuning = tune(self, p, data[s0])
        levels, tuning = measure.measure_seeds(self, p, list(range(p.seeds)), data, tuning, ceilings)
        levels.save(self.out / "analysis" / "levels.json")
        with self.clock("finetune"):
            finetune = side_studies.finetune(self, p, measure.run_dir(self.out, s0, "adamw", 0))
        with self.clock("fineweb"):
            fineweb = side_studies.fineweb(self, p, self.fineweb)
        with self.clock("quadratic"):
            quadratic = side_studies.quadratic(self, p)
        summary = conclude(self, p, levels, tuning, ceilings, QuadraticRecord.from_study(quadratic), fineweb)
        with self.clock("figures"):
            written = plots.reproduction_figures(levels, summary, tuning, quadratic, self.out / "figures")
            written |= mechanism_figures(summary, self.out / "figures")
        summary.figures = {k: [str(f.relative_to(self.out)) for f in v] for k, v in written.items()}
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
        self.say(f"done in {summary.seconds:.0f} s, {mb:.0f} MB left on disk: {self.out / 'report.md'}")
        return summary


def conclude(job: Job, preset: Preset, levels: LevelData, tuning, ceilings, quadratic, fineweb) -> Summary:
    """The inference stage: from ``levels`` alone the headline, the primary family, the A/A calibration,
    the controls and the stability context, with the report's caveats and each run's final loss (the
    tuning, plateau ceilings, quadratic model and FineWeb comparison are the earlier stages')."""
    with job.clock("summary"):
        entries, zipf = headline(levels)
        primary = primary_family(levels, judged=preset.inference.primary)
        calibrated = calibration(levels.comparisons, data=levels, pairs=preset.aa_seed_pairs())
        checks, context = controls(levels), stability(levels)
        factorial = preset.measurement.factorial
        grid, parts = (mechanism.cells(levels), mechanism.decomposition(levels)) if factorial else ([], None)
    final: dict[str, dict[str, list]] = {}
    for s in preset.language.s_values:
        for arm in preset.arms_at(s):
            for seed in range(preset.seeds):
                index = read_index(measure.run_dir(job.out, s, arm, seed))
                final.setdefault(f"{s:g}", {}).setdefault(arm, []).append(index[-1]["val_loss"] if index else None)
    notes = reproduction_notes(preset, tuning, levels, ceilings, final, paper=PRESETS["paper"])
    inferred = {"primary": primary, "calibration": calibrated, "controls": checks, "edge_of_stability": context}
    inferred |= {"cells": grid, "decomposition": parts, "paired_parts": mechanism.paired_parts(levels)}
    found = (entries, zipf, taylor_counts(levels), tuning, notes, final, quadratic)
    return Summary(preset.name, *found, fineweb=fineweb, versions=SoftwareVersions.current(), **inferred)


class Part(Reproduction):
    """One part of a composite design (a setting of the robustness design, a rung of a scaling ladder, one s of
    the long design) in its own directory, in a reproduction's layout (its config as ``reproduce.json``, its
    tuning and analyses), sharing the design's clock and progress, its lines tagged as the design's."""

    def __init__(self, preset: Preset, out: Path, clock, progress: bool, tag: str = "reproduce"):
        super().__init__(preset, out, progress=progress)
        self.clock, self.TAG = clock, tag


class Composite(Design):
    """A design made of a base preset's variations, each a :class:`Part` (the robustness design's settings, a
    scaling ladder's rungs), its learning rates from the committed table's entry ``preset.lr_table`` (or the
    base's tuning centres)."""

    def __init__(self, preset: Any, out: str | Path, progress: bool = True):
        preset.validate()
        super().__init__(out, progress)
        self.preset = preset
        self.table = entry_or_centres(preset.lr_table, preset.base.tuning.rule.lr_centers)

    def config(self) -> dict[str, Any]:
        base = self.preset.base.flat()
        del base["keep"]  # as a reproduction's: what stays on disk changes no result
        return {"preset": asdict(self.preset) | {"base": base}, "table": self.table["chosen"]}
