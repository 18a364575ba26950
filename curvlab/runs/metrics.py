"""A run's ``metrics.jsonl``, read in one place: one JSON object a line, appended as the run trains.

Training rows (no ``kind``) record step k once step k is done: ``step`` (steps done), ``train_loss``
and, where evaluated, ``val_loss``. Monitor rows (``kind`` = ``"curvature"``, :mod:`curvlab.runs.monitor`)
are measured at step k, before the step k -> k + 1, and written once that step is taken. So a row is
*done at* its step (a training row) or its step + 1 (a monitor row), and the rows of a run resumed
from its checkpoint at step s are those done at s or before: the resumed run rewrites the rest.

A line cut by a crash (no newline after it) ends the file; any other line that is no record is refused
by its number, and so is one that doesn't match its ``row_digest`` (16 hex digits of
:func:`curvlab.util.digest.json_digest` of the rest). Rows without one (curvlab 0.2.0 and before) are read
only where the run's index says so (:class:`curvlab.runs.checkpoint.RunIndex`). The rows must reach the
index's last checkpoint: a file cut short before it is refused, not read as a shorter run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from curvlab.errors import CurvlabError
from curvlab.runs.checkpoint import read_run_index
from curvlab.runs.monitor import ROW_KIND, MonitorRow
from curvlab.util.atomic import atomic_write_text
from curvlab.util.digest import json_digest
from curvlab.util.schema import parse_json

METRICS_FILE = "metrics.jsonl"
ROW_DIGEST = "row_digest"  # a row's digest of the rest of it (the module docstring)


def done_at(record: dict[str, Any]) -> int:
    """The step after which ``record`` is written: its step, or step + 1 for a monitor row."""
    return record["step"] + (record.get("kind") == ROW_KIND)


def row_line(row: dict[str, Any]) -> str:
    """The line of ``metrics.jsonl`` that records ``row`` (its JSON, with its ``row_digest``; no newline)."""
    return json.dumps({**row, ROW_DIGEST: _row_digest(json.loads(json.dumps(row)))})


def _row_digest(record: dict[str, Any]) -> str:
    return json_digest(record)[:16]  # (64 bits: against damage and edits by hand, not forgery)


def _record(line: str) -> dict[str, Any]:
    """The record of one line: a JSON object with an integer ``step`` (``ValueError`` if it is not)."""
    record = parse_json(line, "", "a row")
    if not (isinstance(record, dict) and type(record.get("step")) is int):
        raise ValueError("no JSON record with a step")
    return record


def _checked(record: dict[str, Any], legacy_upto: float, path: Path, number: int) -> dict[str, Any]:
    """``record`` without its digest, once it matches it; one without, if done at ``legacy_upto`` or before."""
    if ROW_DIGEST not in record:
        if done_at(record) <= legacy_upto:
            return record
        raise CurvlabError(
            f"{path}: line {number} has no {ROW_DIGEST}, and its run's index doesn't say an older curvlab wrote it; "
            "refused"
        )
    rest = {k: v for k, v in record.items() if k != ROW_DIGEST}
    if record[ROW_DIGEST] != _row_digest(rest):
        raise CurvlabError(f"{path}: line {number} does not match its {ROW_DIGEST} (edited or corrupt); refused")
    return rest


def _legacy_upto(run: Path) -> tuple[float, int]:
    """From the run's index: the step at or before which rows may lack digests (``inf``: any, a version-1
    index; ``-1``: none, and so with no index), and the last checkpoint's step, which the rows reach."""
    index = read_run_index(run)
    if index is None:
        return -1, 0
    return math.inf if index.legacy_rows_upto is None else index.legacy_rows_upto, index.entries[-1]["step"]


def _lines(path: Path, upto: int | None) -> list[tuple[str, dict[str, Any]]]:
    """The lines of ``path`` and their records (without their digests), done at step ``upto`` or before, as
    the module docstring says."""
    out, reached = [], 0
    legacy_upto, last_checkpoint = _legacy_upto(path.parent)
    lines = path.read_bytes().split(b"\n")
    for number, raw in enumerate(lines, 1):
        try:
            line = raw.decode()
            record = _record(line)
        except (ValueError, CurvlabError) as e:  # (UnicodeDecodeError is a ValueError)
            if number == len(lines):
                break  # no newline after it: a line cut by a crash (or nothing), and the file's end
            raise CurvlabError(f"{path}: line {number} is corrupt (no JSON record with a step); refused") from e
        record = _checked(record, legacy_upto, path, number)
        reached = max(reached, done_at(record))
        if upto is None or done_at(record) <= upto:
            out.append((line, record))
    if reached < last_checkpoint:
        raise CurvlabError(
            f"{path}: its rows end at step {reached}, before the last checkpoint's ({last_checkpoint}): cut short; "
            "refused"
        )
    return out


def read_metrics(run: str | Path, upto: int | None = None) -> list[dict[str, Any]]:
    """The records of ``RUN/metrics.jsonl`` in file order (none without the file), up to a line cut by a
    crash; with ``upto``, those done at step ``upto`` or before. Refuses what the module docstring says."""
    path = Path(run) / METRICS_FILE
    return [record for _, record in _lines(path, upto)] if path.is_file() else []


def truncate_metrics(run: str | Path, upto: int) -> None:
    """Keep the lines of ``RUN/metrics.jsonl`` done at step ``upto`` or before, byte for byte (a run resumed
    from its checkpoint at ``upto`` rewrites the rest); what :func:`read_metrics` refuses, or a link, is
    left as it is."""
    path = Path(run) / METRICS_FILE
    if path.is_symlink():  # (the run appends to it next: never through a link, to a file elsewhere)
        raise CurvlabError(f"{path}: is a symbolic link: refused (a run's metrics are a file of its own; remove it)")
    if path.is_file():
        atomic_write_text(path, "".join(line + "\n" for line, _ in _lines(path, upto)))


def monitor_rows(run: str | Path) -> list[MonitorRow]:
    """The curvature rows that ``curvlab train --curvature-every K`` wrote to ``RUN/metrics.jsonl``,
    by step (read by :func:`read_metrics`)."""
    if not (Path(run) / METRICS_FILE).is_file():
        raise CurvlabError(f"{run}: no {METRICS_FILE}")
    rows = [MonitorRow.from_dict(r) for r in read_metrics(run) if r.get("kind") == ROW_KIND]
    return sorted(rows, key=lambda r: r.step)
