"""What a run's folder may hold when training begins or resumes there: a resume only under the config the run
began with (:func:`check_resume`), and a new run only in a folder holding nothing but its own files
(:func:`check_new_run`, :func:`check_no_foreign_files`); each refusal is one line that names what it found."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from curvlab.errors import CurvlabError
from curvlab.runs.checkpoint import INDEX, checkpoint_name, is_checkpoint_name
from curvlab.runs.config import TrainConfig, config_difference
from curvlab.runs.metrics import METRICS_FILE
from curvlab.runs.weights import key_list
from curvlab.util.atomic import temporary_of
from curvlab.util.lock import LOCK_FILE, OWNER_FILE
from curvlab.util.schema import read_json_object


def check_resume(out: Path, cfg: TrainConfig) -> None:
    """Refuse to resume the run in ``out`` under a config other than the one it was started with (the
    differences named), or with a corrupt ``config.json``."""
    diff = config_difference(_saved_config(out) or {}, cfg.to_dict())
    if diff:
        raise CurvlabError(f"{out} holds a run with another config; refusing to resume ({'; '.join(diff)})")


def _saved_config(out: Path) -> dict[str, Any] | None:
    """The config a run in ``out`` was started with (``config.json``), or ``None`` where there is none."""
    path = out / "config.json"
    if not path.is_file():
        return None
    return read_json_object(path, "training config")  # (bytes no text, huge numbers, deep nesting: one line)


# what a run's folder holds before its first checkpoint is listed in its index: the lock and owner record
# (curvlab.util.lock), the config it began with, and an adapter run's settings (curvlab.runs.adapt.ADAPTER_FILE)
BEFORE_INDEX = frozenset({LOCK_FILE, OWNER_FILE, "config.json", "adapter.json"})


def _files_not_before_index(out: Path) -> tuple[list[str], list[str]]:
    """The names in ``out`` that a run without an index doesn't hold (:data:`BEFORE_INDEX`; temporaries
    aside): a run's (checkpoints, metrics, an empty index), and the rest, which curvlab doesn't write in a run."""
    names = sorted(p.name for p in out.iterdir() if temporary_of(p) is None) if out.is_dir() else []
    runs = [n for n in names if n in (INDEX, METRICS_FILE) or is_checkpoint_name(n) or is_checkpoint_name(f"{n}.pt")]
    return runs, [n for n in names if n not in BEFORE_INDEX and n not in runs]


def check_no_foreign_files(out: Path) -> None:
    """Refuse to begin a run in ``out``, if it has no index, where it holds files curvlab doesn't write there
    (a Hugging Face checkpoint, someone's notes)."""
    foreign = [] if (out / INDEX).exists() else _files_not_before_index(out)[1]
    if foreign:
        raise CurvlabError(
            f"{out}: holds files curvlab didn't write ({key_list(foreign)}); refusing to begin a run there (choose a "
            "new or empty --out)"
        )


def check_new_run(out: Path, cfg: TrainConfig) -> None:
    """Refuse to begin the run ``cfg`` in ``out``, which has no index, over files not its own: a run whose
    index is gone, another run's config, any file curvlab doesn't write there. A run cut short before its
    first checkpoint was listed passes (under the same config: it writes that checkpoint again)."""
    runs, _ = _files_not_before_index(out)
    if runs and not (runs == [checkpoint_name(0)] and _saved_config(out) is not None):
        raise CurvlabError(
            f"{out}: holds a run's files ({key_list(runs)}) with no checkpoint listed in {INDEX}; refusing to begin a "
            "run over them (restore its index, or choose another --out)"
        )
    check_no_foreign_files(out)
    if _saved_config(out) is not None:
        check_resume(out, cfg)
