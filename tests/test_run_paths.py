"""Paths stay inside their run: what a run directory's files name (index entries, recorded report
files) is refused, by name, when it leads outside that directory, and no file outside is touched."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from curvlab.cli import app
from curvlab.errors import CurvlabError
from curvlab.jobs import pruning
from curvlab.jobs.pruning import prune_run, window_checkpoints
from curvlab.runs.checkpoint import add_to_index, read_index
from curvlab.studies.compare import Comparison, Level, WindowSide
from curvlab.studies.records import ComparisonRecord
from curvlab.util.paths import inside

runner = CliRunner()


@pytest.fixture
def victim(tmp_path):
    """A file beside the runs, which nothing a run names may reach."""
    path = tmp_path / "victim.txt"
    path.write_text("keep me")
    return path


TWO_UP = "../" * 2  # (spelt so: the docs test flags a literal two-levels-up path in code)


def plant(run: Path, *paths: str) -> Path:
    """A run directory whose index lists ``paths`` (steps 0, 1, ...) and a real last checkpoint file."""
    run.mkdir(parents=True)
    entries = [{"step": k, "val_loss": 1.0, "path": p} for k, p in enumerate(paths)]
    entries.append({"step": len(paths), "val_loss": 1.0, "path": f"ckpt_{len(paths):06d}.pt"})
    (run / f"ckpt_{len(paths):06d}.pt").write_bytes(b"last")
    (run / "index.json").write_text(json.dumps(entries))
    return run


def hostile_names(victim: Path) -> dict[str, str]:
    return {
        "dotdot": TWO_UP + "victim.txt",
        "deep": "../" * 20 + str(victim).lstrip("/"),  # past the root, and down to the victim
        "absolute": str(victim),
        "link": "link.pt",  # a name inside the run that is a symbolic link out of it
        "itself": ".",
    }


@pytest.mark.parametrize("kind", ["dotdot", "deep", "absolute", "link", "itself"])
def test_an_index_entry_outside_its_run_is_refused_by_name_and_nothing_is_deleted(tmp_path, victim, kind):
    run = tmp_path / "runs" / "r"
    names = hostile_names(victim)
    plant(run, names[kind])
    if kind == "link":
        os.symlink(victim, run / "link.pt")
    with pytest.raises(CurvlabError) as e:
        read_index(run)
    message = str(e.value)
    assert "\n" not in message and str(run / "index.json") in message and repr(names[kind]) in message
    with pytest.raises(CurvlabError, match="outside"):
        prune_run(run, keep=set())
    assert victim.read_text() == "keep me"


def test_pruning_a_sound_run_still_deletes_inside_it(tmp_path, victim):
    run = plant(tmp_path / "r", "ckpt_000000.pt", "sub/ckpt_000001.pt")
    (run / "ckpt_000000.pt").write_bytes(b"zero")
    (run / "sub").mkdir()
    (run / "sub" / "ckpt_000001.pt").write_bytes(b"one")
    assert prune_run(run, keep=set()) == len(b"zero") + len(b"one")
    assert sorted(p.name for p in run.rglob("ckpt_*.pt")) == ["ckpt_000002.pt"]  # the last stays
    assert [e["step"] for e in read_index(run)] == [0, 1, 2]  # the index keeps every entry


def test_pruning_deletes_checkpoints_only_never_the_runs_other_files(tmp_path):
    run = plant(tmp_path / "r", "config.json", "metrics.jsonl")
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    assert prune_run(run, keep=set()) == 0
    assert (run / "config.json").read_text() == "{}" and (run / "metrics.jsonl").exists()


def test_a_malformed_index_is_one_line(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    bad_loss = '[{"step": 0, "path": "a", "val_loss": "x"}]'
    for content in ('{"step": 0}', '[{"step": "0", "path": "a"}]', '[{"step": 0}]', "[3]", "\xff", bad_loss):
        (run / "index.json").write_text(content, errors="surrogateescape")
        with pytest.raises(CurvlabError, match="corrupt (JSON in a checkpoint )?index") as e:
            read_index(run)
        assert "\n" not in str(e.value)


def test_add_to_index_refuses_a_name_outside_the_run(tmp_path, victim):
    run = tmp_path / "r"
    run.mkdir()
    for name in ("../victim.txt", str(victim)):
        with pytest.raises(CurvlabError, match="outside"):
            add_to_index(run, 0, 1.0, name)
    assert not (run / "index.json").exists()
    add_to_index(run, 0, 1.0, "ckpt_000000.pt")
    assert read_index(run) == [{"step": 0, "val_loss": 1.0, "path": "ckpt_000000.pt"}]


def test_inside_names_the_file_that_named_the_path(tmp_path):
    assert inside(tmp_path, "a/b.pt", "x.json") == tmp_path / "a" / "b.pt"
    for bad in ("../a", "/etc/passwd", "", None, 3):
        with pytest.raises(CurvlabError) as e:
            inside(tmp_path, bad, "x.json")
        assert str(e.value).startswith("x.json: names ")


def test_inside_holds_when_a_path_method_is_replaced(tmp_path, monkeypatch):
    """Containment is decided on strings (os.path), not by methods of pathlib's classes, which code in the
    same process (a crafted pickle, say) could replace."""
    for name in ("is_relative_to", "resolve", "__eq__"):
        monkeypatch.setattr(type(tmp_path), name, lambda *a, **k: True)
    for bad in ("../a", "/etc/passwd", "."):
        with pytest.raises(CurvlabError, match="outside"):
            inside(tmp_path, bad, "x.json")
    monkeypatch.undo()
    assert inside(tmp_path, "a/b.pt", "x.json") == tmp_path / "a" / "b.pt"


@pytest.mark.parametrize("command", ["compare", "track"])
def test_compare_and_track_refuse_a_run_whose_index_leads_out(tmp_path, victim, command):
    run = plant(tmp_path / "runs" / "r", TWO_UP + "victim.txt")
    args = [command, run, run] if command == "compare" else [command, run, "--source", "checkpoints"]
    r = runner.invoke(app, [str(a) for a in [*args, "--out", tmp_path / "out"]])
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert repr(TWO_UP + "victim.txt") in lines[0] and "outside" in lines[0]
    assert victim.read_text() == "keep me"


def _record(report_paths: list[str]) -> ComparisonRecord:
    side = WindowSide("adamw", 1, 1.0, 1.0, 1e-3, [], report_paths)
    level = Level(1.0, 0.0, False, side, side)
    return ComparisonRecord("adamw/muon", 0, 0.0, Comparison([level], "adamw/muon", []))


def test_window_reports_are_read_by_name_from_the_cache_never_where_a_record_points(tmp_path, monkeypatch):
    reports = tmp_path / "out" / "analysis" / "reports"
    reports.mkdir(parents=True)
    outside = tmp_path / "elsewhere" / "r.json"
    read = []

    def fake_load_report(path):
        read.append(Path(path))
        return SimpleNamespace(checkpoint="/old/out/runs/s0/adamw/seed0/ckpt_000001.pt")

    monkeypatch.setattr(pruning, "load_report", fake_load_report)
    keep = window_checkpoints([_record([str(outside)])], reports)
    assert read == [reports / "r.json", reports / "r.json"]  # both sides; never the recorded place
    assert keep == {Path("s0/adamw/seed0/ckpt_000001.pt")}
    with pytest.raises(CurvlabError, match="outside"):
        window_checkpoints([_record([str(tmp_path / "x" / "..")])], reports)  # a "name" that is ".."
