"""The one record codec (curvlab.util.codec): records to JSON and back, by their fields and type hints, and
every committed result file written again byte for byte from the record it reads as."""

import enum
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch

from curvlab.errors import CurvlabError
from curvlab.runs.config import TrainConfig
from curvlab.studies.compare import Comparison
from curvlab.studies.records import LevelData
from curvlab.studies.robustness import RobustnessLevels, RobustnessSummary
from curvlab.studies.summary import Summary
from curvlab.theory.quadratic import PhaseSweep
from curvlab.theory.quadratic_model import Trajectory
from curvlab.util import schema
from curvlab.util.atomic import strict_json
from curvlab.util.codec import Record, decode, encode, meta

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Point(Record):
    x: float
    y: float | None = None


@dataclass(frozen=True)
class Shape(Record):
    name: str
    corners: tuple[Point, ...]
    colour: Colour
    by_name: dict[str, Point]
    sides: list[int]
    pair: tuple[int, str]
    weights: np.ndarray = field(metadata=meta(dtype=float))
    note: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _shape() -> Shape:
    return Shape(
        "kite",
        (Point(0.0, 1.5), Point(math.nan), Point(math.inf, -math.inf)),
        Colour.BLUE,
        {"apex": Point(2.0, 3.0)},
        [1, 2],
        (7, "seven"),
        np.array([[1.0, math.nan], [0.5, 2.0]]),
        extra={"tuple": (1, 2), "none": None},
    )


def test_a_nested_record_encodes_to_plain_json_in_field_order():
    # the JSON written by hand: what the codec's rules say this record is
    expected = {
        "name": "kite",
        "corners": [{"x": 0.0, "y": 1.5}, {"x": math.nan, "y": None}, {"x": math.inf, "y": -math.inf}],
        "colour": "blue",
        "by_name": {"apex": {"x": 2.0, "y": 3.0}},
        "sides": [1, 2],
        "pair": [7, "seven"],
        "weights": [[1.0, math.nan], [0.5, 2.0]],
        "note": None,
        "extra": {"tuple": [1, 2], "none": None},
    }
    assert json.dumps(encode(_shape())) == json.dumps(expected)  # (NaN-aware, and in this key order)
    assert _shape().to_dict().keys() == expected.keys()


def test_a_record_round_trips_through_strict_json_with_non_finite_floats_as_null():
    text = json.dumps(schema.sealed(_shape().to_dict()))
    assert "NaN" not in text and "Infinity" not in text
    d = json.loads(text)
    assert d["corners"][1] == {"x": None, "y": None} and d["corners"][2] == {"x": None, "y": None}
    back = Shape.from_dict(schema.unsealed(d, "f", "shape"))
    # null reads as NaN in a float slot (the NaN written), as None in an optional one (the None written)
    assert math.isnan(back.corners[1].x) and back.corners[1].y is None
    assert math.isnan(back.corners[2].x) and back.corners[2].y is None  # strict JSON keeps no sign of an inf
    assert back.corners[0] == Point(0.0, 1.5) and isinstance(back.corners, tuple)
    assert back.colour is Colour.BLUE and back.by_name == {"apex": Point(2.0, 3.0)}
    assert back.pair == (7, "seven") and back.sides == [1, 2] and back.note is None
    assert back.weights.dtype == np.float64 and np.array_equal(back.weights, _shape().weights, equal_nan=True)
    assert back.extra == {"tuple": [1, 2], "none": None}  # Any: the JSON value as it is


def test_json_that_keeps_nan_reads_back_the_same_floats():
    back = decode(Shape, json.loads(json.dumps(_shape().to_dict())))  # Python's JSON: NaN, Infinity
    assert back.corners[2] == Point(math.inf, -math.inf) and math.isnan(back.corners[1].x)
    assert back.corners[1].y is None


@dataclass(frozen=True)
class Spectrum(Record):
    values: torch.Tensor
    vectors: torch.Tensor = field(default=None, metadata=meta(skip=True))


def test_a_tensor_writes_as_its_list_and_reads_back_as_a_float64_host_tensor():
    record = Spectrum(torch.tensor([2.5, math.nan], dtype=torch.float32), torch.ones(3, 2))
    text = json.dumps(schema.sealed(record.to_dict()))
    assert json.loads(text)["values"] == [2.5, None]
    back = Spectrum.from_dict(schema.unsealed(json.loads(text), "f", "spectrum"))
    assert back.values.dtype == torch.float64 and back.values.device == torch.device("cpu")
    assert back.values[0] == 2.5 and math.isnan(back.values[1]) and back.vectors is None
    with pytest.raises(TypeError, match="values: expected an array, got a number"):
        Spectrum.from_dict({"values": 1.0})


def test_a_missing_key_takes_the_default_or_is_a_key_error():
    assert Point.from_dict({"x": 1}) == Point(1, None)  # an int stays the int it was written as
    with pytest.raises(KeyError, match="x"):
        Point.from_dict({"y": 1.0})


@pytest.mark.parametrize(
    ("d", "error", "match"),
    [
        ({"x": "1"}, TypeError, "^x: expected a number, got a string$"),
        ({"x": True}, TypeError, "^x: expected a number, got a boolean$"),
        ({"x": 1.0, "z": 2, "w": 3}, CurvlabError, r"^unknown Point field\(s\): w, z$"),
        ([1.0], TypeError, "^Point: expected an object, got an array$"),
    ],
)
def test_a_malformed_record_is_refused(d, error, match):
    with pytest.raises(error, match=match):
        Point.from_dict(d)


def test_a_malformed_value_deep_inside_is_named_by_its_place():
    d = _shape().to_dict()
    d["corners"][1]["y"] = "high"
    with pytest.raises(TypeError, match=r"^corners\[1\]\.y: expected a number, got a string$"):
        Shape.from_dict(d)
    d = _shape().to_dict()
    d["pair"] = [7]
    with pytest.raises(TypeError, match=r"^pair: expected 2 items, got 1$"):
        Shape.from_dict(d)
    d["pair"], d["colour"] = [7, "seven"], "green"
    with pytest.raises(ValueError, match="'green' is not a valid Colour"):
        Shape.from_dict(d)


@dataclass(frozen=True)
class Versioned(Record):
    SCHEMA_VERSION: ClassVar[int] = 2
    FIXED_KEYS: ClassVar[dict[str, Any]] = {"kind": "test"}
    WHAT: ClassVar[str] = "probe"

    value: float


def test_a_versioned_record_writes_its_fixed_keys_and_version_first_and_refuses_another(tmp_path):
    assert list(Versioned(1.0).to_dict().items()) == [("kind", "test"), ("schema_version", 2), ("value", 1.0)]
    assert Versioned.from_dict({"kind": "test", "schema_version": 2, "value": 1.0}) == Versioned(1.0)
    sealed = schema.sealed(Versioned(1.0).to_dict())
    assert Versioned.from_dict(sealed) == Versioned(1.0)  # the seal is read past (schema.load checks it)
    with pytest.raises(CurvlabError, match=r"unknown Point field\(s\): content_digest"):
        Point.from_dict({"x": 1.0, schema.SEAL: "0"})  # (an unversioned record has no seal)
    with pytest.raises(schema.OtherVersion, match=r"^probe schema 1 is not 2$"):
        Versioned.from_dict({"kind": "test", "schema_version": 1, "value": 1.0})
    with pytest.raises(schema.OtherVersion, match=r"^not a probe \(kind 'train' is not 'test'\)$"):
        Versioned.from_dict({"kind": "train", "schema_version": 2, "value": 1.0})
    path = tmp_path / "r.json"
    schema.save(path, Versioned(math.nan))
    assert json.loads(path.read_text())["value"] is None
    assert math.isnan(schema.load(path, Versioned).value)
    path.write_text(json.dumps({"kind": "test", "schema_version": 3, "value": 1.0}))
    with pytest.raises(CurvlabError, match=r"r.json: probe schema 3 is not 2$"):
        schema.load(path, Versioned)
    path.write_text(json.dumps(schema.sealed({"kind": "test", "schema_version": 2, "value": "x"})))
    with pytest.raises(
        CurvlabError, match=r"r.json: not a probe record \(TypeError: value: expected a number, got a string\)$"
    ):
        schema.load(path, Versioned)


@dataclass(frozen=True)
class Window(Record):
    """A record with every escape hatch: a renamed key, a skipped field, a null that reads as +inf, a strict
    field, a key order of its own with a derived key."""

    members: list[float] = field(metadata=meta(key="values", null=math.inf))
    label: str
    handle: object = field(default=None, metadata=meta(skip=True))
    loss: float = field(default=math.nan, metadata=meta(strict=True))
    JSON_KEYS: ClassVar[tuple] = ("label", ("total", "sum"), ...)

    @property
    def sum(self) -> float:
        return sum(self.members)


def test_the_escape_hatches_rename_skip_derive_and_order_keys():
    w = Window([1.0, 2.0], "w", handle=object())
    assert json.dumps(w.to_dict()) == json.dumps({"label": "w", "total": 3.0, "values": [1.0, 2.0], "loss": None})
    back = Window.from_dict({"label": "w", "total": 99.0, "values": [1.0, None], "loss": None})
    assert back.members == [1.0, math.inf] and back.handle is None and math.isnan(back.loss)  # total: not read


def test_a_class_whose_keys_leave_a_field_out_is_refused():
    @dataclass
    class Bad(Record):
        a: int
        b: int
        JSON_KEYS: ClassVar[tuple] = ("a",)

    with pytest.raises(TypeError, match="JSON_KEYS must name each key once and every field"):
        Bad(1, 2).to_dict()


def test_a_diverged_quadratic_loss_reads_back_as_inf_and_other_nulls_as_nan():
    t = Trajectory("gd", [1.0, math.inf], [math.nan, 0.5], [1.0, 2.0], [0.1, 0.2], None)
    d = json.loads(json.dumps(schema.sealed(t.to_dict())))
    assert d["loss"] == [1.0, None] and d["nds"] == [None, 0.5]
    back = Trajectory.from_dict(schema.unsealed(d, "t", "trajectory"))
    assert back.loss == [1.0, math.inf] and math.isnan(back.nds[0]) and back.lr is None


def test_a_phase_sweep_reads_its_arrays_with_their_dtypes_and_refuses_a_wrong_shape():
    wins = np.array([[[True, False]]])
    sweep = PhaseSweep((1.0, 2.0), (0.1,), (1.0,), 5, 10, wins, wins, ~wins, np.array([[[-1.0, math.nan]]]))
    back = PhaseSweep.from_dict(json.loads(json.dumps(strict_json(sweep.to_dict()), allow_nan=False)))
    assert back == sweep and back.muon_wins.dtype == bool and back.log10_suboptimality_ratio.dtype == np.float64
    with pytest.raises(CurvlabError, match=r"phase sweep muon_wins has shape \(1, 1, 1\), its axes \(1, 1, 2\)"):
        PhaseSweep.from_dict({**sweep.to_dict(), "muon_wins": [[[True]]]})


def test_a_training_config_refuses_an_unknown_field_by_name():
    cfg = TrainConfig("d", "o", optimizer_options={"betas": (0.9, 0.95)})
    assert cfg.to_dict()["optimizer_options"] == {"betas": [0.9, 0.95]}  # plain JSON types
    assert TrainConfig.from_dict(cfg.to_dict()) == TrainConfig("d", "o", optimizer_options={"betas": [0.9, 0.95]})
    with pytest.raises(CurvlabError, match=r"^unknown training config field\(s\): lr, stepz$"):
        TrainConfig.from_dict({**cfg.to_dict(), "stepz": 1, "lr": 0.1})


# -- every committed result, written again ------------------------------------------------------------

# each committed file, the class that reads it, and how its job writes it (schema.save: strict JSON, indented;
# the levels keep NaN, the robustness design's unindented)
COMMITTED = [
    *((f"{p}/summary.json", Summary) for p in ("quick", "quick-1thread", "standard", "mechanism", "text")),
    *((f"{p}/levels.json", LevelData) for p in ("quick", "quick-1thread", "standard", "mechanism", "text")),
    ("robustness/summary.json", RobustnessSummary),
    ("robustness/levels.json", RobustnessLevels),
]


def test_every_committed_result_file_is_listed():
    committed = sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.glob("*/*.json"))
    assert committed == sorted(name for name, _ in COMMITTED)


def _migrated(value: Any) -> Any:
    """A committed result's JSON as this curvlab reads it: each comparison in it (an object with ``pairs``)
    brought up to its class's version by its ``MIGRATIONS`` (schema.upgrade; 2: its settings named the HVP
    method ``hvp_method``), as the codec does."""
    if isinstance(value, list):
        return [_migrated(v) for v in value]
    if not isinstance(value, dict):
        return value
    value = {k: _migrated(v) for k, v in value.items()}
    return schema.upgrade(value, Comparison) if "pairs" in value and "ratio" in value else value


@pytest.mark.parametrize(("name", "cls"), COMMITTED, ids=[name for name, _ in COMMITTED])
def test_a_committed_result_round_trips_through_the_codec_byte_for_byte(name, cls, tmp_path):
    """Read with its record class (through schema.load: its seal and version checked) and written again by
    its job's writer: the same bytes, so the same content in the same key order, and the same seal. A file
    written before a migration (the committed levels keep their comparisons of schema 2) is written again
    as the migration makes it, in the same key order, and from then on round-trips byte for byte."""
    path = RESULTS / name

    def write(record, out: Path) -> None:
        if cls in (Summary, RobustnessSummary):
            schema.save(out, record)
        else:
            record.save(out)

    again, twice = tmp_path / "again.json", tmp_path / "twice.json"
    write(cls.load(path), again)
    committed = schema.unsealed(json.loads(path.read_text()), path, name)
    if json.dumps(_migrated(committed)) == json.dumps(committed):  # nothing to migrate
        assert again.read_bytes() == path.read_bytes()
    written = schema.unsealed(json.loads(again.read_text()), again, name)
    assert json.dumps(written) == json.dumps(_migrated(committed))  # (json.dumps: the key order too; NaN as NaN)
    write(cls.load(again), twice)
    assert twice.read_bytes() == again.read_bytes()
