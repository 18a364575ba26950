"""Issue 48: nothing unsealed is trusted (a record or a cached report whose seal was deleted with the edit),
a base run still training is no base, an interrupted job's invocations and seconds add up, damaged job
files are refused by name, a directory is the same however its path was spelled, and paths that are not
UTF-8 work and print."""

import io
import json
import os
import shutil
import threading
import warnings
from pathlib import Path
from signal import SIGTERM

import pytest

from curvlab.analysis.report import DIGESTS, StaleReport, cached_report, load_report, report_cache_path
from curvlab.analysis.targets import AnalysisSettings
from curvlab.cli import app
from curvlab.cli.errors import print_any_path
from curvlab.data.pcfg import Grammar, make_grammar
from curvlab.errors import CurvlabError
from curvlab.jobs import job as job_module
from curvlab.jobs.finetune import Finetune
from curvlab.jobs.job import CONFIG_VERSION, Job, guard_config, read_invocations
from curvlab.jobs.presets import with_preset
from curvlab.runs.adapt import load_base
from curvlab.runs.checkpoint import add_to_index, read_index
from curvlab.runs.config import TrainConfig, config_difference
from curvlab.runs.match import run_checkpoints
from curvlab.runs.metrics import read_metrics, row_line, truncate_metrics
from curvlab.runs.train import check_resume
from curvlab.studies.records import LevelData
from curvlab.util import schema
from curvlab.util.lock import own_directory
from curvlab.util.safe_stop import Stopped
from tests.builders import assert_refused, runner, small_run
from tests.synthetic import level_data, track
from tests.test_jobs import _Clocks

COMMITTED = Path(__file__).parent.parent / "docs" / "results" / "quick"


@pytest.fixture(scope="module")
def run(pcfg_data, tmp_path_factory):
    """A finished small AdamW run of 4 steps, a checkpoint every 2."""
    out = tmp_path_factory.mktemp("seals") / "run"
    small_run(pcfg_data, out, "adamw", batch_size=4, steps=4, ckpt_every=2, eval_every=2, val_windows=8)
    return out


def _one_line(e: pytest.ExceptionInfo, *expected: str) -> str:
    message = str(e.value)
    assert "\n" not in message, message
    for text in expected:
        assert text in message, message
    return message


# -- nothing unsealed is trusted ---------------------------------------------------------------------


def test_a_record_whose_seal_was_deleted_with_an_edit_is_refused_by_name(tmp_path):
    """The issue's analysis/seed0.json, scaled x1000 with its seal dropped, was re-sealed into summary.json."""
    path = tmp_path / "seed0.json"
    level_data(tracks=[track("adamw", 0.0, 0, [1.0, 2.0])]).save(path)
    assert LevelData.load(path).tracks[0].rows[0].all.nds == 1.0  # (sealed: read)
    d = json.loads(path.read_text())
    del d[schema.SEAL]
    d["tracks"][0]["rows"][0]["nds"] *= 1000
    path.write_text(json.dumps(d))
    with pytest.raises(CurvlabError) as e:
        LevelData.load(path)
    _one_line(e, str(path), "unsealed levels.json record", "not trusted")


def test_an_unsealed_summary_never_reaches_the_readme(tmp_path):
    """The issue's summary.json, edited and its seal deleted, put "0.123 [3.46, 10.6] contradicted" into the
    README: now ``readme-results`` refuses it in one line and leaves the README as it was."""
    results = tmp_path / "results"
    results.mkdir()
    d = json.loads((COMMITTED / "summary.json").read_text())
    del d[schema.SEAL]
    d["primary"][0]["estimate"] = 0.123
    (results / "summary.json").write_text(json.dumps(d))
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results:begin quick -->\n<!-- results:end quick -->\n")
    args = [
        "readme-results",
        results,
        "--readme",
        readme,
        "--figures",
        tmp_path / "figures",
        "--page",
        tmp_path / "p.md",
    ]
    assert_refused(args, str(results / "summary.json"), "unsealed summary.json record")
    assert readme.read_text() == "<!-- results:begin quick -->\n<!-- results:end quick -->\n"
    assert not (tmp_path / "p.md").exists()


def test_a_cached_report_without_its_content_digest_is_recomputed_and_refused_on_load(run, tmp_path):
    """The issue's cache entry without ``digests.report`` was trusted: compare's mean NDS went from -12.26 to 3.01."""
    checkpoint, settings, cache = run / "ckpt_000002.pt", AnalysisSettings(batches=1), tmp_path / "cache"
    first = cached_report(cache, checkpoint, settings)
    path = report_cache_path(cache, checkpoint, settings)
    d = json.loads(path.read_text())
    del d[DIGESTS]["report"]
    d["nds"] = 3.01
    path.write_text(json.dumps(d))
    with pytest.raises(CurvlabError) as e:
        load_report(path)
    _one_line(e, str(path), "unsealed report", "not trusted")
    with pytest.warns(StaleReport, match="records no digests of its content .*: recomputed"):
        again = cached_report(cache, checkpoint, settings)
    assert again.split.nds == first.split.nds != 3.01
    assert load_report(path).split.nds == first.split.nds  # replaced by the recomputed one


# -- a base run still training is no base ------------------------------------------------------------


def test_a_base_run_that_another_thread_trains_is_refused(run):
    held, release = threading.Event(), threading.Event()

    def train_there():
        with own_directory(run, "train"):
            held.set()
            release.wait(30)

    trainer = threading.Thread(target=train_there)
    trainer.start()
    try:
        assert held.wait(30)
        with pytest.raises(CurvlabError) as e:
            load_base(run)
        _one_line(e, str(run), "in use by", "curvlab train", "still training")
    finally:
        release.set()
        trainer.join()
    assert load_base(run)[1]["steps"] == 4  # finished and free: a base


def test_a_base_run_that_stopped_before_its_last_step_is_refused_and_its_checkpoint_taken(run, tmp_path):
    stopped = tmp_path / "stopped"
    shutil.copytree(run, stopped)
    index = read_index(stopped)
    (stopped / "index.json").write_text(json.dumps(index[:-1]))  # as a run killed after step 2's checkpoint
    with pytest.raises(CurvlabError) as e:
        load_base(stopped)
    _one_line(e, f"{stopped}: has not finished training (its last checkpoint is step 2 of 4)", "ckpt_000002.pt")
    assert load_base(stopped / "ckpt_000002.pt")[1]["steps"] == 4  # named, its checkpoint is adapted as it is
    out = tmp_path / "finetune"
    assert_refused(["finetune", "--preset", "micro", "--base", stopped, "--out", out], "has not finished", out=out)


# -- an interrupted job's times add up ---------------------------------------------------------------


class _StoppedOnceJob(Job):
    """A job of one stage: its first invocation is stopped (as by SIGTERM) after ``wall`` seconds."""

    TAG, CONFIG_FILE, WHAT = "once", "once.json", "a job stopped once"

    def __init__(self, out, clocks):
        super().__init__(out, progress=False)
        self.clocks = clocks

    def config(self):
        return {"once": 1}

    def run(self, wall, stop):
        self.start()
        with self.clock("work"):
            self.clocks.wall += wall
            if stop:
                raise Stopped("stopped by SIGTERM after the work: run the same command again to continue", SIGTERM)
        return self.timing()


def test_an_interrupted_job_counts_every_invocation_and_its_seconds(tmp_path, monkeypatch):
    """The issue's reproduction stopped by SIGTERM and resumed reported "1 invocation, 15.6 s"."""
    clocks = _Clocks()
    monkeypatch.setattr(job_module, "time", clocks)
    with pytest.raises(Stopped):
        _StoppedOnceJob(tmp_path, clocks).run(300.0, stop=True)
    assert [i["total"] for i in read_invocations(tmp_path / "timing.json")] == [300.0]
    timing = _StoppedOnceJob(tmp_path, clocks).run(15.0, stop=False)
    assert (timing["invocations"], timing["total"], timing["work"]) == (2, 315.0, 315.0)


def test_a_job_refused_at_its_config_records_no_time(tmp_path):
    (tmp_path / "once.json").write_text(json.dumps({"once": 2, "config_version": CONFIG_VERSION}))
    with pytest.raises(CurvlabError, match="of another configuration"):
        _StoppedOnceJob(tmp_path, _Clocks()).run(1.0, stop=False)
    assert not (tmp_path / "timing.json").exists()  # not this job's directory: nothing written there


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda t: t[: len(t) // 2], "corrupt JSON"),
        (lambda t: json.dumps([{"load": 1.0}]), "an invocation is no object with a total"),  # a damaged 0.2.0 list
        (lambda t: json.dumps([{"total": "300"}]), "total '300' is no finite number"),
        (lambda t: t.replace('"total": 300', '"total": 301'), "edited or corrupt timing.json record"),
        (lambda t: json.dumps({k: v for k, v in json.loads(t).items() if k != schema.SEAL}), "unsealed timing.json"),
        (lambda t: "[" * 100000 + "]" * 100000, "nested too deeply"),
        (lambda t: "1" * 5000, "corrupt JSON"),
    ],
)
def test_a_damaged_timing_file_is_refused_by_name_before_the_work(tmp_path, monkeypatch, damage, expected):
    clocks = _Clocks()
    monkeypatch.setattr(job_module, "time", clocks)
    with pytest.raises(Stopped):
        _StoppedOnceJob(tmp_path, clocks).run(300.0, stop=True)
    path = tmp_path / "timing.json"
    path.write_text(damage(path.read_text()))
    job = _StoppedOnceJob(tmp_path, clocks)
    with pytest.raises(CurvlabError) as e:
        job.run(1.0, stop=False)
    _one_line(e, str(path), expected, "delete it to go on")
    assert job.clock.timing == {}  # refused before the work


def test_a_timing_file_of_curvlab_0_2_0_is_counted_and_sealed_at_the_next_record(tmp_path, monkeypatch):
    """0.2.0 wrote timing.json as a bare list: a job it left resumes, its invocations counted."""
    clocks = _Clocks()
    monkeypatch.setattr(job_module, "time", clocks)
    path = tmp_path / "timing.json"
    path.write_text(json.dumps([{"total": 40.0, "load": 1.5, "threads": 1, "cpus": 2}]))
    assert read_invocations(path) == [{"total": 40.0, "load": 1.5, "threads": 1, "cpus": 2}]
    _StoppedOnceJob(tmp_path, clocks).run(300.0, stop=False)
    assert [i["total"] for i in read_invocations(path)] == [40.0, 300.0]
    assert schema.SEAL in json.loads(path.read_text())  # (sealed from now on)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", "\xff\xfe", "[" * 100000, "9" * 5000])
def test_a_damaged_job_config_is_refused_by_name(tmp_path, text):
    path = tmp_path / "reproduce.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(CurvlabError) as e:
        guard_config(path, {"preset": {"name": "micro"}}, "the results of preset 'micro'")
    _one_line(e, str(path))


# -- a directory is the same however its path is spelled ----------------------------------------------


def test_a_job_directory_is_the_same_however_its_path_is_spelled(run, tmp_path, monkeypatch):
    """The issue's finished micro reproduction, rerun with --out spelled from the parent folder, was refused
    as "another configuration": its fine-tuning stored the base run as a path relative to the working
    directory."""
    work = tmp_path / "work"
    (work / "results").mkdir(parents=True)
    shutil.copytree(run, work / "results" / "base")
    monkeypatch.chdir(work)
    first = Finetune(with_preset("micro"), "results/finetune", base="results/base", progress=False)
    assert first.out == work / "results" / "finetune" and first.config()["base"] == str(work / "results" / "base")
    first._check_config()
    monkeypatch.chdir(work / "results")
    again = Finetune(with_preset("micro"), "finetune", base=work / "results" / "base", progress=False)
    again._check_config()  # the same directory, spelled from another folder: no other configuration
    other = Finetune(with_preset("micro"), "finetune", base=run, progress=False)
    with pytest.raises(CurvlabError, match="of another configuration"):
        other._check_config()  # another base run is another configuration


def test_a_configuration_an_older_curvlab_saved_with_relative_paths_still_matches(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "finetune-config.json"
    saved = {"preset": {}, "base": "results/base", "data": "None", "config_version": CONFIG_VERSION}
    path.write_text(json.dumps(saved))
    guard_config(path, {"preset": {}, "base": str(tmp_path / "results/base"), "data": "None"}, "it", ("base", "data"))
    with pytest.raises(CurvlabError, match="of another configuration"):
        guard_config(path, {"preset": {}, "base": str(tmp_path / "other"), "data": "None"}, "it", ("base", "data"))


def test_a_runs_data_is_the_same_however_its_path_is_spelled(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert config_difference({"data": "data/s0"}, {"data": str(tmp_path / "data" / "s0")}) == []
    assert config_difference({"data": "./data/../data/s0"}, {"data": "data/s0"}) == []
    assert config_difference({"data": "data/s1"}, {"data": "data/s0"}) == ["data: 'data/s1' -> 'data/s0'"]


# -- paths that are not UTF-8 -------------------------------------------------------------------------


def test_a_path_that_is_not_utf8_prints_on_a_strict_stream(monkeypatch):
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    stderr = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict")
    monkeypatch.setattr("sys.stdout", stdout)
    monkeypatch.setattr("sys.stderr", stderr)
    path = os.fsdecode(b"/tmp/w\xff/run")
    with pytest.raises(UnicodeEncodeError):
        stdout.write(path)  # (what a strict locale's stdout did with it)
    print_any_path()
    stdout.write(path)
    stderr.write(path)
    for stream in (stdout, stderr):
        stream.flush()
    assert stdout.buffer.getvalue().endswith(b"/tmp/w\xff/run")  # its own bytes, as ls prints them
    assert stderr.buffer.getvalue() == b"/tmp/w\\udcff/run"


def test_track_and_its_report_cache_work_in_a_folder_whose_name_is_not_utf8(run, tmp_path):
    folder = tmp_path / os.fsdecode(b"w\xff")
    shutil.copytree(run, folder / "run")
    path = report_cache_path(folder / "cache", folder / "run" / "ckpt_000004.pt", AnalysisSettings(batches=1))
    assert path.parent == folder / "cache"  # (its key hashes the path's bytes)
    r = runner.invoke(app, ["track", str(folder / "run"), "--quiet"])
    assert r.exit_code == 0, r.output
    rows = json.loads((folder / "run" / "track" / "track.json").read_text())["rows"]
    assert rows and len(list((folder / "run" / "track" / "reports").iterdir())) == len(rows)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every report read back from its cache entry: no note
        r = runner.invoke(app, ["track", str(folder / "run"), "--quiet"])
    assert r.exit_code == 0, r.output
    again = json.loads((folder / "run" / "track" / "track.json").read_text())["rows"]
    assert [(r["step"], r["nds"]) for r in again] == [(r["step"], r["nds"]) for r in rows]


# -- a run's index, its metrics rows and a grammar are sealed; a run's config is one line (issue 48) ---


def test_a_runs_sealed_index_refuses_a_flipped_digit_of_a_loss(run, tmp_path):
    copy = shutil.copytree(run, tmp_path / "run")
    text = (copy / "index.json").read_text()
    assert json.loads(text)["version"] == 2 and schema.SEAL in json.loads(text)
    loss = json.dumps(read_index(copy)[-1]["val_loss"])
    (copy / "index.json").write_text(text.replace(loss, loss[:-1] + ("2" if loss[-1] == "1" else "1")))
    with pytest.raises(CurvlabError) as e:
        read_index(copy)
    _one_line(e, "index.json: edited or corrupt checkpoint index")


def test_a_metrics_row_edited_without_its_digest_or_cut_short_is_refused(run, tmp_path):
    copy = shutil.copytree(run, tmp_path / "run")
    lines = (copy / "metrics.jsonl").read_text().splitlines(keepends=True)
    row = json.loads(lines[1])
    for edited, expected in (
        ({**row, "train_loss": row["train_loss"] + 1e-9}, "line 2 does not match its row_digest"),
        ({k: v for k, v in row.items() if k != "row_digest"}, "line 2 has no row_digest"),
    ):
        (copy / "metrics.jsonl").write_text("".join([lines[0], json.dumps(edited) + "\n", *lines[2:]]))
        with pytest.raises(CurvlabError) as e:
            read_metrics(copy)
        _one_line(e, expected)
    (copy / "metrics.jsonl").write_text("".join(lines[:-1]))  # step 4's row gone, and step 4 is checkpointed
    with pytest.raises(CurvlabError) as e:
        read_metrics(copy)
    _one_line(e, "before the last checkpoint's (4): cut short")


def test_rows_without_digests_are_read_only_where_a_version_1_index_says_an_older_curvlab_wrote_them(run, tmp_path):
    copy = shutil.copytree(run, tmp_path / "run")
    entries, rows = read_index(copy), read_metrics(copy)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))  # as curvlab 0.2.0 wrote
    (copy / "index.json").write_text(json.dumps(entries[:-1]))  # its index: a bare list, stopped at step 2
    assert read_metrics(copy) == rows
    truncate_metrics(copy, 2)  # a resume from step 2, then its next checkpoint: a version-2 index
    add_to_index(copy, 4, entries[-1]["val_loss"], entries[-1]["path"])
    index = json.loads((copy / "index.json").read_text())
    assert index["version"] == 2 and index["legacy_rows_upto"] == 2 and read_index(copy) == entries
    with (copy / "metrics.jsonl").open("a") as f:  # step 3 as this curvlab writes it, step 4 without its digest
        f.write(row_line(rows[2]) + "\n" + json.dumps(rows[3]) + "\n")
    with pytest.raises(CurvlabError) as e:
        read_metrics(copy)
    _one_line(e, "line 4 has no row_digest")
    text = (copy / "metrics.jsonl").read_text()
    (copy / "metrics.jsonl").write_text(text.replace(json.dumps(rows[3]), row_line(rows[3])))  # with its digest
    assert read_metrics(copy) == rows


def test_a_grammar_is_sealed_and_one_of_version_1_is_read_without_a_seal(tmp_path):
    grammar, path = make_grammar(seed=0, n_tokens=64, n_classes=4, depth=3), tmp_path / "grammar.json"
    grammar.save(path)
    saved = json.loads(path.read_text())
    assert saved["version"] == 2 and Grammar.load(path) == grammar
    content = {k: v for k, v in saved.items() if k != schema.SEAL}
    for d, expected in (
        ({**saved, "rule_s": saved["rule_s"] + 1}, "edited or corrupt grammar"),
        (content, "unsealed grammar"),
        ({**saved, "levels": "[" * 100_000}, "corrupt JSON in a grammar"),
    ):
        path.write_text(json.dumps(d).replace('"' + "[" * 100_000 + '"', "[" * 100_000))
        with pytest.raises(CurvlabError) as e:
            Grammar.load(path)
        _one_line(e, f"{path}: {expected}")
    path.write_text(json.dumps({**content, "version": 1}))  # as curvlab 0.2.0 wrote it
    assert Grammar.load(path) == grammar


def test_a_runs_config_of_another_type_is_one_line_and_a_valid_other_one_another_configuration(run, tmp_path):
    copy = shutil.copytree(run, tmp_path / "run")
    saved = json.loads((copy / "config.json").read_text())
    cfg = TrainConfig.from_dict(saved)
    for text in (json.dumps({**saved, "steps": "4"}), "[" * 100_000, json.dumps({**saved, "seed": "9" * 5000})):
        (copy / "config.json").write_text(text)
        for read in (lambda: check_resume(copy, cfg), lambda: run_checkpoints(copy)):
            with pytest.raises(CurvlabError) as e:
                read()
            _one_line(e, str(copy))  # (the run's directory, or its config.json)
    (copy / "config.json").write_text(json.dumps({**saved, "steps": 5}))  # valid, and not this run's
    with pytest.raises(CurvlabError) as e:
        check_resume(copy, cfg)
    _one_line(e, "holds a run with another config; refusing to resume (steps: 5 -> 4)")
