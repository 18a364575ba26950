"""``curvlab reproduce --preset scaling``: the AdamW/Muon ratios across a ladder of model sizes, and their power
laws in the non-embedding parameters, extrapolated to GPT-2 small (:data:`curvlab.jobs.presets.SCALING_PRESETS`;
what it concludes: :mod:`curvlab.studies.scaling`; docs/science.md section 17).

A composition of the reproduction's stages: the data once (:func:`~curvlab.jobs.reproduce.make_data`: every
rung reads the same grammar and tokens), then each rung a :class:`~curvlab.studies.design.Preset`
(:meth:`~curvlab.studies.design.ScalingRung.preset`) in ``rungs/<name>/`` (a reproduction's layout), its
learning rates transferred from the committed table by the rule
(:func:`~curvlab.studies.scaling.transferred_lrs`) and checked on a 3-point grid
(:func:`~curvlab.jobs.tune.check_rule`), its seeds measured by the same stage function
(:func:`~curvlab.jobs.measure.measure_seeds`). Then, from each rung's ``levels.json`` alone, its row, the fits,
``summary.json``, ``levels.json`` (every rung's), the figure and ``report.md``. A re-run continues: a rung
whose levels are saved is read back, a seed whose analysis is saved is read back, a finished run is not
trained again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from curvlab.jobs import measure
from curvlab.jobs.reproduce import Composite, Part, make_data, plateaus
from curvlab.jobs.tune import check_rule
from curvlab.models.gpt import get_config
from curvlab.output.scaling_page import render_scaling, scaling_figure
from curvlab.studies.design import ScalingRung
from curvlab.studies.records import LevelData
from curvlab.studies.scaling import (
    PAPER_MODEL,
    SCALING_RULE,
    ScalingLevels,
    ScalingSummary,
    fit_table,
    model_size,
    parameter_counts,
    rung_result,
    scaling_fits,
    transferred_lrs,
)
from curvlab.studies.tuning import TuningRecord
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_text
from curvlab.util.versions import SoftwareVersions


def _check_summary(tuning: TuningRecord) -> dict[str, dict[str, Any]]:
    """Per arm: the checked knob, its grid, its best point, the rule's, whether they differ (one check seed: no
    noise to weigh the difference against) and each point's loss."""
    out = {}
    for key, search in tuning.searches.items():
        arm, knob = key.split(".")
        out[arm] = {"knob": knob, "grid": sorted(search.grid), "best": search.chosen, "rule": tuning.chosen[arm][knob]}
        out[arm] |= {"moved": bool(tuning.moved.get(arm)), "losses": {f"{x:g}": search.mean(x) for x in search.grid}}
    return out


class Scaling(Composite):
    """One scaling design in one output directory (module docstring)."""

    TAG = "scaling"
    CONFIG_FILE = "scaling.json"

    def config(self) -> dict[str, Any]:
        return super().config() | {"rule": SCALING_RULE}

    def _rung(
        self, rung: ScalingRung, data: dict[float, Path], ceilings: dict[float, float]
    ) -> tuple[LevelData, TuningRecord]:
        """One rung's runs and analyses in ``rungs/<name>``: its :class:`LevelData` and tuning check."""
        preset = rung.preset(self.preset.base)
        part = Part(preset, self.out / "rungs" / rung.name, self.clock, self.progress, self.TAG)
        part._check_config()
        width = get_config(preset.network.model, **preset.network.model_overrides).n_embd
        entry = {"rule": "transferred_lrs", "base_width": self.preset.base_width, "table": self.preset.lr_table}
        entry["chosen"] = transferred_lrs(self.table["chosen"], self.preset.base_width, width)
        with self.clock("tune"):
            tuning = check_rule(part, preset, data[preset.language.s_values[0]], entry)
        path = part.out / "analysis" / "levels.json"
        if path.is_file():
            return LevelData.load(path), tuning
        levels, _ = measure.measure_seeds(part, preset, self.preset.seed_list(), data, tuning, ceilings)
        levels.save(path)
        self.say(f"{rung.name}: done")
        return levels, tuning

    def _run(self) -> ScalingSummary:
        self.start()
        p = self.preset
        with self.clock("data"):
            data = make_data(self, p.base)
        ceilings = plateaus(p.base, data)
        rows, levels = [], {}
        for rung in p.rungs:
            levels[rung.name], tuning = self._rung(rung, data, ceilings)
            size = model_size(rung.preset(p.base).network)
            rows.append(rung_result(rung.name, size, tuning.chosen, _check_summary(tuning), levels[rung.name]))
        ScalingLevels(levels).save(self.out / "levels.json")
        at = parameter_counts(PAPER_MODEL)[0]
        fits = scaling_fits(rows, at)
        with self.clock("figures"):
            figures = scaling_figure(rows, fits, self.out / "figures" / "scaling")
        timing = self.timing()
        paths = [str(f.relative_to(self.out)) for f in figures]
        tr, block = p.base.training, get_config(p.base.network.model, **p.base.network.model_overrides).block_size
        tokens = tr.steps * tr.batch_size * block
        design = (p.name, p.base.name, p.seed_list(), p.base_width, tokens, rows, fits, fit_table(fits), at)
        summary = ScalingSummary(*design, SCALING_RULE, timing, timing["total"], SoftwareVersions.current(), paths)
        schema.save(self.out / "summary.json", summary)
        atomic_write_text(self.out / "report.md", render_scaling(summary))
        self.say(f"done in {summary.seconds:.0f} s: {self.out / 'report.md'}")
        return summary
