import json
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from curvlab.reproduce import PRESETS, Reproduction, _fineweb_lines

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.fixture(scope="module")
def micro(tmp_path_factory):
    out = tmp_path_factory.mktemp("micro") / "results"
    summary = Reproduction(PRESETS["micro"], out, progress=False).run()
    return out, summary


def test_micro_preset_writes_every_output(micro):
    out, summary = micro
    for name in ("report.md", "summary.json", "tuning.json", "reproduce.json", "quadratic/quadratic.json"):
        assert (out / name).is_file(), name
    for name in ("compare/compare.json", "compare/compare.csv", "zipf.json", "track-s0-muon/track.json"):
        assert (out / "analysis" / name).is_file(), name
    for paths in summary["figures"].values():
        for p in paths:
            assert (out / p).stat().st_size > 1000, p
    expected = {"fig1_taylor_split", "fig2_nds_update_norm", "fig3_zipf_nds", "fig4_within_cross", "fig7_quadratic_phase",
                "fig7_quadratic_trajectories", "block_matrix_heatmap", "within_gap_by_layer"}  # fmt: skip
    assert {Path(p).stem for ps in summary["figures"].values() for p in ps} == expected


def test_report_numbers_match_the_json_results(micro):
    out, summary = micro
    report = (out / "report.md").read_text()
    compare = json.loads((out / "analysis" / "compare" / "compare.json").read_text())
    zipf = json.loads((out / "analysis" / "zipf.json").read_text())
    c = compare
    cell = f"{c['ratio_of_means']['nds']:.2f} ({c['median_ratios']['nds']:.2f}, {c['mean_ratios']['nds']:.2f})"
    assert (
        f"AdamW/Muon NDS at matched loss: ratio of means (median, mean of per-level ratios) | {cell} | 1.76 |" in report
    )
    assert f"{compare['mean_ratios']['update_norm']:.2f}" in report
    assert f"{zipf['gap'][0]:.2f} → {zipf['gap'][-1]:.2f}" in report
    assert f"{zipf['normalized']['adamw'][0]:.2f} → {zipf['normalized']['adamw'][-1]:.2f}" in report
    tuning = json.loads((out / "tuning.json").read_text())
    assert "| adamw | " in report and f"| {tuning['chosen']['adamw']:g} |" in report
    assert f"Finished in {summary['seconds']:.0f} s" in report
    for figure in summary["figures"].values():
        for p in figure:
            if p.endswith(".png"):
                assert f"({p})" in report


def test_rerun_continues_and_other_config_is_refused(micro, monkeypatch):
    out, _ = micro
    import curvlab.reproduce as reproduce

    results = []
    real_train = reproduce.train

    def recording_train(cfg, progress=True):
        results.append((cfg, real_train(cfg, progress=False)))
        return results[-1][1]

    monkeypatch.setattr(reproduce, "train", recording_train)
    Reproduction(PRESETS["micro"], out, progress=False).run()
    assert results  # the finished runs were visited...
    assert all(r.resumed_from == cfg.steps for cfg, r in results)  # ...and none trained a single step more
    with pytest.raises(ValueError, match="another configuration"):
        Reproduction(PRESETS["quick"], out, progress=False).run()


def test_paper_preset_without_data_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="--fineweb"):
        Reproduction(PRESETS["paper"], tmp_path / "paper", progress=False)
    with pytest.raises(ValueError, match="no such data directory"):
        Reproduction(PRESETS["paper"], tmp_path / "paper", fineweb=tmp_path / "nowhere", progress=False)


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
    import dataclasses

    import numpy as np

    from curvlab.data.shards import write_shard

    shards = tmp_path / "fineweb"
    rng = np.random.default_rng(0)
    write_shard(shards / "fineweb_train_000001.bin", rng.integers(0, 300, 40_000))
    write_shard(shards / "fineweb_val_000000.bin", rng.integers(0, 300, 5_000))
    preset = dataclasses.replace(
        PRESETS["micro"], fineweb=True, fineweb_model="tiny", fineweb_steps=12, fineweb_batch_size=8,
        fineweb_model_overrides={"n_layer": 1, "n_head": 2, "n_embd": 16, "block_size": 16, "vocab_size": 320},
        tolerance=0.2,
    )  # fmt: skip
    reproduction = Reproduction(preset, tmp_path / "out", fineweb=shards, progress=False)
    compare = reproduction.fineweb_comparison()  # the stage alone: the rest is the micro run above
    assert compare["optimizers"] == ["muon", "adamw"] and compare["pairs"]
    assert set(compare["ratio_of_means"]) == {"nds", "first_order", "curvature_penalty", "update_norm"}
    config = json.loads((tmp_path / "out" / "runs" / "fineweb" / "muon" / "config.json").read_text())
    assert config["optimizer_options"] == {"lr": 0.02} and config["data"] == str(shards)
    lines = "\n".join(_fineweb_lines({"fineweb": compare}))
    assert "## FineWeb" in lines and f"NDS {compare['ratio_of_means']['nds']:.2f}" in lines
