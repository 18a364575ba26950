"""The robustness design (``curvlab reproduce --preset robustness``, docs/science.md section 15): each setting
changes what it says and nothing else, its learning rates are the table's times its factor, and a row is
its own levels' paired ratio and controls. On a micro-sized design with three settings."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from curvlab.cli import app
from curvlab.errors import CurvlabError
from curvlab.jobs.presets import PRESETS, ROBUSTNESS_PRESETS
from curvlab.jobs.robustness import Robustness, scaled_lrs
from curvlab.models.gpt import get_config
from curvlab.output.robustness_page import publish_robustness
from curvlab.runs.checkpoint import read_index
from curvlab.studies.controls import controls
from curvlab.studies.design import RobustnessPreset, RobustnessSetting
from curvlab.studies.primary import primary_family
from curvlab.studies.records import LevelData
from curvlab.studies.robustness import RobustnessLevels, RobustnessSummary
from tests.test_cli import runner

PAIRED = "paired_direction_ratio"
MICRO_BASE = PRESETS["micro"].changed(name="rmicro", s_values=(0.0,), arms=("adamw", "muon"), finetune=None)
SETTINGS = (
    RobustnessSetting("base", "x1"),
    RobustnessSetting("adamw-lr-x0.5", "AdamW lr x0.5", {"adamw": 0.5}),
    RobustnessSetting("grammar1", "grammar draw 1", grammar_seed=1),
)
MICRO_DESIGN = RobustnessPreset("rmicro", MICRO_BASE, SETTINGS, lr_table=None)


def test_each_setting_changes_what_it_says_and_nothing_else():
    design = ROBUSTNESS_PRESETS["robustness"]
    design.validate()
    base = design.base
    assert base.flat() == {**PRESETS["quick"].flat(), "name": "robustness"}  # quick's design
    for setting in design.settings:
        p = setting.preset(base)
        changed = {k for k, v in p.flat().items() if v != base.flat()[k]}
        expected = {"name", "calibration"}
        expected |= {"s_values"} if setting.s is not None else set()
        expected |= {"grammar_seed"} if setting.grammar_seed is not None else set()
        expected |= {"model_overrides"} if setting.width_factor != 1 else set()
        assert changed == expected, setting.name
    width = next(x for x in design.settings if x.width_factor == 2).preset(base)
    doubled, plain = (get_config(x.network.model, **x.network.model_overrides) for x in (width, base))
    assert (doubled.n_embd, doubled.n_layer, doubled.n_head) == (2 * plain.n_embd, plain.n_layer, plain.n_head)
    factors = {(arm, f) for x in design.settings for arm, f in x.lr_factors.items()}
    assert factors == {("adamw", 0.25), ("adamw", 0.5), ("adamw", 2.0), ("muon", 0.5), ("muon", 2.0)}
    assert {x.s for x in design.settings} == {None, 1.0} and {x.grammar_seed for x in design.settings} == {None, 1}


def test_a_factor_scales_one_arms_own_lr():
    entry = {"chosen": {"adamw": {"lr": 0.008}, "muon": {"lr": 0.02, "adam_lr": 0.008}}}
    assert scaled_lrs(entry, {"adamw": 0.25}) == {"adamw": {"lr": 0.002}, "muon": {"lr": 0.02, "adam_lr": 0.008}}
    assert scaled_lrs(entry, {"muon": 2.0}) == {"adamw": {"lr": 0.008}, "muon": {"lr": 0.04, "adam_lr": 0.008}}
    assert entry["chosen"]["adamw"] == {"lr": 0.008}  # the table's entry is left as it was


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(seed_base=0), "are measured, tuned or checked"),
        (dict(seeds=2), "seeds >= 3"),
        (dict(settings=(SETTINGS[0], SETTINGS[0])), "distinct names"),
        (dict(settings=(RobustnessSetting("x", "x", {"sgd": 2.0}),)), "adamw and muon only"),
    ],
)
def test_a_design_that_cannot_hold_is_refused(change, message):
    with pytest.raises(CurvlabError, match=message):
        replace(MICRO_DESIGN, **change).validate()


@pytest.fixture(scope="module")
def design(tmp_path_factory):
    out = tmp_path_factory.mktemp("robustness") / "out"
    return out, Robustness(MICRO_DESIGN, out, progress=False).run()


def _levels(out, name) -> LevelData:
    return LevelData.load(out / "settings" / name / "analysis" / "levels.json")


@pytest.mark.heavy
def test_a_row_is_its_own_levels_paired_ratio_and_controls(design):
    out, summary = design
    assert [x.setting for x in summary.settings] == [x.name for x in SETTINGS]
    assert summary.seeds == [100, 101, 102]
    combined = RobustnessLevels.load(out / "levels.json")
    for row in summary.settings:
        levels = _levels(out, row.setting)
        assert combined.settings[row.setting].to_dict() == levels.to_dict()
        entry = next(e for e in primary_family(levels, judged=("paired_direction_ratio",)) if e.name == PAIRED)
        assert (row.paired_ratio, row.ci95, row.n_seeds) == (entry.value, entry.ci95, entry.n_seeds)
        assert row.n_seeds == 3 and row.paired_ratio is not None and row.paired_ratio > 0
        assert sorted({t.seed for t in levels.tracks}) == [100, 101, 102]
        measured = [c for c in controls(levels) if c.passed is not None]
        assert row.controls_passed == all(c.passed for c in measured)
        assert row.failed_controls == [f"{c.name} ({c.arm})" for c in measured if not c.passed]
    assert RobustnessSummary.load(out / "summary.json") == summary


@pytest.mark.heavy
def test_the_lr_factor_reaches_its_arm_and_only_its_arm(design):
    out, summary = design
    base, half = summary.setting("base"), summary.setting("adamw-lr-x0.5")
    assert half.lr["adamw"]["lr"] == base.lr["adamw"]["lr"] / 2 and half.lr["muon"] == base.lr["muon"]
    for seed in summary.seeds:
        runs = {name: out / "settings" / name / "runs" / "s0" for name in ("base", "adamw-lr-x0.5")}
        configs = {name: json.loads((r / "adamw" / f"seed{seed}" / "config.json").read_text()) for name, r in
                   runs.items()}  # fmt: skip
        assert configs["adamw-lr-x0.5"]["optimizer_options"]["lr"] == half.lr["adamw"]["lr"]
        # Muon's run is the same run (its AdamW shadow's lr changes no step of its own), bit for bit
        losses = {name: [e["val_loss"] for e in read_index(r / "muon" / f"seed{seed}")] for name, r in runs.items()}
        assert losses["base"] == losses["adamw-lr-x0.5"]
        adamw = {name: [e["val_loss"] for e in read_index(r / "adamw" / f"seed{seed}")] for name, r in runs.items()}
        assert adamw["base"] != adamw["adamw-lr-x0.5"]


@pytest.mark.heavy
def test_adams_direction_at_muons_checkpoints_does_not_depend_on_its_lr(design):
    """NDS is scale-invariant and Adam's moments don't see the lr, so at the same Muon checkpoints AdamW's
    shadow direction at half the lr has the same NDS (to float rounding): what an lr setting changes is
    where the curvature is read (AdamW's own trajectory and the matched levels), not the direction."""
    out, _ = design
    rows = {name: {(t.seed, r.step): r for t in _levels(out, name).track("muon", 0.0) for r in t.rows}
            for name in ("base", "adamw-lr-x0.5")}  # fmt: skip
    assert rows["base"].keys() == rows["adamw-lr-x0.5"].keys()
    key = "paired_nds_adamw_hidden"
    compared = 0
    for point, row in rows["base"].items():
        a, b = row.paired.get(key), rows["adamw-lr-x0.5"][point].paired.get(key)
        if a is None or not math.isfinite(a):
            continue
        assert b == pytest.approx(a, rel=1e-3, abs=1e-6), point
        compared += 1
    assert compared >= 3


@pytest.mark.heavy
def test_another_grammar_draw_is_other_data(design):
    out, _ = design
    stats = {name: json.loads((out / "settings" / name / "data" / "s0" / "stats.json").read_text())
             for name in ("base", "grammar1")}  # fmt: skip
    assert stats["base"]["config"]["seed"] == 0 and stats["grammar1"]["config"]["seed"] == 1
    assert stats["base"]["vocab_size"] == stats["grammar1"]["vocab_size"]
    assert stats["base"]["train"] != stats["grammar1"]["train"]


@pytest.mark.heavy
def test_a_rerun_reads_every_setting_back(design):
    out, summary = design
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("index.json")}
    again = Robustness(MICRO_DESIGN, out, progress=False).run()
    assert again.settings == summary.settings
    assert {p: p.stat().st_mtime_ns for p in out.rglob("index.json")} == stamps  # nothing trained again
    with pytest.raises(CurvlabError, match="another configuration"):
        Robustness(replace(MICRO_DESIGN, seed_base=200), out, progress=False).run()


@pytest.mark.heavy
def test_the_published_page_quotes_the_reference(design, tmp_path):
    out, summary = design
    docs, page = tmp_path / "docs" / "robustness", tmp_path / "docs" / "robustness.md"
    publish_robustness(out, docs, page, Path("docs/results/quick/summary.json"))
    # the rerun test rewrote summary.json's timing: the page publishes what is on disk now
    summary = RobustnessSummary.load(out / "summary.json")
    assert RobustnessSummary.load(docs / "summary.json") == summary
    assert RobustnessLevels.load(docs / "levels.json").settings.keys() == {x.name for x in SETTINGS}
    assert (docs / "figures" / "robustness_ratios.png").stat().st_size > 0
    text = page.read_text()
    assert (
        "Reference, the quick reproduction (6 seeds)" in text and "](robustness/figures/robustness_ratios.png)" in text
    )
    for row in summary.settings:
        assert f"| {row.label} |" in text


def test_an_unknown_preset_names_the_robustness_design():
    result = runner.invoke(app, ["reproduce", "--preset", "nope"])
    assert result.exit_code != 0 and "robustness" in result.output
