"""One writer and one reader for versioned records (curvlab.util.schema)."""

import hashlib
import json
import math
from types import MappingProxyType

import pytest

from curvlab.errors import CurvlabError
from curvlab.runs.monitor import MonitorRow
from curvlab.studies.records import LevelData
from curvlab.studies.tuning import LrSearch, TuningRecord
from curvlab.util import schema


def _record():
    search = LrSearch(
        "adamw.lr", {0.004: [3.1, 3.3], 0.008: [math.inf, 3.0]}, 0.004, [0.004, 0.008], seeds=[1000, 1001]
    )
    return TuningRecord("search", 0.0, 20, [1000, 1001], {"adamw.lr": search}, {"adamw": {"lr": 0.004}}, "tied")


def test_a_record_round_trips_through_strict_json(tmp_path):
    path = tmp_path / "sub" / "tuning.json"
    schema.save(path, _record())
    text = path.read_text()
    assert "Infinity" not in text and "NaN" not in text  # parsers other than Python's read it
    d = json.loads(text)
    assert d["schema_version"] == TuningRecord.SCHEMA_VERSION and d["searches"]["adamw.lr"]["grid"]["0.008"][0] is None
    back = schema.load(path, TuningRecord)
    assert back == _record() and back.searches["adamw.lr"].grid[0.008][0] == math.inf
    assert back.searches["adamw.lr"].ties == []  # 0.008's mean is +inf: no tie
    assert [p.name for p in path.parent.iterdir()] == ["tuning.json"]  # no temporary left behind


@pytest.mark.parametrize(
    "text, match",
    [
        (None, "no such file"),
        ("{not json", "corrupt JSON"),
        ('{"schema_version": 99, "mode": "search"}', "tuning schema 99 is not 1"),
        ("[1, 2]", "tuning schema None is not 1"),
        ('{"schema_version": 1, "mode": "search"}', "unsealed tuning record"),
        (json.dumps(schema.sealed({"schema_version": 1, "mode": "search"})), "not a tuning record .KeyError"),
    ],
)
def test_bad_files_are_one_line_errors_naming_the_file(tmp_path, text, match):
    path = tmp_path / "tuning.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(CurvlabError, match=match) as e:
        schema.load(path, TuningRecord)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


def test_check_refuses_another_version_without_a_file():
    d = _record().to_dict()
    assert schema.check(d, TuningRecord) is d
    with pytest.raises(CurvlabError, match="tuning schema 0 is not 1"):
        TuningRecord.from_dict({**d, "schema_version": 0})


def test_matches_is_what_check_accepts_and_fixed_keys_come_before_the_version():
    d = _record().to_dict()
    assert schema.matches(d, TuningRecord) and schema.matches(MappingProxyType(d), TuningRecord)
    no_version = {k: v for k, v in d.items() if k != "schema_version"}
    for bad in ({**d, "schema_version": 0}, no_version, [d], None):
        assert not schema.matches(bad, TuningRecord)
        with pytest.raises(CurvlabError, match="tuning schema (0|None) is not 1"):
            schema.check(bad, TuningRecord)
    # a record with FIXED_KEYS: a curvature row among the training rows of metrics.jsonl
    assert schema.matches({"kind": "curvature", "schema_version": 1}, MonitorRow)
    for training_row in ({"step": 1, "train_loss": 2.0}, {"kind": "train", "schema_version": 9}):
        assert not schema.matches(training_row, MonitorRow)
        with pytest.raises(CurvlabError, match=r"^m.jsonl: not a curvature row \(kind .* is not 'curvature'\)$"):
            schema.check(training_row, MonitorRow, "m.jsonl")
    assert not schema.matches({"kind": "curvature", "schema_version": 2}, MonitorRow)


def test_a_sealed_record_refuses_an_edit_and_one_without_its_seal(tmp_path):
    """Every saved record carries the SHA-256 of its content (recomputed here with hashlib, not curvlab's
    digest): an edit into other valid JSON is refused in one line, and so is the edit with its seal
    deleted (nothing unsealed is trusted)."""
    path = tmp_path / "tuning.json"
    schema.save(path, _record())
    d = json.loads(path.read_text())
    rest = {k: v for k, v in d.items() if k != schema.SEAL}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":"))
    assert d[schema.SEAL] == hashlib.sha256(canonical.encode()).hexdigest()
    d["chosen"]["adamw"]["lr"] = 0.008  # a plausible value, valid JSON: only the seal can tell
    path.write_text(json.dumps(d, indent=1))
    with pytest.raises(CurvlabError, match="edited or corrupt tuning record") as e:
        schema.load(path, TuningRecord)
    assert "\n" not in str(e.value) and str(path) in str(e.value)
    del d[schema.SEAL]
    path.write_text(json.dumps(d))
    with pytest.raises(CurvlabError, match="unsealed tuning record"):
        schema.load(path, TuningRecord)


def test_levels_keep_their_nan_and_refuse_an_edit(tmp_path):
    """``levels.json`` and each ``seed<k>.json`` are sealed too (with NaN kept, as the per-level values
    need): an edited one is refused, never read into a summary."""
    levels = LevelData([], [], float("nan"), [0.0, 1.0])
    path = tmp_path / "seed0.json"
    levels.save(path)
    back = LevelData.load(path)
    assert math.isnan(back.plateau_ceiling) and back.s_values == [0.0, 1.0]
    d = json.loads(path.read_text())
    d["s_values"] = [0.0, 0.5]
    path.write_text(json.dumps(d))
    with pytest.raises(CurvlabError, match="edited or corrupt levels.json record"):
        LevelData.load(path)
