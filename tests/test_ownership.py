"""One owner per output folder: a second process on a held ``--out`` gets one line naming the owner's
process and start time; a killed owner's lock is taken over; ``compare`` and ``track`` refuse a run
still being trained (``track`` may draw its monitor rows so far); and two processes making the same
data folder both end with the one dataset."""

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from curvlab.cli import app
from curvlab.data.dataset import generate_pcfg_dataset
from curvlab.errors import CurvlabError
from curvlab.jobs.presets import PRESETS
from curvlab.jobs.reproduce import Reproduction
from curvlab.runs.checkpoint import read_index
from curvlab.runs.config import TrainConfig
from curvlab.runs.monitor import MonitorSettings
from curvlab.runs.train import train
from curvlab.studies.compare import compare_runs
from curvlab.studies.track import track_monitor, track_run
from curvlab.util.lock import LOCK_FILE, OWNER_FILE, own_directory, read_owner
from tests.builders import small_config
from tests.generating import HANG_GUARD_S, generating, wait_for_it

runner = CliRunner()
TINY_DATA = dict(s=1.0, tokens="20k", val_tokens="4k", progress=False)

HOLD = """
import signal, sys
from curvlab.util.lock import own_directory
with own_directory(sys.argv[1], sys.argv[2]):
    print("held", flush=True)
    signal.pause()  # until killed
"""


@contextlib.contextmanager
def held(directory: Path, what: str = "train"):
    """A separate process that holds ``directory`` (as ``curvlab <what>`` would) until killed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), what], stdout=subprocess.PIPE, text=True,
                              env=env)  # fmt: skip
    try:
        ready, _, _ = select.select([holder.stdout], [], [], HANG_GUARD_S)  # (a guard against a hang)
        assert ready and holder.stdout.readline().strip() == "held"  # (an empty line: it died before holding)
        yield holder
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("own") / "data"
    generate_pcfg_dataset(out, **TINY_DATA)
    return out


@pytest.fixture(scope="module")
def holder(tmp_path_factory):
    """A directory another process holds as ``curvlab train`` would, for the whole module."""
    directory = tmp_path_factory.mktemp("held") / "run"
    with held(directory) as process:
        yield directory, process


def tiny_run(data: Path, out: Path, **kw) -> TrainConfig:
    return small_config(
        data, out, **{"batch_size": 4, "steps": 2, "eval_every": 1, "ckpt_every": 1, "val_windows": 4, **kw}
    )


def assert_names(message: str, holder: subprocess.Popen, what: str) -> None:
    assert "\n" not in message
    assert f"in use by process {holder.pid} on " in message and f"(curvlab {what}, started " in message, message


def test_a_second_process_on_a_held_out_is_refused_in_one_line_naming_the_owner(data, holder):
    out, process = holder
    assert read_owner(out).pid == process.pid
    with pytest.raises(CurvlabError) as e, own_directory(out, "compare"):
        pass
    assert_names(str(e.value), process, "train")
    r = runner.invoke(app, ["train", "--data", str(data), "--out", str(out), "--steps", "2", "--warmup-steps", "1",
                            "--model-opt", "n_layer=1", "--batch-size", "4", "--val-windows", "4", "--quiet"])  # fmt: skip
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:"), r.output
    assert_names(lines[0], process, "train")
    assert not (out / "config.json").exists() and not (out / "index.json").exists()  # the refused one wrote nothing


def test_a_job_on_a_held_out_is_refused_before_it_writes(holder):
    out, process = holder
    with pytest.raises(CurvlabError) as e:
        Reproduction(PRESETS["micro"], out, progress=False).run()
    assert_names(str(e.value), process, "train")
    assert not (out / "reproduce.json").exists() and not (out / "data").exists()


def test_compare_and_track_refuse_a_run_still_being_trained(holder, tmp_path):
    run, process = holder
    (run / "index.json").write_text(json.dumps([{"step": 0, "val_loss": 1.0, "path": "ckpt_000000.pt"}]))
    try:
        for call in (
            lambda: compare_runs(run, run, tmp_path / "cmp", progress=False),
            lambda: track_run(run, tmp_path / "track", progress=False),
        ):
            with pytest.raises(CurvlabError) as e:
                call()
            assert_names(str(e.value), process, "train")
            assert "still being written" in str(e.value)
        r = runner.invoke(app, ["compare", str(run), str(run), "--out", str(tmp_path / "cmp"), "--quiet"])
        assert r.exit_code == 2 and len(r.output.strip().splitlines()) == 1, r.output
        assert f"process {process.pid}" in r.output
    finally:
        (run / "index.json").unlink()
    assert not (tmp_path / "cmp").exists() and not (tmp_path / "track").exists()


def test_the_lock_of_a_killed_owner_is_taken_over(data, tmp_path):
    out = tmp_path / "run"
    with held(out) as process:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        assert read_owner(out).pid == process.pid  # its record stays behind; its lock went with it
        (out / "index.json").write_text(json.dumps([{"step": 0, "val_loss": 1.0, "path": "ckpt_000000.pt"}]))
        with pytest.raises(CurvlabError) as e:  # a reader isn't refused: the run is read (no stable phase found)
            compare_runs(out, out, tmp_path / "cmp", progress=False)
        assert "in use" not in str(e.value)
        (out / "index.json").unlink()
        with own_directory(out, "train") as previous:
            assert previous.pid == process.pid and read_owner(out).pid == os.getpid()
        assert not (out / OWNER_FILE).exists() and (out / LOCK_FILE).exists()
        result = train(tiny_run(data, out), progress=False)  # and a real run trains there
    assert result.step == 2 and [e["step"] for e in read_index(out)] == [0, 1, 2]


def test_a_thread_may_take_its_own_directory_again_but_another_thread_may_not(tmp_path):
    out = tmp_path / "out"
    refused = []

    def other():
        try:
            with own_directory(out, "track"):
                pass
        except CurvlabError as e:
            refused.append(str(e))

    with own_directory(out, "reproduce"):
        with own_directory(out, "finetune") as previous:  # nested in one thread: the same hold
            assert previous is None and read_owner(out).what == "reproduce"
        assert read_owner(out).what == "reproduce"  # the inner exit left the outer hold recorded
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert len(refused) == 1 and f"in use by process {os.getpid()} " in refused[0]
    with own_directory(out, "track"):  # free again
        pass


def test_track_draws_the_monitor_rows_of_a_run_still_being_trained(data, tmp_path):
    run = tmp_path / "run"
    train(tiny_run(data, run), progress=False, monitor=MonitorSettings(every=1, batches=1, windows=2))
    holding, release = threading.Event(), threading.Event()

    def trainer():  # holds the run as its trainer would (another thread is refused like another process)
        with own_directory(run, "train"):
            holding.set()
            release.wait()

    thread = threading.Thread(target=trainer)
    thread.start()
    assert holding.wait(timeout=HANG_GUARD_S)
    try:
        with pytest.raises(CurvlabError, match="still being written"):
            track_run(run, tmp_path / "track", progress=False)
        rows = track_monitor(run, tmp_path / "track")
    finally:
        release.set()
        thread.join()
    assert [r.step for r in rows] == [0, 1]
    assert json.loads((tmp_path / "track" / "track.json").read_text())["source"] == "monitor"


@pytest.mark.heavy
def test_two_processes_making_the_same_data_folder_both_end_with_one_dataset(tmp_path, monkeypatch):
    """The second waits for the first (another process, stopped while this one starts) and takes its
    dataset; of another config, it is refused in one line."""
    out = tmp_path / "data" / "s1"
    with generating(out, tmp_path / "first", **TINY_DATA) as first:
        (busy,) = out.parent.glob(".s1.*.curvlab-tmp")
        shards = wait_for_it(monkeypatch, first, busy)
        ours = generate_pcfg_dataset(out, **TINY_DATA)
        assert first.wait(timeout=HANG_GUARD_S) == 0
    assert shards == [] and ours == json.loads((out / "stats.json").read_text())  # theirs, not made twice
    assert sorted(p.name for p in out.parent.iterdir()) == [".s1.lock", "s1"]  # (the lock file stays)

    other = tmp_path / "other" / "s1"
    monkeypatch.undo()
    with generating(other, tmp_path / "another", **{**TINY_DATA, "s": 0.5}) as another:
        (busy,) = other.parent.glob(".s1.*.curvlab-tmp")
        wait_for_it(monkeypatch, another, busy)
        with pytest.raises(CurvlabError, match="another config") as e:
            generate_pcfg_dataset(other, **TINY_DATA)
        assert another.wait(timeout=HANG_GUARD_S) == 0
    assert "\n" not in str(e.value) and sorted(p.name for p in other.parent.iterdir()) == [".s1.lock", "s1"]
