"""Pruning a reproduction's runs to what its results read: the checkpoints inside the matched comparisons'
windows (:func:`window_checkpoints`) are kept, with each run's last; the rest are deleted (:func:`prune_run`), the
runs' indexes (and their validation losses) left whole."""

from __future__ import annotations

from pathlib import Path

from curvlab.analysis.report import load_report
from curvlab.runs.checkpoint import INDEX, is_checkpoint_name, read_index
from curvlab.studies.records import ComparisonRecord
from curvlab.util.paths import inside


def _run_key(path: str | Path) -> Path:
    """A checkpoint's place inside a reproduction (``s0/adamw/seed0/ckpt_000100.pt``): the same after the
    output directory is moved, which the absolute paths in the records are not."""
    return Path(*Path(path).parts[-4:])


def window_checkpoints(records: list[ComparisonRecord], reports: Path | None = None) -> set[Path]:
    """Every checkpoint a matched comparison read, as :func:`_run_key`: the members of its windows, read
    back from their reports. With ``reports`` (the reproduction's report cache) a report is looked up by
    its file name there, wherever the record says it was (the directory may have moved; and a record
    naming a file outside it is refused, :func:`~curvlab.util.paths.inside`). A report's checkpoint
    path only becomes a key: it keeps a checkpoint, never names one to read or delete."""
    keep = set()
    for r in records:
        for level in r.comparison.levels if r.comparison else []:
            for side in (level.a, level.b):
                for path in map(Path, side.reports):
                    found = path if reports is None else inside(reports, path.name, f"the record of {r.name}")
                    keep.add(_run_key(load_report(found).checkpoint))
    return keep


def prune_run(run: Path, keep: set[Path]) -> int:
    """Delete the checkpoints of ``run`` outside ``keep`` (:func:`_run_key` s), except its last (a finished
    run resumes from it as finished); the index keeps every entry (validation losses stay). Only
    checkpoint files inside ``run`` are deleted: an index naming one elsewhere is refused
    (:func:`read_index`), and one naming another of the run's files (``config.json``) deletes nothing.
    Returns the bytes freed."""
    index = read_index(run)
    freed = 0
    for entry in index[:-1]:
        path = inside(run, entry["path"], run / INDEX)
        if not is_checkpoint_name(path.name):
            continue
        if _run_key(path.resolve()) not in keep and path.is_file():
            freed += path.stat().st_size
            path.unlink()
    return freed
