"""A resumable job in one output directory: what ``curvlab reproduce`` and ``curvlab finetune`` share.

* :class:`Job`: the base of both jobs (:class:`curvlab.jobs.reproduce.Reproduction`,
  :class:`curvlab.jobs.finetune.Finetune`): the output directory and its config guard, the stage clock
  and the invocation times, progress lines, and the learning-rate tuning machinery, with one
  short-run objective and one policy for a run that diverges (:meth:`Job._tuning_loss`). A job's
  ``run`` owns its output directory: a second process on it is refused (:mod:`curvlab.util.lock`).
* :func:`guard_config`: the directory belongs to one configuration; a re-run with the same one
  continues it, any other is refused (results of two configurations are never mixed).
* :class:`StageClock`: wall and CPU seconds per stage, and the machine's load at the end of each.
* :func:`record_invocation`: every invocation's times in ``timing.json`` (sealed: :mod:`curvlab.util.schema`),
  an interrupted one's too (a stop by a signal, or a failure): the job's times are their sums (a re-run
  that finds everything done must not report the job as taking seconds), under the conditions (load,
  threads) of the invocation that did the most work.

Paths are stored resolved (a job's ``out`` is), and a path a saved configuration names is compared
resolved (``PATH_KEYS``), so that a directory's identity does not depend on how ``--out`` was spelled.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from curvlab.errors import CurvlabError
from curvlab.runs.checkpoint import read_index
from curvlab.runs.train import TrainingDiverged
from curvlab.studies.tuning import LrSearch, TuningRecord, TuningSettings, search_lr
from curvlab.util import schema
from curvlab.util.atomic import atomic_write_json, atomic_write_text, remove_stale_temporaries
from curvlab.util.codec import Record
from curvlab.util.lock import own_directory
from curvlab.util.paths import same_path
from curvlab.util.safe_stop import check_stop, stop_at_safe_points

CONDITIONS = ("load", "threads", "cpus")


CONFIG_VERSION = 2  # 2: presets embed their tuning and matching settings
# fields an older curvlab wrote into a job's config and has since removed, none of which changed a result
# (n_boot: the replicates of a bootstrap the seed-level t intervals replaced): a directory whose config
# holds them continues, as one written without them
RETIRED_FIELDS = frozenset({"n_boot"})
# fields added to a job's config since, with the value that does what a config without them did (factorial:
# the mechanism design's factorial of filters and maps, off in every other design; track_points: every
# tracked checkpoint analysed)
ADDED_FIELDS = {"factorial": False, "track_points": "all", "gauss_newton": False}  # (issue 50, 52)
ADDED_FIELDS |= {"corpus": None, "corpus_vocab": 1024, "corpus_val_fraction": 0.05}  # (issue 53)


def _without_retired(config: Any) -> Any:
    """``config`` without :data:`RETIRED_FIELDS`, at any depth of its dicts and lists."""
    if isinstance(config, dict):
        return {k: _without_retired(v) for k, v in config.items() if k not in RETIRED_FIELDS}
    if isinstance(config, list):
        return [_without_retired(v) for v in config]
    return config


def _with_added(saved: Any, config: Any) -> Any:
    """``saved`` with each field of :data:`ADDED_FIELDS` that ``config`` has and it lacks, at its value, at any
    depth of their dicts."""
    if not (isinstance(saved, dict) and isinstance(config, dict)):
        return saved
    added = {k: v for k, v in ADDED_FIELDS.items() if k in config and k not in saved}
    return {**{k: _with_added(v, config.get(k)) for k, v in saved.items()}, **added}


def _same_config(saved: dict[str, Any], config: dict[str, Any], path_keys: tuple[str, ...]) -> bool:
    """Whether ``saved`` is ``config``, the paths under ``path_keys`` compared as the places they name (a
    relative one, as an older curvlab saved it, against the working directory)."""
    return set(saved) == set(config) and all(
        same_path(saved[k], config[k]) if k in path_keys else saved[k] == config[k] for k in config
    )


def guard_config(path: Path, config: dict[str, Any], what: str, path_keys: tuple[str, ...] = ()) -> None:
    """Write ``config`` (with ``config_version``: :data:`CONFIG_VERSION`) to ``path`` on the first run;
    refuse a later run whose config differs (a saved field of :data:`RETIRED_FIELDS` is no difference, nor
    is a missing one of :data:`ADDED_FIELDS` at its value; the paths under ``path_keys`` are compared resolved).

    Raises:
        CurvlabError: the directory holds ``what`` of another configuration, or one that an older
            curvlab wrote in another form (another ``config_version``), or its saved configuration is
            corrupt.
    """
    config = json.loads(json.dumps({**config, "config_version": CONFIG_VERSION}))  # as it reads back
    if path.is_file():
        saved = schema.read_json_object(path, "a job's configuration")
        if saved.get("config_version") != CONFIG_VERSION:
            raise CurvlabError(
                f"{path.parent} holds {what} written by another curvlab version (config version "
                f"{saved.get('config_version', 1)}, this one writes {CONFIG_VERSION}): choose a fresh --out"
            )
        if not _same_config(_with_added(_without_retired(saved), config), config, path_keys):
            raise CurvlabError(
                f"{path.parent} holds {what} of another configuration; refusing to mix them: choose a fresh --out"
            )
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(config, indent=1))


class StageClock:
    """Wall seconds per stage under ``name`` and this process's CPU seconds under ``name_cpu`` (on a
    shared machine wall time inflates with the load, CPU time much less), from construction on."""

    def __init__(self):
        self.timing: dict[str, float] = {}
        self.loads: list[float] = []  # the 1-minute load average at the end of each stage
        self._start, self._cpu = time.perf_counter(), time.process_time()

    @contextlib.contextmanager
    def __call__(self, name: str):
        start, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.timing[name] = self.timing.get(name, 0.0) + time.perf_counter() - start
            self.timing[f"{name}_cpu"] = self.timing.get(f"{name}_cpu", 0.0) + time.process_time() - cpu
            self.loads.append(os.getloadavg()[0])

    def invocation(self) -> dict[str, float]:
        """This invocation's times so far, with its total and conditions."""
        return {
            **self.timing,
            "total": time.perf_counter() - self._start,
            "total_cpu": time.process_time() - self._cpu,
            "load": float(np.mean(self.loads)) if self.loads else float(os.getloadavg()[0]),
            "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(),
        }


@dataclass(frozen=True)
class Invocations(Record):
    """Every invocation's times (``timing.json``): stage -> seconds, with ``total`` and the conditions."""

    invocations: list[dict[str, float]]
    SCHEMA_VERSION: ClassVar[int] = 1
    WHAT: ClassVar[str] = "timing.json"


def read_invocations(path: Path) -> list[dict[str, float]]:
    """The invocations recorded in ``path`` (none without the file). A bare list is the form curvlab 0.2.0
    wrote (unsealed then): read as it is, each entry checked, and sealed at the next record.

    Raises:
        CurvlabError: a damaged, edited or unsealed file: the job's earlier times can't be trusted, and the
            message says how to go on without them.
    """
    if not path.is_file():
        return []
    try:
        legacy = schema.read_json(path, "a job's timing")
        if isinstance(legacy, list):
            return [_legacy_invocation(path, entry) for entry in legacy]
        return schema.load(path, Invocations).invocations
    except CurvlabError as e:
        raise CurvlabError(f"{e}; delete it to go on (the invocations it held are then not counted)") from None


def _legacy_invocation(path: Path, entry: Any) -> dict[str, float]:
    """One entry of a 0.2.0 ``timing.json``: seconds by stage and the conditions, every one a finite number."""
    if not isinstance(entry, dict) or "total" not in entry:
        raise CurvlabError(f"{path}: corrupt timing.json (an invocation is no object with a total)")
    for key, value in entry.items():
        if type(value) not in (int, float) or not math.isfinite(value):
            raise CurvlabError(f"{path}: corrupt timing.json ({key} {value!r:.40} is no finite number)")
    return entry


def record_invocation(path: Path, invocation: dict[str, float]) -> dict[str, float]:
    """Append ``invocation`` to those in ``path`` (``timing.json``) and return the job's times: every
    stage summed over the invocations, the conditions of the longest one, and their count."""
    invocations = [*read_invocations(path), invocation]
    schema.save(path, Invocations(invocations))
    keys = {k for i in invocations for k in i if k not in CONDITIONS}
    timing = {k: sum(i.get(k, 0.0) for i in invocations) for k in sorted(keys)}
    longest = max(invocations, key=lambda i: i["total"])
    timing.update({k: float(longest[k]) for k in CONDITIONS if k in longest})
    timing["invocations"] = len(invocations)
    return timing


DIVERGED = "diverged.json"  # in a tuning run that diverged: a re-run scores it +inf without training it again


def _owning(run):
    """``run`` (a job's), holding the job's output directory from its first step to its last
    (:func:`curvlab.util.lock.own_directory`): a second process on the same ``out`` is refused."""

    @functools.wraps(run)
    def owned(self, *args, **kwargs):
        with own_directory(self.out, self.TAG) as previous:
            if previous is not None:
                self.say(f"took {self.out} over from {previous.describe()}, which is no longer running")
            try:
                return run(self, *args, **kwargs)
            except BaseException:  # (a stop by a signal, or a failure: its time was spent all the same)
                self._record_unfinished()
                raise

    return owned


class Job:
    """One job in one output directory ``out``: a subclass names its progress tag (``TAG``), its config
    file (``CONFIG_FILE``) and what its results are (``WHAT``), and gives its configuration
    (:meth:`config`), its tuning settings (:meth:`tuning_settings`) and one short training run
    (:meth:`_short_run`). The base keeps the rest: the guard that one directory holds one
    configuration, the stage clock, the invocation times (``timing.json``), progress lines, and the
    learning-rate searches on the short-run objective (:meth:`_tuning_loss`, :meth:`_search`).

    A subclass's ``run`` holds ``out`` for its whole length, one owner per directory: another process
    (or thread) running a job there is refused, naming the owner (:func:`curvlab.util.lock.own_directory`).
    """

    TAG: ClassVar[str] = "job"
    CONFIG_FILE: ClassVar[str] = "job.json"
    WHAT: ClassVar[str] = "a job"
    PATH_KEYS: ClassVar[tuple[str, ...]] = ()  # the keys of config() that hold paths (compared resolved)

    def __init_subclass__(cls, **kwargs):
        # wrapped here, for every subclass that defines ``run``, so that no job can forget to own its out
        super().__init_subclass__(**kwargs)
        if "run" in cls.__dict__:
            cls.run = _owning(cls.__dict__["run"])

    def __init__(self, out: str | Path, progress: bool = True):
        # resolved: every path the job stores (a run's data, a base run) is then the same however --out
        # was spelled (relative, absolute, through a link)
        self.out, self.progress = Path(out).resolve(), progress
        self.log: list[str] = []
        self.clock = StageClock()
        self._unrecorded = False  # an invocation started whose times are not in timing.json yet

    # -- what a subclass gives ----------------------------------------------------------------

    def config(self) -> dict[str, Any]:
        """Everything the directory's results depend on (JSON-able)."""
        raise NotImplementedError

    def tuning_settings(self) -> TuningSettings:
        raise NotImplementedError

    def _short_run(self, data: Path, run: Path, arm: str, options: dict[str, float], seed: int, steps: int) -> float:
        """Train one tuning run of ``steps`` steps into ``run``; its final validation loss. May raise
        :class:`~curvlab.runs.train.TrainingDiverged`."""
        raise NotImplementedError

    # -- bookkeeping ----------------------------------------------------------------------------

    def what(self) -> str:
        """What the directory holds, for the guard's message."""
        return self.WHAT

    def _check_config(self) -> None:
        guard_config(self.out / self.CONFIG_FILE, self.config(), self.what(), self.PATH_KEYS)

    def say(self, message: str) -> None:
        self.log.append(message)
        if self.progress:
            print(f"[{self.TAG}] {message}", flush=True)

    def start(self) -> None:
        """A fresh invocation: its clock starts, the directory's configuration is checked, and then
        (the directory is this job's) what killed writes left there is removed
        (:func:`~curvlab.util.atomic.remove_stale_temporaries`, everywhere below ``out``: only curvlab's
        temporaries are named so) and ``timing.json`` is read (a damaged one is refused now, not once
        the work is done)."""
        self.clock = StageClock()
        self._check_config()
        remove_stale_temporaries(self.out, recursive=True)
        read_invocations(self.timing_path)
        self._unrecorded = True

    def safe_point(self, done: str) -> None:
        """Stop here if a SIGINT or SIGTERM asked to (:mod:`curvlab.util.safe_stop`): ``done`` is saved,
        and a re-run continues from it."""
        check_stop(f"after {done} in {self.out}: run the same command again to continue")

    @property
    def timing_path(self) -> Path:
        return self.out / "timing.json"

    def timing(self) -> dict[str, float]:
        """Record this invocation's times in ``timing.json``; the job's, over every invocation."""
        self._unrecorded = False
        return record_invocation(self.timing_path, self.clock.invocation())

    def _record_unfinished(self) -> None:
        """Record the times of an invocation that stopped before :meth:`timing` (a signal, a failure), so
        that the invocation that finishes the job counts them; nothing before :meth:`start` passed."""
        if self._unrecorded:
            self._unrecorded = False
            record_invocation(self.timing_path, self.clock.invocation())

    # -- tuning -------------------------------------------------------------------------------

    @property
    def tuning_path(self) -> Path:
        return self.out / "tuning.json"

    def saved_tuning(self) -> TuningRecord | None:
        """The tuning a previous invocation finished (``tuning.json``), or ``None``."""
        return schema.load(self.tuning_path, TuningRecord) if self.tuning_path.is_file() else None

    def save_tuning(self, record: TuningRecord) -> TuningRecord:
        schema.save(self.tuning_path, record)
        return record

    def _tuning_loss(self, data: Path, arm: str, options: dict[str, float], seed: int) -> float:
        """The final validation loss of one short tuning run (``runs/tune/<arm>/<options>-seed<k>``).

        A run that diverges scores +inf and leaves ``diverged.json`` (its error), so that a re-run
        scores it again without training it; a finished run is read back from its index. Either way
        its checkpoints are deleted once it is done (the index, config and metrics stay): a search
        trains many runs and keeps only their losses."""
        tag = "-".join(f"{k}{v:g}" for k, v in sorted(options.items()))
        run = self.out / "runs" / "tune" / arm / f"{tag}-seed{seed}"
        if (run / DIVERGED).is_file():
            return math.inf
        steps = self.tuning_settings().horizon_steps
        index = read_index(run)
        if index and index[-1]["step"] == steps and not (run / index[-1]["path"]).exists():
            return float(index[-1]["val_loss"])  # finished before; its checkpoints were cleaned up
        try:
            loss = self._short_run(data, run, arm, options, seed, steps)
        except TrainingDiverged as e:
            atomic_write_json(run / DIVERGED, {"error": str(e)})
            loss = math.inf
        for ckpt in run.glob("ckpt_*.pt"):
            ckpt.unlink()
        return loss if math.isfinite(loss) else math.inf

    def _search(
        self, data: Path, arm: str, knob: str, grid: list[float], fixed: dict, extensions: int, seeds: list[int]
    ) -> LrSearch:
        """:func:`~curvlab.studies.tuning.search_lr` of ``arm``'s option ``knob`` (the others ``fixed``) on
        :meth:`_tuning_loss`."""

        def loss(lr: float, seed: int) -> float:
            return self._tuning_loss(data, arm, {**fixed, knob: lr}, seed)

        result = search_lr(loss, grid, seeds, f"{arm}.{knob}", extensions, fixed)
        grid = ", ".join(f"{x:g}" for x in sorted(result.grid))
        self.say(f"{arm} {knob}: best {result.chosen:g} on the grid {grid}")
        return result


class Design(Job):
    """A job that runs one named design (``self.preset``, set by the subclass) through its stages (``_run``): a
    reproduction, or a design composed of reproductions (robustness, scaling, long)."""

    def what(self) -> str:
        return f"the results of preset {self.preset.name!r}"

    def run(self) -> Any:
        """The whole design. A SIGINT or SIGTERM stops it at the next safe point (after a training step, a cached
        report or a seed's analysis: :mod:`curvlab.util.safe_stop`) with a :class:`~curvlab.util.safe_stop.Stopped`;
        running it again continues from what is saved."""
        with stop_at_safe_points():
            return self._run()
