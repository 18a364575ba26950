"""``curvlab reproduce --preset long``: the paper's observations 3 and 4 over a long horizon, at two values of s,
each at learning rates of its own (:data:`curvlab.jobs.presets.LONG_PRESETS`; what it concludes:
:mod:`curvlab.studies.long`; docs/science.md section 18).

A composition of the reproduction's stages: each s is a reproduction of its own (the design at that one s, in
``s/s<s>/``): its data (training at s, validation at s = 0), its learning rates searched at that s
(:func:`~curvlab.jobs.tune.tune`: a 3-point grid on a tuning seed, so that s = 1 is not run at s = 0's rates),
its seeds measured (:func:`~curvlab.jobs.measure.measure_seeds`). Then, from the parts' ``levels.json`` alone,
the primary family, the estimates by third of training, ``summary.json``, ``levels.json`` (both parts'), the
figure and ``report.md``. A re-run continues from what is saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from curvlab.jobs import measure
from curvlab.jobs.job import Design
from curvlab.jobs.reproduce import Part, make_data, plateaus, reproduction_config
from curvlab.jobs.tune import tune
from curvlab.output.long_page import long_figure, render_long
from curvlab.studies.design import Preset
from curvlab.studies.long import LongLevels, LongSummary, merged_levels
from curvlab.studies.primary import primary_family
from curvlab.studies.records import LevelData
from curvlab.studies.thirds import by_thirds
from curvlab.studies.tuning import TuningRecord
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_text
from curvlab.util.versions import SoftwareVersions


class Long(Design):
    """One long design in one output directory (module docstring)."""

    TAG = "long"
    CONFIG_FILE = "long.json"

    def __init__(self, preset: Preset, out: str | Path, progress: bool = True):
        preset.validate()
        super().__init__(out, progress)
        self.preset = preset

    def config(self) -> dict[str, Any]:
        return reproduction_config(self.preset)

    def part_preset(self, s: float) -> Preset:
        """The design at one s: a reproduction of its own."""
        return self.preset.changed(name=f"{self.preset.name}-{measure.s_name(s)}", s_values=(s,))

    def _part(self, s: float) -> tuple[LevelData, TuningRecord]:
        """One s's runs and analyses in ``s/s<s>``: its :class:`LevelData` and tuning."""
        preset = self.part_preset(s)
        part = Part(preset, self.out / "s" / measure.s_name(s), self.clock, self.progress, self.TAG)
        part._check_config()
        with self.clock("data"):
            data = make_data(part, preset)
        with self.clock("tune"):
            tuning = tune(part, preset, data[s])
        path = part.out / "analysis" / "levels.json"
        if path.is_file():
            return LevelData.load(path), tuning
        seeds = list(range(preset.seeds))
        levels, _ = measure.measure_seeds(part, preset, seeds, data, tuning, plateaus(preset, data))  # (no control arm)
        levels.save(path)
        self.say(f"s = {s:g}: done")
        return levels, tuning

    def _run(self) -> LongSummary:
        self.start()
        p = self.preset
        parts, tunings = {}, {}
        for s in p.language.s_values:
            parts[s], tunings[f"{s:g}"] = self._part(s)
        LongLevels({f"{s:g}": levels for s, levels in parts.items()}).save(self.out / "levels.json")
        primary = primary_family(merged_levels(parts), judged=p.inference.primary)
        thirds = by_thirds(parts)
        with self.clock("figures"):
            figures = long_figure(thirds, self.out / "figures" / "long_thirds")
        timing = self.timing()
        paths = [str(f.relative_to(self.out)) for f in figures]
        found = (p.name, p.training.steps, list(range(p.seeds)), tunings, primary, thirds)
        summary = LongSummary(*found, timing, timing["total"], SoftwareVersions.current(), paths)
        schema.save(self.out / "summary.json", summary)
        atomic_write_text(self.out / "report.md", render_long(summary))
        self.say(f"done in {summary.seconds:.0f} s: {self.out / 'report.md'}")
        return summary
