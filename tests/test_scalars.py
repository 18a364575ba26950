"""Typed records end to end: a real report's JSON round trip, the per-checkpoint scalars against the
report they come from, window means over typed members, levels.json, and the one metrics.jsonl reader."""

import json
import math

import numpy as np
import pytest

from curvlab.analysis.direction_report import DirectionReport
from curvlab.analysis.directions import PairedDirections
from curvlab.analysis.report import (
    DIGESTS,
    CurvatureReport,
    StaleReport,
    analyze_checkpoint,
    cached_report,
    load_report,
    report_cache_path,
)
from curvlab.analysis.targets import AnalysisSettings
from curvlab.curvature.scalars import SCALAR_KEYS, SCOPE_KEYS, CheckpointScalars
from curvlab.errors import CurvlabError
from curvlab.runs.metrics import read_metrics, row_line, truncate_metrics
from curvlab.studies.compare import Comparison, WindowSide
from curvlab.studies.records import LevelData, seed_band
from curvlab.util.digest import json_digest, path_digest
from tests.builders import small_run
from tests.synthetic import level_data, record, track


def _json(x) -> str:
    return json.dumps(x, sort_keys=True)  # (NaN != NaN: compare the JSON text)


@pytest.fixture(scope="module")
def report(pcfg_data, tmp_path_factory) -> CurvatureReport:
    """A real report of a tiny shadowed Muon run: both scopes, the layer blocks, a spectrum, paired directions."""
    out = tmp_path_factory.mktemp("scalars_run")
    small_run(pcfg_data, out, "muon", batch_size=4, steps=2, val_windows=8, shadow=True)
    return analyze_checkpoint(out / "ckpt_000002.pt", AnalysisSettings(dtype="float64", spectrum_top=2))


def test_a_real_report_round_trips_through_its_json(report, tmp_path):
    d = report.to_dict()
    assert d["hidden"] is not None and d["spectrum"] is not None and d["paired"] is not None
    back = CurvatureReport.from_dict(json.loads(json.dumps(d)))
    assert _json(back.to_dict()) == _json(d)
    report.save(tmp_path / "r.json")
    loaded = load_report(tmp_path / "r.json")
    assert _json(loaded.to_dict()) == _json(d)
    assert loaded.blocks.names == report.blocks.names and loaded.split.hidden_names == report.split.hidden_names
    np.testing.assert_array_equal(loaded.blocks.matrix, report.blocks.matrix)
    bad = {**d, "blocks": {"names": []}}
    (tmp_path / "bad.json").write_text(json.dumps({**bad, DIGESTS: {"report": json_digest(bad), "checkpoint": None}}))
    with pytest.raises(CurvlabError, match="malformed report"):
        load_report(tmp_path / "bad.json")
    (tmp_path / "old.json").write_text(json.dumps({**d, "schema_version": 2}))
    with pytest.raises(CurvlabError, match="report schema 2 is not 4"):
        load_report(tmp_path / "old.json")


def test_a_cached_report_of_another_schema_version_is_a_cache_miss(report, tmp_path):
    checkpoint, cache = tmp_path / "ckpt_000002.pt", tmp_path / "cache"
    checkpoint.write_bytes(b"")  # (the cache key reads the file's identity only)
    path = report_cache_path(cache, checkpoint, report.settings)
    calls = []

    def analyze_fn(ckpt, settings, data, device):
        calls.append(ckpt)
        return report

    cache.mkdir()
    report.save(path, path_digest(checkpoint))
    read = cached_report(cache, checkpoint, report.settings, analyze_fn=analyze_fn)
    assert calls == [] and _json(read.to_dict()) == _json(report.to_dict())  # this version's report: read back
    path.write_text(json.dumps({**json.loads(path.read_text()), "schema_version": 2}))
    with pytest.warns(StaleReport, match="another schema version"):
        assert cached_report(cache, checkpoint, report.settings, analyze_fn=analyze_fn) is report
    assert calls == [checkpoint.resolve()]  # another version's: recomputed, and replaced
    assert json.loads(path.read_text())["schema_version"] == 4
    path.write_text(json.dumps({**report.to_dict(), "blocks": {"names": []}}))
    with pytest.warns(StaleReport, match="records no digests"):  # a cache is derived: recomputed, never fatal
        assert cached_report(cache, checkpoint, report.settings, analyze_fn=analyze_fn) is report
    assert len(calls) == 2
    broken = {**json.loads(path.read_text()), "blocks": {"names": []}}  # this version's, malformed content
    del broken[DIGESTS]
    digests = {"report": json_digest(broken), "checkpoint": path_digest(checkpoint)}  # whose digests hold
    path.write_text(json.dumps({**broken, DIGESTS: digests}))
    with pytest.warns(StaleReport, match=r"is unreadable \(malformed report \(") as notes:
        assert cached_report(cache, checkpoint, report.settings, analyze_fn=analyze_fn) is report
    assert len(calls) == 3 and len(notes) == 1 and str(notes[0].message).startswith(f"{path}: the cached report")
    assert load_report(path).blocks.names == report.blocks.names  # replaced by the recomputed one


def test_paired_directions_and_direction_reports_of_another_schema_version_are_refused(report):
    paired = report.to_dict()["paired"]
    assert _json(PairedDirections.from_dict(paired).to_dict()) == _json(paired)
    with pytest.raises(CurvlabError, match="^paired-directions schema 2 is not 1$"):
        PairedDirections.from_dict({**paired, "schema_version": 2})
    r = report
    d = json.loads(
        json.dumps(DirectionReport(r.checkpoint, r.step, r.val_loss, r.optimizer, r.settings, r.paired, 1.0).to_dict())
    )
    assert _json(DirectionReport.from_dict(d).to_dict()) == _json(d)
    with pytest.raises(CurvlabError, match="^directions schema 3 is not 2$"):
        DirectionReport.from_dict({**d, "schema_version": 3})
    with pytest.raises(CurvlabError, match="^paired: paired-directions schema 0 is not 1$"):
        DirectionReport.from_dict({**d, "paired": {**paired, "schema_version": 0}})


def test_the_scalars_of_a_report_are_its_numbers(report):
    d = report.to_dict()  # the reference: the report's own JSON, read by hand
    s = report.scalars()
    assert s.step == d["step"] and s.val_loss == d["val_loss"]
    for k in SCOPE_KEYS:
        assert s.value(k) == d[k] and s.value(f"hidden_{k}") == d["hidden"][k]
    b = d["blocks"]
    assert (s.within, s.cross, s.rho_within) == (b["within"], b["cross"], b["rho_within"])
    idx = [i for i, n in enumerate(b["names"]) if n.startswith("layer")]
    M = np.array(b["matrix"])[np.ix_(idx, idx)]
    assert s.within_layers == pytest.approx(np.trace(M), rel=1e-12) and s.nds_layers == pytest.approx(
        M.sum(), rel=1e-12
    )
    norms = dict(zip(b["names"], b["norm"]))
    assert s.embed_head_share == pytest.approx((norms["embedding"] ** 2 + norms["head"] ** 2) / d["update_norm"] ** 2)
    err = abs(d["predicted"] - d["realized"]) / max(abs(d["realized"]), abs(d["first_order"]))
    assert s.taylor_error == pytest.approx(err, rel=1e-12) and s.taylor_ok == (err <= 0.5)
    real = next(x for x in d["paired"]["directions"] if x["name"] == d["paired"]["real"])
    assert s.value(f"paired_nds_{real['name']}_hidden") == real["hidden"]["nds"]
    # the flat JSON round-trips, and a file from before a scalar was recorded reads it as NaN
    assert _json(CheckpointScalars.from_dict(s.to_dict()).to_dict()) == _json(s.to_dict())
    older = {k: v for k, v in s.to_dict().items() if k != "hidden_cosine"}
    assert math.isnan(CheckpointScalars.from_dict(older).hidden.cosine)
    with pytest.raises(KeyError):
        s.value("no_such_scalar")


def _member(step, nds, paired=None, ok=True):
    return CheckpointScalars.from_dict(
        {"step": step, "nds": nds, "update_norm": 2.0 * nds, "taylor_ok": ok, **(paired or {})}
    )


def test_window_means_and_stderr_run_over_the_typed_members():
    members = [
        _member(1, 1.0, {"paired_nds_muon_all": 3.0}),
        _member(2, 2.0),
        _member(3, 6.0, {"paired_nds_muon_all": 1.0}, ok=False),
    ]
    side = WindowSide("muon", 2, 4.0, 1.0, 0.01, members, [])
    assert side.mean["nds"] == pytest.approx(3.0) and side.mean["update_norm"] == pytest.approx(6.0)
    assert side.stderr["nds"] == pytest.approx(np.std([1.0, 2.0, 6.0], ddof=1) / np.sqrt(3))
    assert "paired_nds_muon_all" not in side.mean  # not every member carries it
    assert set(SCALAR_KEYS) <= set(side.mean) and side.taylor_failures == 1
    back = WindowSide.from_dict(json.loads(json.dumps(side.to_dict())))
    assert _json(back.to_dict()) == _json(side.to_dict()) and back.members[0].paired == {"paired_nds_muon_all": 3.0}


def test_levels_json_and_the_comparison_round_trip_with_typed_rows():
    comparison = record("adamw/muon", 0, [{"nds": 2.0}, {"nds": 3.0}], [{"nds": 1.0}, {"nds": 1.5}])
    data = level_data([comparison], [track("muon", 0.0, 0, np.array([1.0, 2.0, 4.0]), np.array([0.5, 1.0, 1.0]))])
    d = json.loads(json.dumps(data.to_dict()))
    back = LevelData.from_dict(d)
    assert _json(back.to_dict()) == _json(d)
    assert [r.step for r in back.tracks[0].rows] == [10, 20, 30] and back.tracks[0].rows[1].within == 1.0
    assert back.tracks[0].rows[0].phase == "stable" and back.tracks[0].rows[0].on_plateau is False
    c = Comparison.from_dict(comparison.comparison.to_dict())
    assert c.ratio_of_means["nds"] == pytest.approx((2.0 + 3.0) / (1.0 + 1.5))


def test_seed_band_is_the_mean_and_range_over_seeds_at_common_steps():
    tracks = [
        track("muon", 0.0, k, np.array(v)) for k, v in enumerate([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0], [2.0, 0.0, 1.0]])
    ]
    tracks[2].rows.pop()  # the third seed stops at step 20
    band = seed_band(tracks, "nds")
    assert band.steps == [10, 20]
    np.testing.assert_allclose(band.mean, [2.0, 2.0])
    np.testing.assert_array_equal(band.low, [1.0, 0.0])
    np.testing.assert_array_equal(band.high, [3.0, 4.0])


def test_metrics_are_read_up_to_a_step_and_cut_at_a_broken_line(tmp_path):
    rows = [
        {"step": 1, "train_loss": 3.0},
        {"kind": "curvature", "step": 1, "nds": 0.1},  # measured at step 1, written once step 2 is done
        {"step": 2, "train_loss": 2.5, "val_loss": 2.6},
        {"kind": "curvature", "step": 2, "nds": 0.2},  # done at step 3
        {"step": 3, "train_loss": 2.0},
    ]
    lines = [row_line(r) for r in rows]  # (as a run writes them: with their digests)
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "train_lo')  # a crash mid-line
    assert read_metrics(tmp_path) == rows
    assert read_metrics(tmp_path, upto=2) == rows[:3]
    assert read_metrics(tmp_path, upto=1) == rows[:1]
    assert read_metrics(tmp_path / "nowhere") == []
    truncate_metrics(tmp_path, 2)
    assert (tmp_path / "metrics.jsonl").read_text() == "".join(line + "\n" for line in lines[:3])
