"""A run's ``metrics.jsonl``, read in one place: one JSON object a line, appended as the run trains.

Training rows (no ``kind``) record step k once step k is done: ``step`` (steps done), ``train_loss``
and, where evaluated, ``val_loss``. Monitor rows (``kind`` = ``"curvature"``, :mod:`curvlab.runs.monitor`)
are measured at step k, before the step k -> k + 1, and written once that step is taken. So a row is
*done at* its step (a training row) or its step + 1 (a monitor row), and the rows of a run resumed
from its checkpoint at step s are those done at s or before: the resumed run rewrites the rest.

A line cut by a crash ends the file: nothing after it is trusted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from curvlab.errors import CurvlabError
from curvlab.runs.monitor import ROW_KIND, MonitorRow
from curvlab.util.atomic import atomic_write_text

METRICS_FILE = "metrics.jsonl"


def done_at(record: dict[str, Any]) -> int:
    """The step after which ``record`` is written: its step, or step + 1 for a monitor row."""
    return record["step"] + (record.get("kind") == ROW_KIND)


def _lines(path: Path, upto: int | None) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
            done = done_at(record)
        except (json.JSONDecodeError, KeyError, TypeError):
            break  # a line cut by a crash: nothing after it is trusted
        if upto is None or done <= upto:
            out.append((line, record))
    return out


def read_metrics(run: str | Path, upto: int | None = None) -> list[dict[str, Any]]:
    """The records of ``RUN/metrics.jsonl`` in file order, up to a line cut by a crash; with ``upto``,
    only those done at step ``upto`` or before (see the module docstring). A run without the file has
    none."""
    path = Path(run) / METRICS_FILE
    return [record for _, record in _lines(path, upto)] if path.is_file() else []


def truncate_metrics(run: str | Path, upto: int) -> None:
    """Keep the lines of ``RUN/metrics.jsonl`` done at step ``upto`` or before, byte for byte (a run
    resumed from its checkpoint at ``upto`` rewrites the rest); no file, nothing to do."""
    path = Path(run) / METRICS_FILE
    if path.is_file():
        atomic_write_text(path, "".join(line + "\n" for line, _ in _lines(path, upto)))


def monitor_rows(run: str | Path) -> list[MonitorRow]:
    """The curvature rows that ``curvlab train --curvature-every K`` wrote to ``RUN/metrics.jsonl``,
    by step (read by :func:`read_metrics`)."""
    if not (Path(run) / METRICS_FILE).is_file():
        raise CurvlabError(f"{run}: no {METRICS_FILE}")
    rows = [MonitorRow.from_dict(r) for r in read_metrics(run) if r.get("kind") == ROW_KIND]
    return sorted(rows, key=lambda r: r.step)
