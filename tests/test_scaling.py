"""The scaling design (``curvlab reproduce --preset scaling``, issue 51, docs/science.md section 17): the learning
rates follow the transfer rule, worked by hand at two widths; each rung changes the model's size and nothing
else; a row is its own levels' estimates and the fits are the log-log fit of the rows' per-seed values; the
design survives a stop and writes the schema issue 51 reads. On a micro-sized ladder of three widths."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from curvlab.cli import app
from curvlab.errors import CurvlabError
from curvlab.inference.loglog import log_log_fit
from curvlab.jobs.presets import PRESETS, SCALING_PRESETS
from curvlab.jobs.scaling import Scaling
from curvlab.models.gpt import GPT, get_config
from curvlab.output.scaling_page import publish_scaling, scaling_figure
from curvlab.studies.design import ScalingPreset, ScalingRung
from curvlab.studies.primary import estimated
from curvlab.studies.records import LevelData
from curvlab.studies.scaling import (
    QUANTITIES,
    RungResult,
    ScalingLevels,
    ScalingSummary,
    parameter_counts,
    scaling_fits,
    transferred_lrs,
)
from tests.builders import stopped_at_the_first_safe_point
from tests.test_cli import runner

MICRO_BASE = PRESETS["micro"].changed(name="smicro", s_values=(0.0,), arms=("adamw", "muon"), finetune=None)
RUNGS = (ScalingRung("w16", 16, n_head=2), ScalingRung("w32", 32, n_head=2), ScalingRung("w48", 48, n_head=2))
MICRO_DESIGN = ScalingPreset("smicro", MICRO_BASE, RUNGS, lr_table=None, base_width=32)


def test_the_transfer_rule_by_hand_at_two_widths():
    base = {"adamw": {"lr": 0.002}, "muon": {"lr": 0.01, "adam_lr": 0.002}}
    # width 160 from 80: AdamW's hidden lr halves (0.002 x 80/160), Muon's falls by sqrt(2) (0.01 / 1.41421...)
    assert transferred_lrs(base, 80, 160) == {
        "adamw": {"lr": 0.002, "hidden_lr": 0.001},
        "muon": {"lr": 0.00707107, "adam_lr": 0.002},
    }
    # width 20 from 80: AdamW's hidden lr x4, Muon's x2; embeddings, head and norms stay at 0.002
    assert transferred_lrs(base, 80, 20) == {
        "adamw": {"lr": 0.002, "hidden_lr": 0.008},
        "muon": {"lr": 0.02, "adam_lr": 0.002},
    }
    with pytest.raises(CurvlabError, match="positive integers"):
        transferred_lrs(base, 80, 0)


def test_the_rule_keeps_both_arms_hidden_update_rms_in_step():
    """What the rule is for: at every width, AdamW's hidden update RMS (about its lr, entrywise) over Muon's (its
    lr times the RMS of the scaled polar factor U V^T, here from an SVD of a random matrix of each hidden shape
    of the model) is the same, for every hidden matrix shape."""
    from curvlab.optim.muon import matrix_shape, muon_scale

    base = {"adamw": {"lr": 0.002}, "muon": {"lr": 0.01, "adam_lr": 0.002}}
    ratios: dict[tuple[float, float], list[float]] = {}
    for width in (64, 128, 256):
        lrs = transferred_lrs(base, 80, width)
        net = GPT(get_config("tiny", n_embd=width))
        hidden = [p for n, p in net.named_parameters() if p.dim() == 2 and n.startswith("transformer.h.")]
        for p in hidden:
            shape = matrix_shape(p)
            u, _, vh = torch.linalg.svd(torch.randn(shape, dtype=torch.float64), full_matrices=False)
            rms = muon_scale(shape, "original") * float((u @ vh).pow(2).mean().sqrt())
            ratio = lrs["adamw"]["hidden_lr"] / (lrs["muon"]["lr"] * rms)
            ratios.setdefault((shape[0] / width, shape[1] / width), []).append(ratio)
    assert len(ratios) >= 2  # square and MLP shapes
    for shape, r in ratios.items():
        assert max(r) / min(r) == pytest.approx(1.0, abs=1e-5), shape


def test_each_rung_changes_the_size_and_nothing_else():
    design = SCALING_PRESETS["scaling"]
    design.validate()
    base = design.base.flat()
    assert {k for k, v in base.items() if v != PRESETS["standard"].flat()[k]} <= {
        "name", "s_values", "matching", "analysis_batches", "track_interval", "track_batches", "controls",
        "stability_interval", "track_points", "arms", "sweep_arms",
    }  # fmt: skip
    sizes = []
    for rung in design.rungs:
        p = rung.preset(design.base)
        changed = {k for k, v in p.flat().items() if v != base[k]}
        assert changed == {"name", "model_overrides", "calibration"}, rung.name
        config = get_config(p.network.model, **p.network.model_overrides)
        assert (config.n_layer, config.block_size, config.vocab_size) == (4, 64, 4416)
        sizes.append(parameter_counts(p.network.model, p.network.model_overrides)[0])
    assert sizes == sorted(sizes) and 0.15e6 < sizes[0] < 0.25e6 and sizes[-1] / sizes[0] > 15 and len(sizes) >= 5
    gpu = SCALING_PRESETS["scaling-gpu"]
    top = gpu.rungs[-1].preset(gpu.base)
    config = get_config(top.network.model, **top.network.model_overrides)
    assert (top.network.model, config.n_embd, config.n_layer, config.block_size) == ("pcfg-9m", 288, 6, 64)


def test_parameter_counts_are_the_models_own():
    """Non-embedding: every parameter but the token and position embeddings and the head, counted on a real
    model; GPT-2 small's is the 85M the extrapolation is made at (124M with its tied embedding)."""
    net = GPT(get_config("tiny", n_embd=64))
    outer = ("transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight")
    inner = sum(p.numel() for n, p in net.named_parameters() if n not in outer)
    assert parameter_counts("tiny", {"n_embd": 64}) == (inner, sum(p.numel() for p in net.parameters()))
    assert parameter_counts("gpt2-124m") == (84_953_856, 124_373_760)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(seed_base=0), "are measured, tuned or checked"),
        (dict(seeds=2), "seeds >= 3"),
        (dict(rungs=RUNGS[:2]), "3 rungs or more"),
        (dict(rungs=(RUNGS[0], RUNGS[0], RUNGS[1])), "distinct names"),
        (dict(rungs=(*RUNGS[:2], ScalingRung("odd", 33, n_head=2))), "not a multiple of n_head"),
    ],
)
def test_a_ladder_that_cannot_hold_is_refused(change, message):
    with pytest.raises(CurvlabError, match=message):
        replace(MICRO_DESIGN, **change).validate()


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    """The micro ladder, stopped by a SIGTERM after its first seed's analysis, then run again to the end."""
    out = tmp_path_factory.mktemp("scaling") / "out"
    stopped_at_the_first_safe_point(Scaling(MICRO_DESIGN, out, progress=False))
    first = out / "rungs" / "w16" / "analysis" / "seed100.json"
    stamp = first.stat().st_mtime_ns
    summary = Scaling(MICRO_DESIGN, out, progress=False).run()
    return out, summary, first.stat().st_mtime_ns == stamp


@pytest.mark.heavy
def test_the_ladder_resumes_after_a_stop_and_writes_the_schema(ladder):
    out, summary, kept = ladder
    assert kept  # the first seed's analysis, saved before the stop, was read back, not made again
    assert summary.timing["invocations"] == 2
    assert len(json.loads((out / "timing.json").read_text())["invocations"]) == 2
    raw = json.loads((out / "summary.json").read_text())
    assert len(raw["sizes"]) == 3
    for row in raw["sizes"]:
        assert {"n_params", "n_embd", "n_layer", "lr", "n_seeds"} <= row.keys() and row["lr"].keys() == {
            "adamw",
            "muon",
        }
    for name, entry in raw["fit"].items():
        assert name in QUANTITIES and {"slope", "slope_ci95", "at_124m", "at_124m_pi95"} == entry.keys()
    assert ScalingSummary.load(out / "summary.json") == summary


@pytest.mark.heavy
def test_each_rung_ran_at_the_rule_and_checked_it(ladder):
    out, summary, _ = ladder
    for row, rung in zip(summary.sizes, RUNGS):
        lrs = transferred_lrs({"adamw": {"lr": 0.008}, "muon": {"lr": 0.04, "adam_lr": 0.008}}, 32, rung.n_embd)
        assert row.options == lrs and row.lr == {"adamw": lrs["adamw"]["hidden_lr"], "muon": lrs["muon"]["lr"]}
        for seed in summary.seeds:
            runs = out / "rungs" / rung.name / "runs" / "s0"
            adamw = json.loads((runs / "adamw" / f"seed{seed}" / "config.json").read_text())["optimizer_options"]
            assert adamw["lr"] == lrs["adamw"]["lr"] and adamw["hidden_lr"] == lrs["adamw"]["hidden_lr"]
            muon = json.loads((runs / "muon" / f"seed{seed}" / "config.json").read_text())["optimizer_options"]
            assert muon["lr"] == lrs["muon"]["lr"] and muon["adam_lr"] == lrs["muon"]["adam_lr"]
        # the check's grid is the rule's hidden lr x1/2, x1, x2, for each arm
        assert row.check["adamw"]["knob"] == "hidden_lr" and row.check["muon"]["knob"] == "lr"
        for arm in ("adamw", "muon"):
            rule = row.lr[arm]
            grid = row.check[arm]["grid"]  # (log2_grid keeps 6 significant digits)
            assert grid == pytest.approx([rule / 2, rule, rule * 2], rel=1e-5) and grid[1] == rule


@pytest.mark.heavy
def test_rows_are_their_levels_estimates_and_the_fits_the_rows_log_log_fit(ladder):
    out, summary, _ = ladder
    combined = ScalingLevels.load(out / "levels.json")
    for row in summary.sizes:
        levels = LevelData.load(out / "rungs" / row.rung / "analysis" / "levels.json")
        assert combined.rungs[row.rung].to_dict() == levels.to_dict()
        entries = dict(zip(QUANTITIES, estimated(levels, tuple(QUANTITIES.values()))))
        assert row.quantities == entries
        assert entries["between_nds_ratio_all"].scope == "all" and entries["between_nds_ratio"].scope == "hidden"
        assert row.n_params == parameter_counts("tiny", {**MICRO_BASE.network.model_overrides, "n_embd": row.n_embd,
                                                         "n_head": 2})[0]  # fmt: skip
    assert [f.quantity for f in summary.fits] == list(QUANTITIES)
    assert summary.at_124m == 84_953_856
    for f in summary.fits:
        # one point a rung: the geometric mean of its seeds' values, computed here from them
        kept = [r for r in summary.sizes if r.seed_values(f.quantity) and min(r.seed_values(f.quantity)) > 0]
        x = [r.n_params for r in kept]
        y = [math.exp(np.mean(np.log(r.seed_values(f.quantity)))) for r in kept]
        if f.fit is None:
            assert f.note
            continue
        assert f.fit == log_log_fit(x, y, summary.at_124m)
        assert f.judged == (f.quantity in ("between_nds_ratio_all", "q_ratio"))
        if f.judged and len(x) == len(summary.sizes):
            lo, hi = f.fit.slope_ci95
            assert f.trend == ("rises with size" if lo > 0 else "falls with size" if hi < 0 else "no trend resolved")
            pi = f.fit.prediction_pi95
            expected = "larger" if pi[0] > 1.76 else "smaller" if pi[1] < 1.76 else None
            assert f.against_paper in ((expected,) if expected else ("consistent", "uninformative"))
        assert summary.fit[f.quantity]["slope"] == f.fit.slope


class _Row(RungResult):
    """A rung's row as :func:`scaling_fits` reads it: its size and each quantity's per-seed values."""

    def __init__(self, rung: str, n_params: int, values: dict[str, list[float]]):
        object.__setattr__(self, "rung", rung)
        object.__setattr__(self, "n_params", n_params)
        object.__setattr__(self, "values", values)

    def seed_values(self, name: str) -> list[float]:
        return self.values.get(name, [])

    def value(self, name: str) -> float | None:
        return self.fit_value(name)

    def ci95(self, name: str) -> list[float] | None:
        return None


def test_the_fits_are_over_the_rungs_geometric_means_and_withhold_a_verdict_for_a_missing_rung():
    sizes = (2e5, 6e5, 1.8e6, 3.6e6)
    # each rung's seeds scatter around the power law 7 (N / 1e6)^-0.25 by factors whose geometric mean is 1
    law = {n: 7.0 * (n / 1e6) ** -0.25 for n in sizes}
    rows = [_Row(f"r{k}", int(n), {q: [law[n] / 1.5, law[n], law[n] * 1.5] for q in QUANTITIES}) for k, n in
            enumerate(sizes)]  # fmt: skip
    fits = {f.quantity: f for f in scaling_fits(rows, 84_953_856)}
    for f in fits.values():  # one point a rung, on the law: an exact fit
        assert f.fit.n == 4 and f.fit.slope == pytest.approx(-0.25)
        assert f.fit.prediction == pytest.approx(7.0 * 84.953856**-0.25)
    # zero-width intervals: the slope below 0, and the 124M interval (a point, 2.26) above 1.76
    assert fits["q_ratio"].trend == "falls with size" and fits["q_ratio"].against_paper == "larger"
    assert fits["paired_nds_ratio"].trend is None and not fits["paired_nds_ratio"].judged
    broken = [*rows[:3], _Row("r3", int(sizes[3]), {"q_ratio": [1.0, -0.5, 2.0], "alignment_ratio": []})]
    fits = {f.quantity: f for f in scaling_fits(broken, 84_953_856)}
    # a rung without an estimate: fitted on the others, named, and a judged fit's verdicts withheld
    for name in ("q_ratio", "alignment_ratio"):
        assert fits[name].fit.n == 3 and fits[name].fit.slope == pytest.approx(-0.25) and "r3" in fits[name].note
    assert (
        fits["q_ratio"].trend is None and fits["q_ratio"].against_paper is None and "withheld" in fits["q_ratio"].note
    )
    assert RungResult.fit_value(rows[0], "q_ratio") == pytest.approx(law[2e5])


def test_the_figure_draws_what_there_is(tmp_path):
    """A fit not measured, a rung without values and a negative seed value are drawn around, not failed on."""
    rows = [_Row("a", 200_000, {"q_ratio": [1.0, 2.0, 1.5]}), _Row("b", 600_000, {"q_ratio": [2.0, -1.0, 1.0]}),
            _Row("c", 1_800_000, {"q_ratio": [3.0, 2.5, 2.0]}), _Row("d", 3_000_000, {}),
            _Row("e", 5_000_000, {"q_ratio": [3.0, 3.5, 2.0]})]  # fmt: skip
    fits = scaling_fits(rows, 84_953_856)
    assert sum(f.fit is None for f in fits) == len(QUANTITIES) - 1
    paths = scaling_figure(rows, fits, tmp_path / "scaling")
    assert [p.suffix for p in paths] == [".png", ".pdf"] and all(p.stat().st_size > 0 for p in paths)


@pytest.mark.heavy
def test_the_published_page_shows_every_rung_and_fit(ladder, tmp_path):
    out, _, _ = ladder
    docs, page = tmp_path / "docs" / "scaling", tmp_path / "docs" / "scaling.md"
    result = runner.invoke(app, ["scaling-page", str(out), "--docs", str(docs), "--page", str(page)])
    assert result.exit_code == 0, result.output
    summary = ScalingSummary.load(out / "summary.json")
    assert ScalingSummary.load(docs / "summary.json") == summary
    assert (docs / "figures" / "scaling.png").stat().st_size > 0
    text = page.read_text()
    for row in summary.sizes:
        assert f"| {row.rung} |" in text
    assert "**extrapolated**" in text and "](scaling/figures/scaling.png)" in text
    publish_scaling(out, docs, page)  # again: the same page
    assert page.read_text() == text


def test_an_unknown_preset_names_the_scaling_designs():
    result = runner.invoke(app, ["reproduce", "--preset", "nope"])
    assert result.exit_code != 0 and "scaling" in result.output and "scaling-gpu" in result.output
