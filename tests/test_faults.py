"""Faults lose nothing and leave nothing trusted (curvlab.util.atomic, curvlab.util.safe_stop, the report cache).

Each fault is simulated, not waited for: a full disk is a file-size limit (``RLIMIT_FSIZE``: the write
fails with EFBIG, as with ENOSPC; Python ignores the SIGXFSZ that comes with it); a refused write is
``/sys`` (where not even root may create a file; the tests run as root, whom permission bits don't
bind; its cause, "Permission denied" or "Read-only file system", is the one a plain ``os.open`` there
gets) or a folder that is a file; kill -9, SIGTERM and SIGINT are sent by the process to itself at a
chosen point (mid-checkpoint-write, mid-step), so each lands exactly there. A full disk at a metrics row
is ``os.write`` failing with ENOSPC (no file-size limit lets the checkpoint of step 0 through and stops a
row of 100 bytes). What a run's folder holds that is not the run's own (a lock file that is a link, a
Hugging Face checkpoint, a corrupt byte, a second trainer) is planted in a copy of a real run.
"""

import contextlib
import errno
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from curvlab.analysis.report import StaleReport, cached_report, load_report, report_cache_path
from curvlab.analysis.targets import AnalysisSettings
from curvlab.cli import app
from curvlab.data.dataset import generate_pcfg_dataset
from curvlab.data.shards import TrainBatches
from curvlab.errors import CurvlabError
from curvlab.jobs.presets import PRESETS
from curvlab.jobs.reproduce import Reproduction
from curvlab.runs.checkpoint import load_checkpoint, read_index
from curvlab.runs.config import TrainConfig
from curvlab.runs.match import MatchCriteria
from curvlab.runs.metrics import read_metrics
from curvlab.runs.train import train
from curvlab.studies.compare import compare_runs
from curvlab.studies.records import LevelData
from curvlab.util import atomic, schema
from curvlab.util.atomic import (
    TEMPORARY_SUFFIX,
    atomic_open,
    atomic_write_json,
    remove_stale_temporaries,
    writes_confined_to,
)
from curvlab.util.digest import path_digest
from curvlab.util.lock import LOCK_FILE
from curvlab.util.safe_stop import Stopped, check_stop, stop_at_safe_points
from tests.builders import SMALL_MODEL, small_config
from tests.generating import generating, wait_for_it

STEPS, EVERY = 6, 2


def _config(data: Path, out: Path, **overrides) -> TrainConfig:
    fields = dict(batch_size=4, steps=STEPS, eval_every=EVERY, ckpt_every=EVERY, val_windows=4)
    return small_config(data, out, **{**fields, **overrides})


def _train_args(data: Path, out: Path) -> list[str]:
    """``curvlab train`` of :func:`_config`."""
    model = [a for k, v in SMALL_MODEL.items() for a in ("--model-opt", f"{k}={v}")]
    return ["train", "--data", str(data), "--out", str(out), *model, "--batch-size", "4", "--steps", str(STEPS),
            "--warmup-steps", "1", "--eval-every", str(EVERY), "--ckpt-every", str(EVERY), "--val-windows", "4",
            "--quiet"]  # fmt: skip


def _command(args: list[str], before: str = "") -> list[str]:
    """The command line of the CLI in a fresh process, after the Python lines ``before`` (the fault's hook)."""
    # as a command typed at a terminal: SIGINT not ignored (a background job's would be)
    foreground = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"
    code = f"{foreground}{before}\nfrom curvlab.cli import app\napp({args!r}, prog_name='curvlab')\n"
    return [sys.executable, "-c", code]


def _env() -> dict[str, str]:
    # on as many threads as this process, which trains the references and the resumed runs (floats depend on it)
    return {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}


def _curvlab(args: list[str], before: str = "", file_size: int | None = None) -> subprocess.CompletedProcess:
    """The CLI in a fresh process, after the Python lines ``before`` (the fault's hook), optionally under a
    file-size limit of ``file_size`` bytes."""

    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))

    return subprocess.run(
        _command(args, before), capture_output=True, text=True, timeout=300, preexec_fn=limit if file_size else None,
        env=_env(),
    )  # fmt: skip


def _resume(out: Path):
    """Run the run in ``out`` again (in this process) under the config it was started with."""
    return train(TrainConfig.from_dict(json.loads((out / "config.json").read_text())), progress=False)


def _assert_same_final_state(out: Path, reference: Path) -> None:
    mine, ref = (load_checkpoint(d / f"ckpt_{STEPS:06d}.pt") for d in (out, reference))
    assert mine["model"].keys() == ref["model"].keys()
    assert all(torch.equal(mine["model"][k], ref["model"][k]) for k in ref["model"])
    assert str(mine["optimizer"]["param_groups"]) == str(ref["optimizer"]["param_groups"])
    assert all(
        torch.equal(a, b)
        for s, r in zip(mine["optimizer"]["state"].values(), ref["optimizer"]["state"].values())
        for a, b in zip(s.values(), r.values())
        if isinstance(a, torch.Tensor)
    )
    assert (out / "metrics.jsonl").read_text() == (reference / "metrics.jsonl").read_text()  # no row lost or doubled
    assert [e["step"] for e in read_index(out)] == [e["step"] for e in read_index(reference)]


def _temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob(f"*{TEMPORARY_SUFFIX}"))


@pytest.fixture(scope="module")
def reference(pcfg_data, tmp_path_factory) -> Path:
    """The uninterrupted run."""
    out = tmp_path_factory.mktemp("faults") / "reference"
    train(_config(pcfg_data, out), progress=False)
    return out


@contextlib.contextmanager
def file_size_limit(n: int):
    """This process's writes stop at ``n`` bytes a file (EFBIG), until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (n, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


# -- failed writes ---------------------------------------------------------------------------------


@pytest.mark.heavy
def test_a_checkpoint_write_past_the_file_size_limit_is_one_line_and_the_run_resumes(pcfg_data, reference, tmp_path):
    small, large = ((reference / f"ckpt_{s:06d}.pt").stat().st_size for s in (0, EVERY))
    assert small < large  # (step 0 has no optimizer state yet: its checkpoint fits, step 2's does not)
    out = tmp_path / "run"
    r = _curvlab(_train_args(pcfg_data, out), file_size=(small + large) // 2)
    target = out / f"ckpt_{EVERY:06d}.pt"
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        f"error: {target}: write failed (File too large); the previous file, if any, is unchanged"
    ]  # not torch's multi-line "[enforce fail at inline_container.cc] unexpected pos"
    assert not target.exists() and _temporaries(out) == []  # no partial file
    assert [e["step"] for e in read_index(out)] == [0]
    load_checkpoint(out / "ckpt_000000.pt")  # the previous checkpoint is whole
    assert _resume(out).resumed_from == 0
    _assert_same_final_state(out, reference)


def test_a_json_write_past_the_file_size_limit_keeps_the_previous_file(tmp_path):
    path = tmp_path / "levels.json"
    atomic_write_json(path, {"previous": True})
    before = path.read_bytes()
    with file_size_limit(1000), pytest.raises(CurvlabError) as e:
        atomic_write_json(path, {"rows": list(range(1000))})
    assert str(e.value) == f"{path}: write failed (File too large); the previous file, if any, is unchanged"
    assert path.read_bytes() == before and _temporaries(tmp_path) == []


def _refusal(folder: str) -> str:
    """Why a new file in ``folder`` is refused, as the system says it."""
    try:
        fd = os.open(Path(folder) / ".curvlab-probe", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except OSError as e:
        return e.strerror
    os.close(fd)
    os.unlink(Path(folder) / ".curvlab-probe")
    pytest.fail(f"{folder} took a new file")


@pytest.mark.parametrize("where", ["/sys", "a-file"])
def test_a_refused_write_is_one_line_naming_the_path_and_the_cause(tmp_path, where):
    if where == "a-file":
        (tmp_path / "a-file").write_text("")
        where = tmp_path / "a-file" / "sub"  # a folder that is a file
        cause = "Not a directory"
    else:
        cause = _refusal(where)  # (EACCES or EROFS, depending on the container)
    path = Path(where) / "report.json"
    with pytest.raises(CurvlabError) as e:
        atomic_write_json(path, {})
    assert str(e.value) == f"{path}: write failed ({cause}); the previous file, if any, is unchanged"


def test_an_unexpected_failure_inside_a_write_keeps_its_traceback(tmp_path):
    with pytest.raises(ZeroDivisionError), atomic_open(tmp_path / "x.bin") as f:
        f.write(b"half")
        1 / 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "error",
    [
        TimeoutError("timed out"),
        ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"),
        OSError(errno.ENOMEM, "Cannot allocate memory"),
        BrokenPipeError(errno.EPIPE, "Broken pipe"),
        RuntimeError("the server went away"),
        RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0"),
    ],
    ids=["timeout", "connection-reset", "enomem", "broken-pipe", "runtime-error", "torch-writer-error"],
)
def test_an_error_that_is_no_failed_write_keeps_its_type_and_traceback_and_the_temporary_goes(tmp_path, error):
    with pytest.raises(type(error)) as e, atomic_open(tmp_path / "x.bin") as f:
        f.write(b"half")
        try:
            raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")  # not a write's
        except OSError:
            raise error  # noqa: B904  (raised in handling it: the OSError is its context)
    assert e.value is error and isinstance(error.__context__, ConnectionResetError)  # as raised, not one line
    assert list(tmp_path.iterdir()) == []


def test_a_write_on_a_file_system_without_flock_goes_on_and_its_temporaries_stay(tmp_path, monkeypatch):
    def no_flock(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(atomic.fcntl, "flock", no_flock)
    left = tmp_path / f".index.json.ab_3xyz9{TEMPORARY_SUFFIX}"
    left.write_text("[")
    atomic_write_json(tmp_path / "index.json", [])
    assert json.loads((tmp_path / "index.json").read_text()) == []
    assert remove_stale_temporaries(tmp_path) == [] and left.exists()  # no lock to tell a live writer's: kept


# -- temporaries left by a killed write -------------------------------------------------------------


@pytest.mark.heavy
def test_kill_9_mid_checkpoint_leaves_a_temporary_that_the_next_run_removes(pcfg_data, reference, tmp_path):
    out = tmp_path / "run"
    kill = """
import io, os, signal, torch
real, calls = torch.save, []
def save(obj, f, *args, **kwargs):  # the second checkpoint (step 2): half written, then kill -9
    calls.append(1)
    if len(calls) == 2:
        buffer = io.BytesIO()
        real(obj, buffer, *args, **kwargs)
        f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return real(obj, f, *args, **kwargs)
torch.save = save
"""
    r = _curvlab(_train_args(pcfg_data, out), before=kill)
    assert r.returncode == -signal.SIGKILL
    left = _temporaries(out)
    assert len(left) == 1 and left[0].startswith(f".ckpt_{EVERY:06d}.pt.")  # the half-written checkpoint
    assert [e["step"] for e in read_index(out)] == [0]  # never listed: nothing reads it
    assert _resume(out).resumed_from == 0
    assert _temporaries(out) == []  # removed by the next run
    _assert_same_final_state(out, reference)


def test_only_a_dead_writers_temporaries_are_removed(tmp_path):
    stale = tmp_path / f".index.json.ab_3xyz9{TEMPORARY_SUFFIX}"  # atomic_open's pattern, no writer: a leftover
    stale.write_text("[")
    names = (
        ".index.json.ab_3xyz9.tmp",
        ".index.json.tmp",
        f"notes.abcdefgh{TEMPORARY_SUFFIX}",
        f".x.AB{TEMPORARY_SUFFIX}",
    )
    others = [tmp_path / n for n in names]  # (the first: another program's mkstemp, of the same name)
    for p in others:
        p.write_text("mine")
    nested = tmp_path / "runs" / "seed0"
    nested.mkdir(parents=True)
    (nested / f".ckpt_000002.pt.k2j4h5g6{TEMPORARY_SUFFIX}").write_bytes(b"PK")
    with atomic_open(tmp_path / "live.json", "w") as f:  # a live writer's temporary, mid-write
        f.write("{")
        assert remove_stale_temporaries(tmp_path) == [stale]
        live = [p for p in tmp_path.glob(f".live.json.*{TEMPORARY_SUFFIX}")]
        assert len(live) == 1  # locked by its writer: left alone
        f.write("}")
    assert (tmp_path / "live.json").read_text() == "{}"
    assert all(p.read_text() == "mine" for p in others)  # not atomic_open's names
    assert (nested / f".ckpt_000002.pt.k2j4h5g6{TEMPORARY_SUFFIX}").exists()  # not recursive unless asked
    assert remove_stale_temporaries(tmp_path, recursive=True) == [
        nested / f".ckpt_000002.pt.k2j4h5g6{TEMPORARY_SUFFIX}"
    ]


def test_a_temporary_removed_before_its_writer_locked_it_is_made_again(tmp_path, monkeypatch):
    real, made = atomic.tempfile.mkstemp, []

    def mkstemp_then_a_remover(**options):  # a remover runs between mkstemp and the writer's flock
        fd, name = real(**options)
        made.append(name)
        if len(made) == 1:
            assert remove_stale_temporaries(tmp_path) == [Path(name)]  # unlocked yet: taken for a leftover
        return fd, name

    monkeypatch.setattr(atomic.tempfile, "mkstemp", mkstemp_then_a_remover)
    atomic_write_json(tmp_path / "index.json", [1])
    assert len(made) == 2 and json.loads((tmp_path / "index.json").read_text()) == [1]
    assert _temporaries(tmp_path) == []


# -- SIGINT and SIGTERM stop at a safe point --------------------------------------------------------


@pytest.fixture
def foreground_signals():
    """SIGINT and SIGTERM as a process started at a terminal has them (pytest itself may run as a
    background job, whose SIGINT is ignored); the handlers of before afterwards."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


def test_an_ignored_signal_stays_ignored(foreground_signals):
    """``nohup`` and a shell's background jobs ignore signals on purpose: inside, they still are."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with stop_at_safe_points():
        os.kill(os.getpid(), signal.SIGINT)
        check_stop("nowhere")  # nothing pending: the signal was ignored
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        os.kill(os.getpid(), signal.SIGTERM)  # (not ignored: honoured at the safe point)
        with pytest.raises(Stopped):
            check_stop("after the test")
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


MID_STEP = """
import os, signal
from curvlab.data.shards import TrainBatches
real, calls = TrainBatches.next, []
def next_batch(self):  # the batch of step 3, between checkpoints: the signal lands mid-step
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.{sig})
    return real(self)
TrainBatches.next = next_batch
"""
MID_CHECKPOINT = """
import os, signal, torch
real, calls = torch.save, []
def save(obj, f, *args, **kwargs):  # the third checkpoint (step 4): the signal lands mid-write
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), signal.{sig})
    return real(obj, f, *args, **kwargs)
torch.save = save
"""


@pytest.mark.heavy
@pytest.mark.parametrize(
    "sig, hook, step, last",
    [("SIGINT", MID_STEP, 3, 2), ("SIGTERM", MID_CHECKPOINT, 4, 4)],
    ids=["sigint-mid-step", "sigterm-mid-checkpoint"],
)
def test_a_signal_stops_training_at_a_safe_point_and_the_rerun_resumes_bit_for_bit(
    pcfg_data, reference, tmp_path, sig, hook, step, last
):
    out = tmp_path / "run"
    r = _curvlab(_train_args(pcfg_data, out), before=hook.format(sig=sig))
    signum = getattr(signal, sig)
    assert r.returncode == 128 + signum, r.stderr  # 130, 143: as a shell reports the signal
    assert r.stderr.splitlines() == [
        f"error: stopped by {sig} after step {step} in {out}; its last checkpoint is step {last}: run the same "
        "command again to resume from it"
    ]
    assert _temporaries(out) == [] and [e["step"] for e in read_index(out)][-1] == last  # the write finished
    load_checkpoint(out / f"ckpt_{last:06d}.pt")
    assert _resume(out).resumed_from == last
    _assert_same_final_state(out, reference)


def test_a_stop_is_checked_only_inside_the_context_and_a_second_signal_stops_at_once(foreground_signals):
    check_stop("nowhere")  # nothing pending
    before = signal.getsignal(signal.SIGTERM)
    with stop_at_safe_points():
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # a second signal while one is pending
        with pytest.raises(Stopped) as e:
            check_stop("after the test")
    assert str(e.value) == "stopped by SIGTERM after the test" and e.value.exit_code == 143
    assert signal.getsignal(signal.SIGTERM) is before
    check_stop("after the context")  # the request ended with it


# -- caches are derived: recomputed, never trusted; inputs are refused --------------------------------


@pytest.fixture(scope="module")
def two_runs(pcfg_data, tmp_path_factory) -> Path:
    runs = tmp_path_factory.mktemp("faults_runs")
    for optimizer in ("adamw", "muon"):
        train(_config(pcfg_data, runs / optimizer, optimizer=optimizer, steps=8, schedule="constant"), progress=False)
    return runs


def _compare(runs: Path, out: Path):
    criteria = MatchCriteria(levels=2, tolerance=1.0, phase="any", window=0)
    compare_runs(runs / "adamw", runs / "muon", out, criteria, AnalysisSettings(batches=1), progress=False)
    d = json.loads((out / "compare.json").read_text())
    return d


def test_a_truncated_or_edited_cached_report_is_recomputed_with_a_note(two_runs, tmp_path):
    out = tmp_path / "compare"
    clean = _compare(two_runs, out)
    reports = sorted((out / "reports").iterdir())
    assert len(reports) >= 2
    truncated, edited = reports[0], reports[1]
    truncated.write_text(truncated.read_text()[:100])  # cut short
    d = json.loads(edited.read_text())
    d["nds"] = d["nds"] * 1000 + 1.0  # another valid JSON: what an edit leaves
    edited.write_text(json.dumps(d, indent=1))
    (out / f".compare.json.abcd_123{TEMPORARY_SUFFIX}").write_text("{")  # what killed writes left, here and in
    (out / "reports" / f".{edited.name}.x1y2z3w4{TEMPORARY_SUFFIX}").write_text("{")  # the cache
    with pytest.warns(StaleReport) as notes:
        again = _compare(two_runs, out)
    assert _temporaries(out) == []
    said = sorted(str(n.message) for n in notes)
    assert any(m.startswith(f"{truncated}: the cached report is unreadable") for m in said), said
    assert f"{edited}: the cached report was edited or is corrupt (its content does not match its digest): " \
        "recomputed" in said  # fmt: skip
    assert again == clean  # the same comparison as the clean run's
    load_report(edited)  # replaced by the recomputed one


def test_a_cached_report_of_other_checkpoint_bytes_is_recomputed_and_a_corrupt_checkpoint_refused(two_runs, tmp_path):
    checkpoint = tmp_path / "ckpt_000008.pt"
    checkpoint.write_bytes((two_runs / "adamw" / "ckpt_000008.pt").read_bytes())
    settings = AnalysisSettings(batches=1)
    first = cached_report(tmp_path / "cache", checkpoint, settings)
    path = report_cache_path(tmp_path / "cache", checkpoint, settings)
    stat = checkpoint.stat()
    data = bytearray(checkpoint.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte inside a tensor: same size, and the time put back
    checkpoint.write_bytes(bytes(data))
    os.utime(checkpoint, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert report_cache_path(tmp_path / "cache", checkpoint, settings) == path  # the same entry's name
    with pytest.raises(CurvlabError) as e, warnings.catch_warnings(record=True) as notes:
        warnings.simplefilter("always")
        cached_report(tmp_path / "cache", checkpoint, settings)
    assert [n.category for n in notes] == [StaleReport] and "made from other checkpoint bytes" in str(notes[0].message)
    assert str(e.value).startswith(f"{checkpoint}: corrupt checkpoint: its record ") and "checksum" in str(e.value)
    assert load_report(path).split.nds == first.split.nds  # the entry stays until a good report replaces it


def test_an_edited_report_is_refused_on_load_and_a_truncated_levels_file_too(two_runs, tmp_path):
    report = cached_report(tmp_path / "cache", two_runs / "muon" / "ckpt_000008.pt", AnalysisSettings(batches=1))
    report.save(tmp_path / "r.json")
    load_report(tmp_path / "r.json")
    d = json.loads((tmp_path / "r.json").read_text())
    d["cosine"] = 0.5
    (tmp_path / "r.json").write_text(json.dumps(d))
    with pytest.raises(CurvlabError, match="edited or corrupt report"):
        load_report(tmp_path / "r.json")
    levels = tmp_path / "levels.json"
    schema.save(levels, LevelData([], [], 3.0, [0.0]))
    levels.write_text(levels.read_text()[:20])
    with pytest.raises(CurvlabError, match="corrupt JSON"):
        LevelData.load(levels)


def test_a_report_is_a_safe_point_and_reproduce_stops_at_one(two_runs, tmp_path, monkeypatch, foreground_signals):
    checkpoint = two_runs / "muon" / "ckpt_000008.pt"
    with stop_at_safe_points(), pytest.raises(Stopped) as e:
        os.kill(os.getpid(), signal.SIGTERM)  # mid-analysis: the report is finished and saved first
        cached_report(tmp_path / "cache", checkpoint, AnalysisSettings(batches=1))
    assert str(e.value).startswith(f"stopped by SIGTERM after the report of {checkpoint}")
    load_report(report_cache_path(tmp_path / "cache", checkpoint, AnalysisSettings(batches=1)))
    # a reproduction: SIGINT at its first training step (tuning) stops it there, in one line
    real = TrainBatches.next

    def interrupted(self):
        os.kill(os.getpid(), signal.SIGINT)
        return real(self)

    monkeypatch.setattr(TrainBatches, "next", interrupted)
    out = tmp_path / "micro"
    (out / "runs").mkdir(parents=True)
    (out / "runs" / f".tuning.json.abcd1234{TEMPORARY_SUFFIX}").write_text("{")  # left by a killed write
    with pytest.raises(Stopped) as e:
        Reproduction(PRESETS["micro"], out, progress=False).run()
    assert e.value.exit_code == 130 and "stopped by SIGINT after step 1 in " in str(e.value)
    assert _temporaries(out) == []  # the leftover removed, and no new one
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handlers are back


GENERATION = dict(s=0.0, tokens="20k", val_tokens="5k", shard_tokens="10k")


@pytest.mark.heavy
def test_a_killed_generations_directory_is_removed_by_the_next_and_a_live_one_is_waited_for(tmp_path, monkeypatch):
    out = tmp_path / "data"
    with generating(out, tmp_path / "killed", **GENERATION) as killed:
        (left,) = tmp_path.glob(f".data.*{TEMPORARY_SUFFIX}")  # the killed generation's, its first shard in it
        assert (left / "train_000000.bin").is_file()
        killed.kill()
        killed.wait()
    with generating(out, tmp_path / "live", **GENERATION) as live:
        (busy,) = tmp_path.glob(f".data.*{TEMPORARY_SUFFIX}")  # the live generation's
        assert busy != left and not left.exists()  # the killed one's removed, under the generation lock
        shards = wait_for_it(monkeypatch, live, busy)
        stats = generate_pcfg_dataset(out, progress=False, **GENERATION)  # waits for the live one
        assert live.wait(timeout=120) == 0  # (it finished undisturbed)
    assert stats == json.loads((out / "stats.json").read_text()) and shards == []  # its dataset, not a second
    assert sorted(p.name for p in out.iterdir()) == [
        "grammar.json",
        "stats.json",
        "train_000000.bin",
        "train_000001.bin",
        "val_000000.bin",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".data.lock", "data", "killed", "live"]


# -- nothing destroyed: what a run's folder holds that is not the run's own (issue 48) -----------------

runner = CliRunner()


def _copy_run(reference: Path, to: Path, upto: int | None = None) -> Path:
    """A copy of the run ``reference``; with ``upto``, cut back to its checkpoints up to that step (a run
    that resumes from there)."""
    shutil.copytree(reference, to)
    if upto is not None:
        index = read_index(to)
        for entry in index:
            if entry["step"] > upto:
                (to / entry["path"]).unlink()
        (to / "index.json").write_text(json.dumps([e for e in index if e["step"] <= upto]))
    return to


def _digests(folder: Path) -> dict[str, str | None]:
    """Each entry of ``folder`` by name: its content's digest, or where it points for a link."""
    return {p.name: f"-> {os.readlink(p)}" if p.is_symlink() else path_digest(p) for p in folder.iterdir()}


def _error_line(r) -> str:
    """The one line of a command that failed as curvlab's errors do."""
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.output
    return lines[0]


@pytest.mark.parametrize(
    "kind, what",
    [("symlink", "a symbolic link"), ("hard-link", "a hard link to a file with content"),
     ("directory", "not a regular file")],
)  # fmt: skip
def test_a_lock_file_that_is_no_plain_file_is_refused_by_train_and_compare_and_nothing_changes(
    pcfg_data, reference, tmp_path, kind, what
):
    run, victim = _copy_run(reference, tmp_path / "run"), tmp_path / "victim.txt"
    victim.write_text("keep me\n")  # (filelock 3.x opens a lock file with O_TRUNC, following a link)
    lock = run / LOCK_FILE
    lock.unlink()
    if kind == "symlink":
        lock.symlink_to(victim)
    elif kind == "hard-link":
        os.link(victim, lock)
    else:
        lock.mkdir()
    before, kept = _digests(run), path_digest(victim)
    compare = ["compare", str(run), str(run), "--out", str(tmp_path / "cmp"), "--quiet"]  # (a reader)
    for args in (_train_args(pcfg_data, run), compare):
        assert _error_line(runner.invoke(app, args)) == (
            f"error: {lock}: is {what}, where curvlab keeps its lock file: refused (remove it, if it is yours)"
        )
    assert _digests(run) == before and path_digest(victim) == kept and not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("kind", ["run-without-index", "another-config", "hugging-face-checkpoint", "someones-files"])
def test_train_over_a_folder_that_holds_no_run_of_its_own_is_refused_and_nothing_changes(
    pcfg_data, reference, tmp_path, request, kind
):
    out = tmp_path / "out"
    if kind == "run-without-index":
        _copy_run(reference, out)
        (out / "index.json").unlink()
        expected = (
            "holds a run's files (ckpt_000000.pt, ckpt_000002.pt, ckpt_000004.pt and 2 more) with no checkpoint "
            "listed in index.json; refusing to begin a run over them (restore its index, or choose another --out)"
        )
    elif kind == "another-config":
        out.mkdir()
        (out / "config.json").write_text(json.dumps({**json.loads((reference / "config.json").read_text()), "seed": 7}))
        expected = "holds a run with another config; refusing to resume (seed: 7 -> 0)"
    elif kind == "hugging-face-checkpoint":
        shutil.copytree(request.getfixturevalue("trainer_checkpoint")[0], out)
        expected = "holds files curvlab didn't write ("  # (its weights, optimizer state...: by transformers' names)
    else:
        (out / "photos").mkdir(parents=True)
        (out / "notes.txt").write_text("mine")
        expected = "holds files curvlab didn't write (notes.txt, photos); refusing to begin a run there (choose a new " \
            "or empty --out)"  # fmt: skip
    before = _digests(out)
    line = _error_line(runner.invoke(app, _train_args(pcfg_data, out)))
    assert line.startswith(f"error: {out}: {expected}" if kind != "another-config" else f"error: {out} {expected}")
    after = _digests(out)
    assert {name: after.get(name) for name in before} == before  # (a Hugging Face config.json included)
    assert set(after) - set(before) == ({LOCK_FILE} if kind == "another-config" else set())  # (refused unlocked)


AT_STEP_3 = """
import sys
from curvlab.data.shards import TrainBatches
real, calls = TrainBatches.next, []
def next_batch(self):  # the batch of step 3 (checkpoint 2 is written): say so, and wait to be let go
    calls.append(1)
    if len(calls) == 3:
        print("at step 3", flush=True)
        sys.stdin.readline()
    return real(self)
TrainBatches.next = next_batch
"""


@pytest.mark.heavy
def test_a_trainer_whose_lock_file_was_removed_stops_in_one_line_when_another_takes_the_run_over(
    pcfg_data, reference, tmp_path, monkeypatch
):
    out, said = tmp_path / "run", []
    with subprocess.Popen(
        _command(_train_args(pcfg_data, out), AT_STEP_3), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env=_env(),
    ) as first:  # fmt: skip
        try:
            assert first.stdout.readline() == "at step 3\n"
            (out / LOCK_FILE).unlink()  # by hand: the first holds the lock of a file that is gone
            real = TrainBatches.next

            def next_batch(self):  # the second's first step: the first goes on, and finds out taken over
                if not said:
                    said.append(first.communicate("go\n", timeout=300)[1])
                return real(self)

            monkeypatch.setattr(TrainBatches, "next", next_batch)
            assert _resume(out).resumed_from == EVERY  # the second, in this process
        finally:
            if first.poll() is None:
                first.kill()
    assert first.returncode == 2, said
    (line,) = said[0].splitlines()
    assert line.startswith(
        f"error: {out}: no longer held by this process: its owner record names process {os.getpid()}"
    )
    assert line.endswith("(its lock file was removed or replaced while this one held it); stopped after step 3, writing "
                         "nothing more there")  # fmt: skip
    _assert_same_final_state(out, reference)  # the first wrote nothing after step 2: no row lost or doubled


FULL_DISK_AT_METRICS = """
import errno, os, types
from curvlab.runs import train
def full(fd, data):  # the disk is full when the first row of metrics.jsonl is appended
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
train.os = types.SimpleNamespace(**{**vars(os), "write": full})  # (os.write: the rows' writes, and only theirs)
"""


@pytest.mark.heavy
def test_a_full_disk_at_the_first_metrics_row_is_one_line_and_the_run_resumes(pcfg_data, reference, tmp_path):
    out = tmp_path / "run"
    r = _curvlab(_train_args(pcfg_data, out), before=FULL_DISK_AT_METRICS)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [f"error: {out / 'metrics.jsonl'}: can't write (No space left on device)"]
    assert (out / "metrics.jsonl").read_bytes() == b"" and [e["step"] for e in read_index(out)] == [0]
    assert _resume(out).resumed_from == 0
    _assert_same_final_state(out, reference)


@pytest.mark.parametrize(
    "name, line, byte, expected",
    [("config.json", 1, b"\xff", "corrupt JSON in training config ("),
     ("metrics.jsonl", 3, b"\xff", "line 3 is corrupt (no JSON record with a step); refused"),
     ("metrics.jsonl", 3, b"#", "line 3 is corrupt (no JSON record with a step); refused")],
    ids=["config-not-utf8", "metrics-not-utf8", "metrics-not-json"],
)  # fmt: skip
def test_a_corrupt_byte_in_a_runs_config_or_metrics_is_refused_by_name_and_nothing_changes(
    pcfg_data, reference, tmp_path, name, line, byte, expected
):
    run = _copy_run(reference, tmp_path / "run", upto=4)  # (a resume rewrites the metrics after step 4)
    lines = (run / name).read_bytes().split(b"\n")
    lines[line - 1] = byte + lines[line - 1][1:]
    (run / name).write_bytes(b"\n".join(lines))
    before = _digests(run)
    assert _error_line(runner.invoke(app, _train_args(pcfg_data, run))).startswith(f"error: {run / name}: {expected}")
    assert _digests(run) == before  # (before, rows 3-4 were dropped, and the resume from 4 doesn't retake them)
    if name == "metrics.jsonl":
        with pytest.raises(CurvlabError, match=re.escape(expected)):
            read_metrics(run)  # (readers refuse it too)


def test_a_metrics_line_cut_by_a_crash_still_ends_the_file(reference, tmp_path):
    run = _copy_run(reference, tmp_path / "run", upto=4)  # (a crash cuts a row after the last checkpoint)
    text = (run / "metrics.jsonl").read_bytes()
    (run / "metrics.jsonl").write_bytes(text[: len(text) - 20])  # the last row, cut short: no newline after it
    rows = [json.loads(r) for r in text.splitlines()[:-1]]
    assert read_metrics(run) == [{k: v for k, v in r.items() if k != "row_digest"} for r in rows]


@pytest.mark.parametrize("name", ["metrics.jsonl", "index.json"])
def test_a_run_never_writes_through_a_link_out_of_its_folder(pcfg_data, reference, tmp_path, name):
    run, outside = _copy_run(reference, tmp_path / "run", upto=4), tmp_path / "outside"
    outside.mkdir()
    if name == "index.json":  # the link's target: the run's own index, elsewhere (its read is no write)
        (outside / name).write_text((run / name).read_text())
    (run / name).unlink()
    (run / name).symlink_to(outside / name)  # (metrics: to a file that doesn't exist yet)
    before = _digests(outside)
    why = "a run's metrics are a file of its own" if name == "metrics.jsonl" else "curvlab replaces files, never a link"
    assert _error_line(runner.invoke(app, _train_args(pcfg_data, run))) == (
        f"error: {run / name}: is a symbolic link: refused ({why}; remove it)"
    )
    assert _digests(outside) == before and (run / name).is_symlink()


def test_inside_a_run_a_write_whose_folder_is_a_link_out_of_it_is_refused(reference, tmp_path):
    run, outside = _copy_run(reference, tmp_path / "run"), tmp_path / "outside"
    outside.mkdir()
    (run / "ckpt_000008").symlink_to(outside, target_is_directory=True)  # (a sharded checkpoint's folder)
    with writes_confined_to(run):
        with pytest.raises(CurvlabError) as e:
            atomic_write_json(run / "ckpt_000008" / "meta.json", {})
        atomic_write_json(run / "ckpt_000010" / "meta.json", {})  # a folder inside it: made, and written
    assert str(e.value) == f"{run / 'ckpt_000008' / 'meta.json'}: its folder leads out of {run} (a symbolic link on " \
        "the way): refused"  # fmt: skip
    assert list(outside.iterdir()) == [] and json.loads((run / "ckpt_000010" / "meta.json").read_text()) == {}


def test_a_run_killed_between_its_first_checkpoint_and_its_index_starts_again(pcfg_data, reference, tmp_path):
    """The step-0 checkpoint written and the process killed before it was listed: the same command begins the
    run again (that checkpoint is made anew) and ends as an uninterrupted run; another config is still refused."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("config.json", "ckpt_000000.pt"):
        shutil.copy(reference / name, out / name)
    r = runner.invoke(app, _train_args(pcfg_data, out))
    assert r.exit_code == 0, r.output
    _assert_same_final_state(out, reference)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(reference / "ckpt_000000.pt", other / "ckpt_000000.pt")
    (other / "config.json").write_text(json.dumps({**json.loads((reference / "config.json").read_text()), "seed": 7}))
    assert "holds a run with another config" in _error_line(runner.invoke(app, _train_args(pcfg_data, other)))
