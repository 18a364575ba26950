"""Issue 49: ``AnalysisSettings.hvp_method`` is ``AnalysisSettings.method``, on disk too. A record written
before (a report of schema 3, a comparison of schema 2 inside a ``levels.json``, a directions report of
schema 1) is read through its class's ``MIGRATIONS`` (:func:`curvlab.util.schema.upgrade`), after its seal
is checked, with ``method``; what is written now says ``method``; a version newer than this curvlab's, or
one it has no migration from, is still refused. A cached report of the old version is recomputed, as a
cache treats any other version."""

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from curvlab.analysis.direction_report import DIRECTIONS_SCHEMA_VERSION, DirectionReport
from curvlab.analysis.report import (
    DIGESTS,
    CurvatureReport,
    StaleReport,
    analyze_checkpoint,
    cached_report,
    load_report,
    report_cache_path,
)
from curvlab.analysis.targets import REPORT_SCHEMA_VERSION, AnalysisSettings
from curvlab.errors import CurvlabError
from curvlab.studies.compare import COMPARE_SCHEMA_VERSION
from curvlab.studies.records import LevelData
from curvlab.util import schema
from curvlab.util.codec import Record
from curvlab.util.digest import json_digest, path_digest
from tests.builders import small_run

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
SETTINGS_KEYS = list(asdict(AnalysisSettings()))  # the settings' keys as written now, in order
# as the committed runs wrote them (before issue 50), as a run since issue 50 writes them, and since issue 52
COMMITTED_KEYS = [k for k in SETTINGS_KEYS if k not in ("factorial", "gauss_newton")]
WRITTEN_KEYS = (COMMITTED_KEYS, [k for k in SETTINGS_KEYS if k != "gauss_newton"], list(SETTINGS_KEYS))


def _old_settings(d: dict) -> dict:
    """``d`` (a record's JSON with ``settings``) as written before the rename: ``hvp_method`` in ``method``'s
    place."""
    return {**d, "settings": {("hvp_method" if k == "method" else k): v for k, v in d["settings"].items()}}


def _save_report_json(path: Path, d: dict) -> None:
    """``d`` written as :meth:`CurvatureReport.save` writes a report: with the digest of its content."""
    d = json.loads(json.dumps(d, allow_nan=True))
    path.write_text(json.dumps({**d, DIGESTS: {"report": json_digest(d), "checkpoint": None}}, allow_nan=True))


def _save_levels_json(path: Path, d: dict) -> None:
    """``d`` written as :meth:`LevelData.save` writes it: sealed, ``NaN`` kept."""
    path.write_text(json.dumps(schema.sealed(d, strict=False), indent=1))


def _old_levels(d: dict, version: int = COMPARE_SCHEMA_VERSION - 1) -> dict:
    """A ``levels.json``'s content with every comparison as written at ``version`` (default: before the
    rename, whose settings say ``hvp_method``)."""

    def old(record: dict) -> dict:
        comparison = record["comparison"]
        if comparison is not None:
            comparison = {**_old_settings(comparison), "schema_version": version}
        return {**record, "comparison": comparison}

    return {**d, "comparisons": [old(r) for r in d["comparisons"]]}


@pytest.fixture(scope="module")
def report(pcfg_data, tmp_path_factory):
    """The report of a real checkpoint of a 2-step Muon run with a shadow state (so its paired directions)."""
    out = tmp_path_factory.mktemp("migration") / "run"
    small_run(pcfg_data, out, "muon", batch_size=4, steps=2, val_windows=8, shadow=True)
    return analyze_checkpoint(out / "ckpt_000002.pt", AnalysisSettings(dtype="float64", method="fwd_rev"))


# -- the general hook ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Probe(Record):
    """A record at version 3 that reads versions 1 (``old``, later ``older``) and 2 (``older``)."""

    new: int
    SCHEMA_VERSION: ClassVar[int] = 3
    MIGRATIONS: ClassVar[dict] = {
        1: lambda d: {("older" if k == "old" else k): v for k, v in d.items()},
        2: lambda d: {("new" if k == "older" else k): v for k, v in d.items()},
    }
    WHAT: ClassVar[str] = "probe"


def test_upgrade_runs_the_migrations_one_version_at_a_time_and_leaves_other_versions(tmp_path):
    assert schema.upgrade({"schema_version": 1, "old": 5}, _Probe) == {"schema_version": 3, "new": 5}
    assert schema.upgrade({"schema_version": 2, "older": 5}, _Probe) == {"schema_version": 3, "new": 5}
    mine, newer, unhashable = {"schema_version": 3, "new": 5}, {"schema_version": 4}, {"schema_version": [1]}
    for other in (mine, newer, {"schema_version": 0}, [1], unhashable, {"schema_version": True, "old": 5}):
        assert schema.upgrade(other, _Probe) is other  # its own version, or none it can read: as it is
    assert _Probe.from_dict({"schema_version": 1, "old": 5}) == _Probe(5)  # (the codec upgrades)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(schema.sealed({"schema_version": 1, "old": 5})))
    assert schema.load(path, _Probe) == _Probe(5)
    schema.save(path, _Probe(5))
    assert json.loads(path.read_text())["schema_version"] == 3  # written at its own version
    path.write_text(json.dumps(schema.sealed({"schema_version": 4, "new": 5})))
    with pytest.raises(schema.OtherVersion, match=r"p.json: probe schema 4 is not 3$"):
        schema.load(path, _Probe)
    path.write_text(json.dumps({"schema_version": 1, "old": 5}))  # an old version, unsealed: the seal is missed
    with pytest.raises(CurvlabError, match="unsealed probe record"):
        schema.load(path, _Probe)


# -- the records that keep AnalysisSettings ---------------------------------------------------------------


def test_a_report_written_before_loads_with_method(report, tmp_path):
    d = report.to_dict()
    assert list(d["settings"]) == SETTINGS_KEYS and d["settings"]["method"] == "fwd_rev"
    old = {**_old_settings(d), "schema_version": REPORT_SCHEMA_VERSION - 1}
    _save_report_json(tmp_path / "old.json", old)
    loaded = load_report(tmp_path / "old.json")
    assert loaded.settings == report.settings and loaded.settings.method == "fwd_rev"
    again = loaded.to_dict()
    assert again["schema_version"] == REPORT_SCHEMA_VERSION and list(again["settings"]) == SETTINGS_KEYS
    assert json.dumps(again, allow_nan=True) == json.dumps(d, allow_nan=True)  # the same report, keys in order
    assert CurvatureReport.from_dict(json.loads(json.dumps(old))).settings == report.settings
    _save_report_json(tmp_path / "newer.json", {**d, "schema_version": REPORT_SCHEMA_VERSION + 1})
    with pytest.raises(CurvlabError, match=f"report schema {REPORT_SCHEMA_VERSION + 1} is not {REPORT_SCHEMA_VERSION}"):
        load_report(tmp_path / "newer.json")


def test_a_cached_report_written_before_is_recomputed(report, tmp_path):
    """A cache entry of the old version is another version, as any: recomputed and replaced (its key,
    which hashes the settings and the version, differs too, so an old entry is not even looked up)."""
    checkpoint, cache = tmp_path / "ckpt_000002.pt", tmp_path / "cache"
    checkpoint.write_bytes(b"")  # (the cache key reads the file's identity only)
    path = report_cache_path(cache, checkpoint, report.settings)
    cache.mkdir()
    old = {**_old_settings(report.to_dict()), "schema_version": REPORT_SCHEMA_VERSION - 1}
    path.write_text(json.dumps({**old, DIGESTS: {"report": json_digest(old), "checkpoint": path_digest(checkpoint)}}))
    calls = []

    def analyze_fn(ckpt, settings, data, device):
        calls.append(ckpt)
        return report

    with pytest.warns(StaleReport, match="another schema version"):
        assert cached_report(cache, checkpoint, report.settings, analyze_fn=analyze_fn) is report
    assert len(calls) == 1
    written = json.loads(path.read_text())
    assert written["schema_version"] == REPORT_SCHEMA_VERSION and written["settings"]["method"] == "fwd_rev"


def test_a_directions_report_written_before_reads_with_method(report):
    r = report
    record = DirectionReport(r.checkpoint, r.step, r.val_loss, r.optimizer, r.settings, r.paired, 1.0)
    d = json.loads(json.dumps(record.to_dict()))
    old = {**_old_settings(d), "schema_version": DIRECTIONS_SCHEMA_VERSION - 1}
    assert DirectionReport.from_dict(old).settings.method == "fwd_rev"
    with pytest.raises(CurvlabError, match=f"directions schema {DIRECTIONS_SCHEMA_VERSION + 1} is not"):
        DirectionReport.from_dict({**d, "schema_version": DIRECTIONS_SCHEMA_VERSION + 1})


def test_a_levels_json_written_before_loads_with_method(tmp_path):
    """Its comparisons (each of its own version, nested) are migrated by the codec as it reads them."""
    d = LevelData.load(RESULTS / "quick" / "levels.json").to_dict()
    comparisons = [r["comparison"] for r in d["comparisons"] if r["comparison"] is not None]
    assert comparisons and all(list(c["settings"]) in WRITTEN_KEYS for c in comparisons)
    path = tmp_path / "levels.json"
    _save_levels_json(path, _old_levels(d))
    assert '"hvp_method"' in path.read_text() and '"method"' not in path.read_text()
    loaded = LevelData.load(path)
    assert all(r.comparison.settings["method"] == "rev_rev" for r in loaded.comparisons if r.comparison)
    LevelData.save(loaded, tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == json.dumps(schema.sealed(d, strict=False), indent=1)
    path.write_text(json.dumps(_old_levels(d), indent=1))  # an old one, unsealed: the seal is missed
    with pytest.raises(CurvlabError, match="unsealed levels.json record"):
        LevelData.load(path)


@pytest.mark.parametrize("name", ["quick", "quick-1thread", "standard", "mechanism"])
def test_the_committed_levels_load_with_method(name):
    """The committed results are not rewritten: they load through the migration."""
    levels = LevelData.load(RESULTS / name / "levels.json")
    settings = [r.comparison.settings for r in levels.comparisons if r.comparison is not None]
    assert settings and all(list(s) in WRITTEN_KEYS and s["method"] == "rev_rev" for s in settings)


def test_a_comparison_newer_than_known_is_refused(tmp_path):
    d = LevelData.load(RESULTS / "quick" / "levels.json").to_dict()
    path = tmp_path / "levels.json"
    _save_levels_json(path, _old_levels(d, COMPARE_SCHEMA_VERSION + 1))
    newer, known = COMPARE_SCHEMA_VERSION + 1, COMPARE_SCHEMA_VERSION
    with pytest.raises(CurvlabError, match=f"comparison schema {newer} is not {known}"):
        LevelData.load(path)
    _save_levels_json(path, {**d, "schema_version": LevelData.SCHEMA_VERSION + 1})
    with pytest.raises(schema.OtherVersion, match=f"levels.json schema {LevelData.SCHEMA_VERSION + 1} is not"):
        LevelData.load(path)
