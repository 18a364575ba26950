"""``curvlab reproduce --preset robustness``: the paired direction ratio across the settings a reviewer
would change (:data:`curvlab.jobs.presets.ROBUSTNESS_PRESETS`, docs/science.md section 15).

A composition of the reproduction's stages: each setting is a :class:`~curvlab.studies.design.Preset`
made from the base design (:meth:`~curvlab.studies.design.RobustnessSetting.preset`) and measured in
``settings/<name>/`` (a reproduction's layout) by the same stage functions
(:func:`~curvlab.jobs.reproduce.make_data`, :func:`~curvlab.jobs.measure.measure_seed`: each seed's runs
with their shadows and twins, the matched comparison, the trajectories with the stability context), on
the design's fresh seeds, without A/A. Its learning rates are not tuned: they are the committed table's
entry for the base design times the setting's factors (one rule for both arms). Then from each setting's
``levels.json`` alone its row (:func:`curvlab.studies.robustness.setting_result`), and ``summary.json``,
``levels.json`` (every setting's), the figure and ``report.md``. A re-run continues: a setting's seed
whose analysis is saved is read back.
"""

from __future__ import annotations

from typing import Any

from curvlab.jobs import measure
from curvlab.jobs.reproduce import Composite, Part, make_data, plateaus
from curvlab.output import plots
from curvlab.output.robustness_page import render_robustness
from curvlab.studies.design import RobustnessSetting
from curvlab.studies.records import LevelData
from curvlab.studies.robustness import RobustnessLevels, RobustnessSummary, setting_result
from curvlab.studies.tuning import TuningRecord
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_text
from curvlab.util.versions import SoftwareVersions


def scaled_lrs(entry: dict[str, Any], factors: dict[str, float]) -> dict[str, dict[str, float]]:
    """A table entry's chosen options with each arm's ``lr`` times its factor. Muon's AdamW side stays the
    table's (tied to AdamW's tabled lr): a factor changes one arm's own step, nothing of the other's."""
    chosen = {arm: dict(entry["chosen"][arm]) for arm in ("adamw", "muon")}
    for arm, factor in factors.items():
        chosen[arm]["lr"] = float(f"{chosen[arm]['lr'] * factor:.6g}")
    return chosen


class Robustness(Composite):
    """One robustness design in one output directory (module docstring)."""

    TAG = "robustness"
    CONFIG_FILE = "robustness.json"

    def _setting(self, setting: RobustnessSetting) -> tuple[LevelData, dict[str, dict[str, float]]]:
        """One setting's runs and analyses, in ``settings/<name>``; its :class:`LevelData` and lrs."""
        preset = setting.preset(self.preset.base)
        part = Part(preset, self.out / "settings" / setting.name, self.clock, self.progress, self.TAG)
        part._check_config()
        path = part.out / "analysis" / "levels.json"
        chosen = scaled_lrs(self.table, setting.lr_factors)
        if path.is_file():
            return LevelData.load(path), chosen
        s = preset.language.s_values[0]
        with self.clock("data"):
            ceilings = plateaus(preset, data := make_data(part, preset))
        horizon = preset.tuning_settings.horizon_steps
        table = TuningRecord("table", s, horizon, [], {}, chosen, preset.tuning.adam_side, None, self.table)
        tuning = part.saved_tuning() or part.save_tuning(table)
        levels, _ = measure.measure_seeds(part, preset, self.preset.seed_list(), data, tuning, ceilings)
        levels.save(path)
        self.say(f"{setting.name}: done")
        return levels, chosen

    def _run(self) -> RobustnessSummary:
        self.start()
        p = self.preset
        rows, levels = [], {}
        for setting in p.settings:
            levels[setting.name], chosen = self._setting(setting)
            rows.append(setting_result(setting.name, setting.label, levels[setting.name], chosen))
        RobustnessLevels(levels).save(self.out / "levels.json")
        with self.clock("figures"):
            figures = plots.robustness_ratios(rows, self.out / "figures" / "robustness_ratios")
        timing = self.timing()
        paths = [str(f.relative_to(self.out)) for f in figures]
        design = (p.name, p.base.name, p.seed_list(), rows)
        summary = RobustnessSummary(*design, timing, timing["total"], SoftwareVersions.current(), paths)
        schema.save(self.out / "summary.json", summary)
        atomic_write_text(self.out / "report.md", render_robustness(summary))
        self.say(f"done in {summary.seconds:.0f} s: {self.out / 'report.md'}")
        return summary
