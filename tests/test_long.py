"""The long design (``curvlab reproduce --preset long``, issue 51, docs/science.md section 18): each s is a
reproduction of its own at learning rates searched at that s; the summary's primary family is the one of the
parts' merged levels and its thirds are :func:`~curvlab.studies.thirds.by_thirds` of the parts; the design
survives a stop and writes the schema issue 51 reads. On a micro-sized design."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from curvlab.cli import app
from curvlab.jobs.long import Long
from curvlab.jobs.presets import LONG_PRESETS, PRESETS
from curvlab.studies.long import LongLevels, LongSummary, merged_levels
from curvlab.studies.primary import primary_family
from curvlab.studies.records import LevelData
from curvlab.studies.thirds import THIRDS, by_thirds
from tests.builders import stopped_at_the_first_safe_point
from tests.test_cli import runner

JUDGED = ("zipf_gap_change",)
MEASURED = ("zipf_gap_change", "rho_within_change_gap")  # the schema issue 51 reads: both measured
_micro = PRESETS["micro"]
MICRO = replace(
    _micro.changed(name="lmicro", s_values=(0.0, 1.0), arms=("adamw", "muon"), finetune=None, sweep_ckpt_every=2),
    inference=replace(_micro.inference, primary=JUDGED, calibration=False),
    # every checkpoint tracked (the rho claim needs an early and a late third of the stable phase) and six
    # matched levels, two a third
    measurement=replace(_micro.measurement, matching=replace(_micro.measurement.matching, levels=6), track_interval=2),
)


def test_the_long_preset_is_what_issue_51_asks():
    p = LONG_PRESETS["long"]
    p.validate()
    assert p.training.steps >= 1500 and p.seeds >= 6 and p.language.s_values == (0.0, 1.0)
    assert p.network.model_overrides == PRESETS["standard"].network.model_overrides  # standard's model
    assert p.language.tokens == PRESETS["standard"].language.tokens  # and grammar
    assert (p.tuning.lr_source, p.tuning.rule.grid_points) == ("search", 3)  # a 3-point search at each s
    assert p.measurement.matching.levels == 9  # three a third
    assert set(p.inference.primary) == set(JUDGED)  # observation 4 is the thirds' (curvlab.studies.thirds.JUDGED)
    # the tokens a run reads fit in the data made for it
    assert p.training.steps * p.training.batch_size * 64 <= 4e6


@pytest.fixture(scope="module")
def design(tmp_path_factory):
    """The micro long design, stopped by a SIGTERM after its first seed's analysis, then run again to the end."""
    out = tmp_path_factory.mktemp("long") / "out"
    stopped_at_the_first_safe_point(Long(MICRO, out, progress=False))
    first = out / "s" / "s0" / "analysis" / "seed0.json"
    stamp = first.stat().st_mtime_ns
    summary = Long(MICRO, out, progress=False).run()
    return out, summary, first.stat().st_mtime_ns == stamp


@pytest.mark.heavy
def test_the_design_resumes_after_a_stop_and_writes_the_schema(design):
    out, summary, kept = design
    assert kept  # the first seed's analysis, saved before the stop, was read back, not made again
    assert summary.timing["invocations"] == 2
    raw = json.loads((out / "summary.json").read_text())
    assert raw["steps"] == MICRO.training.steps
    entries = {e["name"]: e for e in raw["primary"]}
    for name in MEASURED:
        assert entries[name]["direction"] != "not measured", entries[name]
    assert {e["third"] for e in raw["thirds"]} >= set(THIRDS)
    assert LongSummary.load(out / "summary.json") == summary


@pytest.mark.heavy
def test_each_s_is_tuned_at_that_s_and_trained_at_its_own_rates(design):
    out, summary, _ = design
    assert set(summary.tuning) == {"0", "1"}
    for s, tuning in summary.tuning.items():
        assert tuning.mode == "search" and tuning.tuned_on_s == float(s)
        assert set(tuning.searches) >= {"adamw.lr", "muon.lr"}
        for arm in ("adamw", "muon"):
            config = json.loads((out / "s" / f"s{s}" / "runs" / f"s{s}" / arm / "seed0" / "config.json").read_text())
            assert config["optimizer_options"]["lr"] == tuning.chosen[arm]["lr"]
            data = json.loads((out / "s" / f"s{s}" / "data" / f"s{s}" / "stats.json").read_text())
            assert data["config"]["s"] == float(s)


@pytest.mark.heavy
def test_the_summary_is_its_parts_primary_family_and_thirds(design):
    out, summary, _ = design
    parts = {s: LevelData.load(out / "s" / f"s{s:g}" / "analysis" / "levels.json") for s in (0.0, 1.0)}
    assert LongLevels.load(out / "levels.json").parts["1"].to_dict() == parts[1.0].to_dict()
    merged = merged_levels(parts)
    assert {r.s for r in merged.comparisons} == {0.0} and {t.s for t in merged.tracks} == {0.0, 1.0}
    assert summary.primary == primary_family(merged, judged=JUDGED)
    assert summary.thirds == by_thirds(parts)
    assert any(e.judged for e in summary.thirds)


@pytest.mark.heavy
def test_the_cli_runs_the_long_design_again_from_what_is_saved(design):
    out, _, _ = design
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("index.json")}
    result = runner.invoke(app, ["reproduce", "--preset", "long", "--out", str(out)])
    assert result.exit_code != 0 and "another configuration" in result.output  # the micro design's directory
    assert {p: p.stat().st_mtime_ns for p in out.rglob("index.json")} == stamps


def test_the_figure_draws_what_there_is(tmp_path):
    """Thirds not measured, a negative value on a log panel and one value of s: drawn around, not failed on."""
    from curvlab.output.long_page import long_figure
    from curvlab.studies.thirds import ThirdEstimate

    estimates = [
        ThirdEstimate("paired_direction_ratio", "hidden", 0.0, "early", 5.0, [4.0, 6.0], 6, "log-t"),
        ThirdEstimate("paired_direction_ratio", "hidden", 0.0, "middle", None, None, 0, "", note="not measured"),
        ThirdEstimate("between_nds_ratio_all", "all", 0.0, "late", -0.5, [-1.0, 0.2], 6, "fieller"),
        ThirdEstimate("rho_within_muon", "all", 0.0, "early", 0.4, None, 1, "t"),
    ]
    paths = long_figure(estimates, tmp_path / "long")
    assert all(p.stat().st_size > 0 for p in paths)
