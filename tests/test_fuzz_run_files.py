"""Seeded mutations of every JSON file a reproduction's directory holds, each read back by the reader the
command line uses for it (in this process): truncations, byte flips, a value swapped for one of another
type, deep nesting, huge numbers (1e999, a 5000-digit integer) and NaN.

Each mutation must end in a one-line :class:`~curvlab.errors.CurvlabError` or a recomputation (a derived
file: a cached report, the quadratic study), never in another exception (a traceback), and never in a
silently different number: a reader that accepts a mutated file must return what it returns for the
original. ``compare.json`` and ``track.json`` are outputs that no curvlab reader reads back (nothing to
fuzz); ``curvlab.owner.json`` only names a holder (:func:`curvlab.util.lock.read_owner`, which decides
nothing).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from curvlab.analysis.report import cached_report, load_report, report_cache_path
from curvlab.analysis.targets import AnalysisSettings
from curvlab.data.dataset import unigram_plateau_nats
from curvlab.data.pcfg import Grammar
from curvlab.errors import CurvlabError
from curvlab.jobs import finetune as finetune_module
from curvlab.jobs.finetune import Finetune
from curvlab.jobs.job import read_invocations
from curvlab.jobs.presets import PRESETS, with_preset
from curvlab.jobs.reproduce import Reproduction, make_data
from curvlab.output import plots
from curvlab.output.files import read_quadratic
from curvlab.runs.adapt import adapt
from curvlab.runs.checkpoint import read_index
from curvlab.runs.config import TrainConfig
from curvlab.runs.match import run_checkpoints
from curvlab.runs.metrics import read_metrics
from curvlab.runs.train import check_resume
from curvlab.studies.adapters import FinetuneResult
from curvlab.studies.records import LevelData
from curvlab.studies.summary import Summary
from curvlab.studies.tuning import TuningRecord
from curvlab.util import schema
from curvlab.util.digest import path_digest

MUTATIONS = 1200  # over all the files, at least 1000 (the count)
RECOMPUTED = "recomputed"  # what a reader of a derived file returns when it would recompute it


class _Recompute(Exception):
    """Raised by the stand-in analysis: the cache would recompute the report here."""


@dataclass(frozen=True)
class Target:
    """One file of the run directory (``file``, relative to it) and a reader the command line uses,
    ``read(path)``: a plain value to compare with the original's, :data:`RECOMPUTED`, or a ``CurvlabError``."""

    file: str
    read: Callable[[Path], Any]
    reader: str = ""  # which reader, where a file has several

    @property
    def name(self) -> str:
        return f"{self.file} ({self.reader})" if self.reader else self.file


@pytest.fixture(scope="module")
def reproduction(tmp_path_factory):
    """A real reproduction, the smallest there is: the micro preset at one s, with two seeds and two arms,
    then a one-seed micro fine-tuning of its first AdamW run. Its figures are left out (no JSON, and most
    of its time)."""
    out = tmp_path_factory.mktemp("fuzz") / "results"
    preset = PRESETS["micro"].changed(seeds=2, s_values=(0.0,), arms=("adamw", "muon"), finetune=None)
    fine = with_preset("micro", seeds=1)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(plots, "reproduction_figures", lambda *args, **kwargs: {})
        m.setattr(finetune_module.plots, "finetune_ratios", lambda *args, **kwargs: [])
        Reproduction(preset, out, progress=False).run()
        Finetune(fine, out / "finetune", base=out / "runs/s0/adamw/seed0", progress=False).run()
    return out, preset, fine


def _plain(value: Any) -> Any:
    """``value`` as plain JSON-able data, for comparing what two reads returned."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def canonical(value: Any) -> str:
    """One text per value (NaN equals NaN here, and a key's order is no difference)."""
    return json.dumps(_plain(value), sort_keys=True, default=repr)


def _cached_entry(out: Path) -> tuple[Path, Path, AnalysisSettings]:
    """A report of the cache whose checkpoint is still there (the others are recomputed whatever their
    content), its checkpoint and settings."""
    for path in sorted((out / "analysis" / "reports").glob("*.json")):
        d = json.loads(path.read_text())
        checkpoint, settings = Path(d["checkpoint"]), AnalysisSettings(**d["settings"])
        if checkpoint.is_file() and d["digests"]["checkpoint"] == path_digest(checkpoint):
            assert report_cache_path(out / "analysis" / "reports", checkpoint, settings) == path
            return path, checkpoint, settings
    raise AssertionError("no cached report of a checkpoint that is kept")


def _stand_in(*args, **kwargs):
    raise _Recompute


def targets(out: Path, preset, fine) -> list[Target]:
    """Every JSON file kind of the reproduction in ``out``, with the reader the command line uses."""
    job = Reproduction(preset, out, progress=False)
    tuner = Finetune(fine, out / "finetune", base=out / "runs/s0/adamw/seed0", progress=False)
    report, checkpoint, settings = _cached_entry(out)
    adapted = out / "finetune/runs/adamw/seed0"
    adapted_cfg = TrainConfig.from_dict(json.loads((adapted / "config.json").read_text()))
    run = out / "runs/s0/adamw/seed0"
    run_cfg = TrainConfig.from_dict(json.loads((run / "config.json").read_text()))

    def cached(_):
        try:
            return cached_report(out / "analysis" / "reports", checkpoint, settings, analyze_fn=_stand_in)
        except _Recompute:
            return RECOMPUTED

    def quadratic(path):
        try:  # (side_studies.quadratic recomputes the study on a CurvlabError, or on None)
            return read_quadratic(path) or RECOMPUTED
        except CurvlabError:
            return RECOMPUTED

    def finished(path):  # a finished adaptation run is read, not run again: its final validation loss
        return adapt(adapted_cfg, out / "runs/s0/adamw/seed0", fine.rank, fine.heldout_windows, progress=False)

    def resumed(path):  # compare and track read the schedule; a resume checks the config
        check_resume(run, run_cfg)
        return run_checkpoints(run)

    def data(path):
        make_data(job, job.preset)
        return unigram_plateau_nats(out / "data/s0"), tuner.prepare()

    return [
        Target("summary.json", Summary.load),
        Target("analysis/levels.json", LevelData.load),
        Target("analysis/seed0.json", LevelData.load),
        Target("tuning.json", lambda path: job.saved_tuning()),
        Target("timing.json", read_invocations),
        Target("reproduce.json", lambda path: job._check_config()),
        Target("quadratic/quadratic.json", quadratic),
        Target(str(report.relative_to(out)), cached),
        Target(str(report.relative_to(out)), load_report, "load_report"),
        Target("finetune/finetune.json", FinetuneResult.load),
        Target("finetune/finetune-config.json", lambda path: tuner._check_config()),
        Target("finetune/tuning.json", lambda path: schema.load(path, TuningRecord)),
        Target("finetune/timing.json", read_invocations),
        Target("finetune/runs/adamw/seed0/adapter.json", finished),
        Target("finetune/runs/adamw/seed0/config.json", finished),
        Target("runs/s0/adamw/seed0/config.json", resumed),
        Target("runs/s0/adamw/seed0/index.json", lambda path: read_index(path.parent)),
        Target("runs/s0/adamw/seed0/metrics.jsonl", lambda path: read_metrics(path.parent)),
        Target("data/s0/stats.json", data),
        Target("data/s0/grammar.json", Grammar.load),
    ]


# -- mutations -----------------------------------------------------------------------------------------

SWAPS = ['"x"', "0", "-1", "1.5", "true", "null", "[]", "{}", '[1, "a"]', '{"k": 1}']
HUGE = ["1e999", "-1e999", "9" * 5000, "1e308", "-0.0"]
NOT_A_NUMBER = ["NaN", "Infinity", "-Infinity"]
SENTINEL = "\u0000curvlab-fuzz\u0000"


def _nodes(value: Any, at: tuple = ()) -> list[tuple]:
    """Every place in a JSON value (keys of objects, indices of arrays), the value itself first."""
    places = [at]
    if isinstance(value, dict):
        for k, v in value.items():
            places += _nodes(v, (*at, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            places += _nodes(v, (*at, i))
    return places


def _with(value: Any, at: tuple, text: str) -> str:
    """The JSON text of ``value`` with the node at ``at`` replaced by the JSON text ``text``."""
    if not at:
        return text
    value = copy.deepcopy(value)
    node = value
    for key in at[:-1]:
        node = node[key]
    node[at[-1]] = SENTINEL
    return json.dumps(value, indent=1, allow_nan=True).replace(json.dumps(SENTINEL), text)


def _structural(rng: random.Random, text: str, kind: str) -> str:
    """``text`` (one JSON value) with one node replaced, as ``kind`` says."""
    value = json.loads(text)
    at = rng.choice(_nodes(value))
    if kind == "type swap":
        replacement = rng.choice(SWAPS)
    elif kind == "deep nesting":
        depth = rng.choice([200, 5000, 100000])
        replacement = "[" * depth + "]" * depth
    elif kind == "huge number":
        replacement = rng.choice(HUGE)
    else:
        replacement = rng.choice(NOT_A_NUMBER)
    return _with(value, at, replacement)


KINDS = ["truncation", "byte flip", "type swap", "deep nesting", "huge number", "NaN"]


def mutate(rng: random.Random, data: bytes, kind: str, lines: bool) -> bytes:
    """``data`` (a file's bytes; ``lines``: JSON lines) mutated once, as ``kind`` says."""
    if kind == "truncation":
        return data[: rng.randrange(len(data))]
    if kind == "byte flip":
        flipped = bytearray(data)
        flipped[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(flipped)
    if not lines:
        return _structural(rng, data.decode(), kind).encode()
    rows = data.decode().split("\n")
    k = rng.randrange(len(rows) - 1)  # (the last is the empty text after the final newline)
    rows[k] = _structural(rng, rows[k], kind).replace("\n", "")
    return "\n".join(rows).encode()


def _curvlab_frame(error: BaseException) -> str:
    """Where in curvlab ``error`` was raised (its innermost frame in the package): file and line."""
    where, frame = error.__traceback__, "?"
    while where is not None:
        name = where.tb_frame.f_code.co_filename
        if f"{os.sep}curvlab{os.sep}" in name:
            frame = f"{name[name.rindex(f'{os.sep}curvlab{os.sep}') + 1 :]}:{where.tb_lineno}"
        where = where.tb_next
    return frame


def outcome(target: Target, out: Path, original: str) -> tuple[str, str | None]:
    """What a read of the (mutated) file did: ``"refused"`` (in one line), ``"recomputed"``, ``"read"``
    (the original's value) or ``"failed"``, and the problem of a failure."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (a stale cache's note: the recomputation is the outcome)
            value = target.read(out / target.file)
    except CurvlabError as e:
        return ("refused", None) if "\n" not in str(e) else ("failed", f"a refusal of several lines: {str(e)[:200]!r}")
    except Exception as e:  # (the failure this test is for: any other exception is a traceback)
        return "failed", f"traceback: {type(e).__name__}: {str(e)[:160]} (at {_curvlab_frame(e)})"
    if value == RECOMPUTED:
        return "recomputed", None
    return ("read", None) if canonical(value) == original else ("failed", "a silently different value")


@pytest.mark.heavy  # (a reproduction, though the smallest)
def test_mutated_run_files_are_refused_in_one_line_or_recomputed_never_misread(reproduction):
    out, preset, fine = reproduction
    chosen = targets(out, preset, fine)
    originals = {t.name: canonical(t.read(out / t.file)) for t in chosen}
    assert canonical(RECOMPUTED) not in originals.values()  # every original is read as it is
    rng = random.Random(48)
    per_target = math.ceil(MUTATIONS / len(chosen))
    failures: dict[str, list[str]] = {}
    counts = {t.name: dict.fromkeys(("refused", "recomputed", "read", "failed"), 0) for t in chosen}
    for target in chosen:
        path = out / target.file
        data = path.read_bytes()
        try:
            for n in range(per_target):
                kind = KINDS[n % len(KINDS)]
                path.write_bytes(mutate(rng, data, kind, lines=path.suffix == ".jsonl"))
                result, problem = outcome(target, out, originals[target.name])
                counts[target.name][result] += 1
                if problem is not None:
                    failures.setdefault(target.name, []).append(f"{kind}: {problem}")
        finally:
            path.write_bytes(data)
    assert per_target * len(chosen) >= 1000
    for name, count in counts.items():  # every reader refused (or recomputed) some: none reads past its file
        assert count["refused"] + count["recomputed"] > 0, (name, count)
    assert not failures, json.dumps({name: problems[:3] for name, problems in failures.items()}, indent=1)
