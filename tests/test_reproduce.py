import dataclasses
import json
import math
import os
import signal
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient
from typer.testing import CliRunner

from curvlab.cli import app
from curvlab.curvature.scalars import CheckpointScalars
from curvlab.data.shards import TrainBatches
from curvlab.errors import CurvlabError
from curvlab.inference.statistics import CONTRADICTED, DESCRIPTIVE, INCONCLUSIVE, SUPPORTED
from curvlab.jobs import measure, side_studies
from curvlab.jobs.presets import PRESETS
from curvlab.jobs.reproduce import Reproduction
from curvlab.output.text import (
    readme_markers,
    render_readme_results,
    render_readme_teaser,
    update_readme,
    value_cell,
)
from curvlab.studies.compare import Comparison, Level, WindowSide
from curvlab.studies.controls import CONTROL_NAMES, TWIN_TOLERANCE
from curvlab.studies.headline import headline
from curvlab.studies.records import ComparisonRecord, LevelData
from curvlab.studies.summary import Summary
from curvlab.util.safe_stop import Stopped
from tests.builders import assert_made_with_these_packages
from tests.micro_fixture import FIXTURE, fixture_text, key_paths, machine, normalized, run_micro

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
VERDICTS = {DESCRIPTIVE}  # the headline is descriptive: only the primary family is judged


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    out = tmp_path_factory.mktemp("micro") / "results"
    return out, run_micro(out)  # (on one thread, as the fixture of the last test below was made)


@pytest.mark.heavy
def test_micro_preset_writes_every_output(micro):
    out, summary = micro
    for name in (
        "report.md",
        "summary.json",
        "tuning.json",
        "reproduce.json",
        "timing.json",
        "quadratic/quadratic.json",
        "finetune/finetune.json",
        "finetune/tuning.json",
    ):
        assert (out / name).is_file(), name
    for name in (
        "levels.json",
        "compare-muon-seed0/compare.json",
        "compare-muon-moonlight-seed1/compare.csv",
        "track-s0-muon-seed0/track.json",
        "track-s1-adamw-seed1/track.json",
    ):
        assert (out / "analysis" / name).is_file(), name
    for paths in summary.figures.values():
        for p in paths:
            assert (out / p).stat().st_size > 1000, p
    expected = {
        "fig1_taylor_split",
        "fig2_nds_update_norm",
        "fig3_zipf_nds",
        "fig4_within_cross",
        "fig7_quadratic_phase",
        "fig7_quadratic_trajectories",
        "block_matrix_heatmap",
        "within_gap_by_layer",
        "tuning_grids",
    }
    expected.add("fig0_primary_forest")  # the primary family's forest plot
    assert {Path(p).stem for ps in summary.figures.values() for p in ps} == expected
    stages = {"data", "tune", "train", "compare", "track", "finetune", "summary", "figures", "total"}
    assert stages <= set(summary.timing)
    assert "Curvature of adapter steps" in (out / "report.md").read_text()


@pytest.mark.heavy
def test_only_the_matched_windows_and_the_last_checkpoint_are_kept(micro):
    from curvlab.jobs.pruning import _run_key, window_checkpoints
    from curvlab.runs.checkpoint import read_index

    out, summary = micro
    levels = LevelData.load(out / "analysis" / "levels.json")
    read = window_checkpoints(levels.comparisons)
    runs = [p.parent for p in (out / "runs").glob("s*/*/seed*/index.json")]
    assert len(runs) == 5 * PRESETS["micro"].seeds  # 3 arms at s = 0, 2 at s = 1
    deleted = 0
    for run in runs:
        index = read_index(run)
        for entry in index:
            path = (run / entry["path"]).resolve()
            if path.is_file():
                assert entry is index[-1] or _run_key(path) in read, path
            else:
                deleted += 1
        assert (run / index[-1]["path"]).is_file()  # a finished run keeps its last checkpoint
    assert deleted > 0 and summary.disk_bytes > 0


@pytest.mark.heavy
def test_a_moved_output_directory_reruns_and_keeps_its_windows(micro, tmp_path):
    import shutil

    from curvlab.jobs.pruning import window_checkpoints

    out, _ = micro
    moved = tmp_path / "moved"
    shutil.copytree(out, moved)  # the records inside still name the old place
    shutil.rmtree(moved / "finetune")  # its config names the base run by its old path, and would be refused
    before = sorted(p.relative_to(moved) for p in (moved / "runs").rglob("ckpt_*.pt"))
    Reproduction(PRESETS["micro"], moved, progress=False).run()
    assert sorted(p.relative_to(moved) for p in (moved / "runs").rglob("ckpt_*.pt")) == before
    levels = LevelData.load(moved / "analysis" / "levels.json")
    assert window_checkpoints(levels.comparisons, moved / "analysis" / "reports")  # read by name in its new place
    headline = json.loads((moved / "summary.json").read_text())["headline"]
    assert headline == json.loads((out / "summary.json").read_text())["headline"]  # (NaN is null there)


@pytest.mark.heavy
def test_keeping_only_the_last_checkpoints_changes_no_result(micro, tmp_path):
    """``keep="last"`` (quick's and standard's) on a re-run of a finished directory: every run keeps its
    last checkpoint only, the configuration guard does not refuse it, and every number is unchanged."""
    import shutil

    from curvlab.runs.checkpoint import read_index

    out, _ = micro
    again = tmp_path / "again"
    shutil.copytree(out, again)
    shutil.rmtree(again / "finetune")  # its config names the base run by its old path, and would be refused
    Reproduction(PRESETS["micro"].changed(keep="last"), again, progress=False).run()
    for run in (p.parent for p in (again / "runs").glob("s*/*/seed*/index.json")):
        index = read_index(run)
        kept = sorted(p.name for p in run.glob("ckpt_*.pt"))
        assert kept == [Path(index[-1]["path"]).name], run
    pruned, first = (json.loads((d / "summary.json").read_text()) for d in (again, out))
    for key in ("headline", "primary", "calibration", "final_val_loss"):
        assert pruned[key] == first[key], key
    with pytest.raises(CurvlabError, match="keep must be one of"):
        Reproduction(PRESETS["micro"].changed(keep="some"), tmp_path / "bad", progress=False)


@pytest.mark.heavy
def test_a_reproduction_stopped_by_sigterm_mid_training_resumes_to_the_same_numbers(micro, tmp_path, monkeypatch):
    """A real SIGTERM in the middle of seed 1's training: the job stops at the next safe point (exit
    status 143, one line), and running it again ends with every number of an uninterrupted run."""
    out, _ = micro
    real_seed, real_next = measure.measure_seed, TrainBatches.next
    state = {"seed": None, "sent": False}

    def seed(job, preset, seed, *args):
        state["seed"] = seed
        return real_seed(job, preset, seed, *args)

    def next_batch(self):
        if state["seed"] == 1 and not state["sent"]:
            state["sent"] = True
            os.kill(os.getpid(), signal.SIGTERM)
        return real_next(self)

    monkeypatch.setattr(measure, "measure_seed", seed)
    monkeypatch.setattr(TrainBatches, "next", next_batch)
    again = tmp_path / "again"
    with pytest.raises(Stopped) as e:
        run_micro(again)  # (on one thread, as ``micro``)
    assert state["sent"] and e.value.exit_code == 143 and "\n" not in str(e.value)
    assert not (again / "summary.json").exists() and (again / "analysis" / "seed0.json").is_file()
    monkeypatch.undo()
    run_micro(again)
    resumed, first = (json.loads((d / "summary.json").read_text()) for d in (again, out))
    for key in ("headline", "primary", "calibration", "final_val_loss", "zipf", "taylor"):
        assert resumed[key] == first[key], key


@pytest.mark.heavy
def test_summary_schema(micro):
    out, _ = micro
    data = json.loads((out / "summary.json").read_text())
    names = {e["name"] for e in data["headline"]}
    assert {"nds_ratio", "nds_ratio_median", "nds_ratio_moonlight", "nds_ratio_equal_step", "gap_change"} <= names
    for e in data["headline"]:
        assert {"name", "scope", "value", "ci95", "n_levels", "n_seeds", "per_level", "paper", "verdict"} <= set(e)
        assert e["scope"] in ("all", "hidden") and e["verdict"] in VERDICTS
        if e["value"] is not None and e["n_seeds"] >= 2 and e["ci95"] is not None:
            lo, hi = e["ci95"]
            assert lo <= hi
    for name in ("nds_ratio", "update_norm_ratio", "gap_s0"):
        assert {e["scope"] for e in data["headline"] if e["name"] == name} == {"all", "hidden"}  # both scopes
    assert_made_with_these_packages(data["versions"])
    assert "Made with Python " in (out / "report.md").read_text()
    for e in data.get("primary", []):
        assert {"name", "scope", "value", "ci95", "n_seeds", "n_units", "paper", "direction", "magnitude"} <= set(e)
        if e["n_seeds"] >= 3:  # judged, Holm-corrected
            assert e["direction"] in (SUPPORTED, CONTRADICTED, INCONCLUSIVE) and 0 <= e["p_holm"] <= 1, e
        else:
            assert e["direction"] in ("descriptive: fewer than 3 seeds", "not measured") and e["p_holm"] is None, e
    assert {e["name"] for e in data["primary"]} >= {"paired_direction_ratio", "between_nds_ratio"}
    paired = next(e for e in data["primary"] if e["name"] == "paired_direction_ratio")
    assert paired["n_seeds"] == PRESETS["micro"].seeds and paired["value"] is not None  # the shadows are measured
    # 4 seeds: A/A pairs (0, 1), (1, 2), (2, 3) for each arm, put through the between-run claims; and each
    # arm's exchangeable twin through the paired claim and direction efficiency (the trajectory claims' A/A
    # needs both s at 3 pairs, which micro's runs don't reach off the plateau)
    cal = data["calibration"]
    assert cal["n_tests"] == 8 and cal["pairs"] == [[0, 1], [1, 2], [2, 3]] and cal["kind"] == "smoke test"
    claims = ["paired_direction_ratio", "between_nds_ratio", "alignment_ratio", "direction_efficiency_ratio"]
    assert cal["claims"] == claims
    assert cal["false_verdict_rate"] == sum(t["false"] for t in cal["per_test"]) / 8
    assert all(t["value"] is not None and t["p_exact"] is not None for t in cal["per_test"])
    # every control, per arm, measured (micro's runs keep their twins)
    names = [(c["name"], c["arm"]) for c in data["controls"]]
    for arm in ("adamw", "muon"):
        assert [n for n, a in names if a == arm] == list(CONTROL_NAMES)
    twins = [c for c in data["controls"] if c["name"] == "twin_shadow"]
    assert all(c["passed"] is True and c["detail"]["max_abs_deviation"] <= TWIN_TOLERANCE for c in twins), twins
    assert {(e["arm"], e["quantity"]) for e in data["edge_of_stability"]} >= {
        ("adamw", "lambda_max"),
        ("muon", "lambda_max"),
    }
    assert all(e["value"] is not None for e in data["edge_of_stability"] if e["quantity"] == "lambda_max")
    nds = next(e for e in data["headline"] if e["name"] == "nds_ratio" and e["scope"] == "all")
    assert (
        nds["n_seeds"] == PRESETS["micro"].seeds
        and nds["paper"] == 1.76
        and len(nds["per_level"]) == nds["n_levels"] >= 2
    )
    tuning = json.loads((out / "tuning.json").read_text())
    measured = set(range(PRESETS["micro"].seeds))
    assert set(tuning["searches"]) == {"adamw.lr", "muon.lr"}  # the control arm is set, not tuned
    for search in tuning["searches"].values():
        assert len(search["grid"]) >= 2 and all(len(v) == 1 for v in search["grid"].values())
        assert f"{search['chosen']:g}" in search["grid"]
        assert search["seeds"] and not set(search["seeds"]) & measured  # tuning seeds are never measured
    assert tuning["horizon_steps"] == PRESETS["micro"].tuning_settings.horizon_steps
    # the control arm's lr gives it AdamW's hidden ||Z|| at the levels it was set from (an estimate from the
    # shapes: the Newton–Schulz factor's singular values are near 1, not exactly 1)
    control = tuning["chosen"]["muon-moonlight"]
    first = LevelData.load(out / "analysis" / "levels.json").matched("adamw/muon-moonlight")[0].comparison
    ratios = [lv.b.mean["hidden_update_norm"] / lv.a.mean["hidden_update_norm"] for lv in first.headline_levels]
    assert control["set_from_seed"] == 0 and 0.8 < np.mean(ratios) < 1.25
    assert tuning["chosen"]["muon"]["adam_lr"] == tuning["chosen"]["adamw"]["lr"]  # tied, and the report says so
    assert any("not tuned on its own" in n for n in data["notes"])


@pytest.mark.heavy
def test_every_summary_number_is_rederivable_from_the_per_level_json(micro):
    out, summary = micro
    raw = json.loads((out / "analysis" / "levels.json").read_text())
    again, zipf = headline(LevelData.from_dict(raw))
    assert json.dumps([e.to_dict() for e in again]) == json.dumps([e.to_dict() for e in summary.headline])
    assert [dataclasses.asdict(z) for z in zipf] == [dataclasses.asdict(z) for z in summary.zipf]
    # and independently of curvlab.studies.headline, from the raw JSON: the NDS ratio is a ratio of sums of window means
    num = den = 0.0
    for record in raw["comparisons"]:
        if record["name"] != "adamw/muon" or record["comparison"] is None:
            continue
        for level in record["comparison"]["pairs"]:
            if not level["on_plateau"]:
                num += np.mean([m["nds"] for m in level["a"]["members"]])  # side a is AdamW's
                den += np.mean([m["nds"] for m in level["b"]["members"]])
    assert summary.entry("nds_ratio").value == pytest.approx(num / den, rel=1e-12)
    # the Zipf ratio: Muon's trajectory NDS at s = 1 over its own at s = 0, every tracked point in the stable phase
    warm = PRESETS["micro"].training.warmup_steps

    def pooled(arm, s):
        tracks = [t for t in raw["tracks"] if t["arm"] == arm and t["s"] == s]
        rows = [r for t in tracks for r in t["rows"] if r["step"] >= warm and r["phase"] == "stable"]
        return np.mean([r["nds"] for r in rows])

    assert summary.entry("normalized_nds_muon_s1").value == pytest.approx(pooled("muon", 1.0) / pooled("muon", 0.0))


def test_tracking_only_the_read_checkpoints_changes_no_claim(micro, monkeypatch):
    """``track_points="read"`` (quick's) analyses of each run only the tracked checkpoints inside the stable
    phase and off the unigram plateau, and every primary claim's inputs, the controls and the A/A are those of
    the full trajectories (micro tracks all of its checkpoints: ``track_run`` is stood in for by their rows);
    and the alignment claim reads the own step's cos(G, Z) from the plain scalars, as the shadowed points give
    it (an A/A comparison measures no shadow)."""
    from curvlab.jobs.reproduce import plateaus
    from curvlab.studies.controls import controls
    from curvlab.studies.primary import PRIMARY, calibration
    from curvlab.studies.seed_values import claim_inputs

    out, summary = micro
    data = LevelData.load(out / "analysis" / "levels.json")
    preset = PRESETS["micro"].changed(track_points="read")
    job = Reproduction(preset, out, progress=False)
    full = {(t.arm, t.s, t.seed): t for t in data.tracks}
    asked = {}

    def track_run(run, analysis, settings, *, steps, **kw):
        key = (run.parent.name, float(run.parent.parent.name[1:]), int(run.name[4:]))
        asked[key] = steps
        return [r for r in full[key].rows if r.step in steps]

    monkeypatch.setattr(measure, "track_run", track_run)
    ceilings = plateaus(preset, {s: out / "data" / f"s{s:g}" for s in data.s_values})
    tracks = [measure.track(job, preset, t.s, t.arm, t.seed, ceilings[t.s]) for t in data.tracks]
    for t in data.tracks:
        assert asked.get((t.arm, t.s, t.seed), []) == [r.step for r in t.after_warmup()]
    read = LevelData(data.comparisons, tracks, data.plateau_ceiling, data.s_values)
    assert sum(len(t.rows) for t in tracks) < sum(len(t.rows) for t in data.tracks)  # (something was left out)
    primary = [r for r in data.comparisons if r.name == "adamw/muon"]
    for claim in PRIMARY:
        assert claim_inputs(claim, read, primary) == claim_inputs(claim, data, primary), claim.name
    assert controls(read, True) == controls(data, True)
    pairs = [tuple(p) for p in summary.calibration.pairs]
    assert calibration(data.comparisons, data=read, pairs=pairs) == calibration(
        data.comparisons, data=data, pairs=pairs
    )
    for record in primary:
        for level in record.comparison.levels:
            for side in (level.a, level.b):
                for m in side.members:
                    own = m.paired[f"paired_cos_{side.optimizer}_hidden"]
                    assert m.value("hidden_cosine") == pytest.approx(own, rel=1e-12, abs=1e-15)


def _side(optimizer, nds_values, ok):
    members = [
        {
            "step": 10 + i,
            "val_loss": 4.0,
            "nds": x,
            "first_order": 1.0,
            "curvature_penalty": 0.5,
            "update_norm": 1.0,
            "taylor_error": 0.0 if good else 3.0,
            "taylor_ok": good,
        }
        for i, (x, good) in enumerate(zip(nds_values, ok))
    ]
    return WindowSide(optimizer, 11, 4.0, 1.0, 0.01, [CheckpointScalars.from_dict(m) for m in members], [])


def test_the_taylor_check_never_filters_nds_means():
    """A window member whose Taylor prediction fails keeps its NDS in every mean; the failure is counted."""
    level = Level(
        4.0,
        0.0,
        False,
        _side("adamw", [1.0, 9.0, 2.0], [True, False, True]),
        _side("muon", [1.0, 1.0, 1.0], [True] * 3),
    )
    c = Comparison([level], "adamw/muon", [], ("adamw", "muon"))
    assert level.a.mean["nds"] == pytest.approx(4.0) and level.a.taylor_failures == 1
    assert c.ratio_of_means["nds"] == pytest.approx(4.0) and c.mean_ratios["nds"] == pytest.approx(4.0)
    plateau = Level(6.0, 0.0, True, _side("adamw", [50.0], [True]), _side("muon", [1.0], [True]))
    assert Comparison([level, plateau], "adamw/muon", [], ("adamw", "muon")).ratio_of_means["nds"] == pytest.approx(4.0)


@pytest.mark.heavy
def test_missing_comparisons_and_single_seeds_are_inconclusive_never_bare_numbers(micro):
    out, _ = micro
    data = LevelData.load(out / "analysis" / "levels.json")
    failed = dataclasses.replace(
        data, comparisons=[ComparisonRecord("adamw/muon", 0, 0.0, None, "the validation losses never overlap")]
    )
    entries, _ = headline(failed)
    nds = next(e for e in entries if e.name == "nds_ratio")
    assert nds.value is None and nds.verdict == DESCRIPTIVE and "never overlap" in nds.note
    one_seed = dataclasses.replace(
        data,
        comparisons=[r for r in data.comparisons if r.seed == 0],
        tracks=[t for t in data.tracks if t.seed == 0],
    )
    entries, _ = headline(one_seed)
    for e in entries:
        if e.value is not None:
            assert e.ci95 is None and e.verdict == DESCRIPTIVE and "no interval" in e.note, e.name
    assert "no interval" in value_cell(entries[0])


@pytest.mark.heavy
def test_report_and_readme_render_the_summary(micro, tmp_path):
    out, summary = micro
    report = (out / "report.md").read_text()
    for e in summary.headline:
        assert f"| {e.quantity} | {e.scope} | {value_cell(e)} |" in report
    assert f"Finished in {summary.seconds:.0f} s" in report and "not tuned on its own" in report
    assert "| muon.lr |" in report and "## Matched levels" in report
    for arm, counts in summary.taylor.items():
        assert f"- {arm}: {counts['failed']} of {counts['checked']} analysed checkpoints fail it." in report
    for figure in summary.figures.values():
        for p in figure:
            if p.endswith(".png"):
                assert f"({p})" in report
    readme = tmp_path / "README.md"
    begin, end = readme_markers(summary.preset)
    other = "\n".join(readme_markers("standard"))  # another preset's section is left alone
    readme.write_text(f"# x\n\n## Results\n\n{begin}\nold table\n{end}\n\n{other}\n\n## Next\n")
    page = tmp_path / "docs" / "results.md"
    update_readme(out, readme, tmp_path / "docs" / "results", page=page)
    text = readme.read_text()
    assert "old table" not in text and text.startswith("# x\n") and text.endswith(f"{other}\n\n## Next\n")
    loaded = Summary.load(out / "summary.json")
    assert render_readme_teaser(loaded, "docs/results", "docs/results.md") in text  # links relative to the README
    assert render_readme_results(loaded, "results") in page.read_text()  # ... and to the page
    assert "(docs/results.md)" in text
    for holder in (readme, page):  # every image shown exists, seen from the file that shows it
        shown = [line.split("(")[1].rstrip(")") for line in holder.read_text().splitlines() if line.startswith("![")]
        assert shown and all((holder.parent / p).is_file() for p in shown), holder
    plain = tmp_path / "plain.md"
    plain.write_text("# no markers\n")
    with pytest.raises(ValueError, match="no results markers"):
        update_readme(out, plain, tmp_path / "figures")
    # a page alone (a design the README has no section for), through the CLI: the README is left as it was
    alone = tmp_path / "docs" / "alone.md"
    args = ["readme-results", str(out), "--readme", str(plain), "--figures", str(tmp_path / "docs" / "alone")]
    refused = CliRunner().invoke(app, [*args, "--page-only"])
    assert refused.exit_code != 0 and "--page-only needs --page" in refused.output and not alone.exists()
    written = CliRunner().invoke(app, [*args, "--page-only", "--page", str(alone)])
    assert written.exit_code == 0, written.output
    assert plain.read_text() == "# no markers\n"
    assert render_readme_results(loaded, "alone") in alone.read_text()


@pytest.mark.heavy
def test_rerun_continues_and_other_config_is_refused(micro, monkeypatch):
    out, _ = micro
    import curvlab.jobs.reproduce as reproduce

    results = []
    real_train = reproduce.train

    def recording_train(cfg, progress=True):
        results.append((cfg, real_train(cfg, progress=False)))
        return results[-1][1]

    monkeypatch.setattr(reproduce, "train", recording_train)
    first = json.loads((out / "summary.json").read_text())
    Reproduction(PRESETS["micro"], out, progress=False).run()
    assert all(r.resumed_from == cfg.steps for cfg, r in results)  # no run trained a single step more
    again = json.loads((out / "summary.json").read_text())
    assert again["headline"] == first["headline"]  # each seed's analysis is read back, not redone
    assert not any("tune" in cfg.out for cfg, _ in results)  # finished tuning runs are read from their index
    with pytest.raises(ValueError, match="another configuration"):
        Reproduction(PRESETS["quick"], out, progress=False).run()


def test_paper_preset_without_data_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="--fineweb"):
        Reproduction(PRESETS["paper"], tmp_path / "paper", progress=False)
    with pytest.raises(ValueError, match="no such data directory"):
        Reproduction(PRESETS["paper"], tmp_path / "paper", fineweb=tmp_path / "nowhere", progress=False)


@pytest.mark.heavy
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebooks_run_against_a_results_set(micro, path, tmp_path, monkeypatch):
    out, _ = micro
    monkeypatch.setenv("CURVLAB_RESULTS", str(out))
    monkeypatch.setenv("CURVLAB_FIGURES", str(tmp_path / "figures"))
    nb = nbformat.read(path, as_version=4)
    assert all(not cell.get("outputs") for cell in nb.cells if cell.cell_type == "code")  # committed clean
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert any(p.suffix == ".png" for p in (tmp_path / "figures").iterdir())


def test_fineweb_stage_plumbing_with_a_small_model(tmp_path):
    """The paper preset's FineWeb comparison, with a small model on fake GPT-2-token shards."""
    from curvlab.data.shards import write_shard

    shards = tmp_path / "fineweb"
    rng = np.random.default_rng(0)
    write_shard(shards / "fineweb_train_000001.bin", rng.integers(0, 300, 40_000))
    write_shard(shards / "fineweb_val_000000.bin", rng.integers(0, 300, 5_000))
    preset = PRESETS["micro"].changed(
        fineweb=True,
        fineweb_model="tiny",
        fineweb_steps=16,
        fineweb_batch_size=8,
        fineweb_ckpt_every=2,
        fineweb_model_overrides={"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "vocab_size": 320},
        matching=dataclasses.replace(PRESETS["micro"].measurement.matching, tolerance=0.2),
    )
    reproduction = Reproduction(preset, tmp_path / "out", fineweb=shards, progress=False)
    result = side_studies.fineweb(
        reproduction, preset, reproduction.fineweb
    )  # the stage alone: micro above is the rest
    assert result.levels >= 1 and set(result.ratio_of_means) == {
        "nds",
        "first_order",
        "curvature_penalty",
        "update_norm",
    }
    assert all(math.isfinite(v) for v in result.ratio_of_means.values())
    config = json.loads((tmp_path / "out" / "runs" / "fineweb" / "muon" / "config.json").read_text())
    assert config["optimizer_options"] == {"lr": 0.02} and config["data"] == str(shards)
    assert config["schedule"] == "wsd"


@pytest.mark.heavy
def test_the_micro_results_are_the_fixtures(micro):
    """Issue 49: presets became records and the reproduction a pipeline of stages, and no number moved
    (the fixture then was made at 03a10c4, before the change). Issue 50 changed the design on purpose (the
    exchangeable twins and held-out H at every point, direction efficiency, the Lanczos rule), so the fixture
    is made again with it (``python -m tests.micro_fixture``), and pins every number against later changes
    of structure. On the machine, thread count and packages they were made
    with, the files are byte-identical but for the software's versions, the times, the run's directory and
    the cache keys in report paths (:func:`~tests.micro_fixture.normalized`; ``hvp_method`` reads as
    ``method``). Elsewhere floats differ (a run there is a replicate, not a copy), so there the files are
    compared by structure: the same key paths."""
    out, _ = micro
    same_machine = machine() == json.loads((FIXTURE / "machine.json").read_text())
    for name, path in (("summary.json", out / "summary.json"), ("levels.json", out / "analysis" / "levels.json")):
        before, before_out = fixture_text(name)
        if same_machine:
            assert normalized(path.read_text(), out) == normalized(before, before_out), name
        else:
            now, then = (json.loads(normalized(t, o)) for t, o in ((path.read_text(), out), (before, before_out)))
            assert key_paths(now) == key_paths(then), name
