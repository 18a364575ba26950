"""Studies over many checkpoints: two optimizers at matched validation loss (``compare``), and one
run along its trajectory (``track``). Each analysed checkpoint's report is cached under
``OUT/reports/``, so a re-run (after an interruption, say) skips what is done.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from curvlab.analysis import AnalysisSettings, cached_report, load_report, report_cache_path
from curvlab.atomic import atomic_write_text
from curvlab.checkpoint import read_index
from curvlab.distributed import is_main
from curvlab.errors import CurvlabError
from curvlab.match import match_runs
from curvlab.monitor import ROW_KIND, MonitorRow

RATIO_KEYS = ("nds", "first_order", "curvature_penalty", "update_norm")
TAYLOR_TOLERANCE = 0.5


def taylor_holds(report: dict[str, Any], tolerance: float = TAYLOR_TOLERANCE) -> bool:
    """Whether the second-order prediction of the step's decrease is within ``tolerance`` of the
    realized one: outside that, the step has left the region a quadratic model describes (a loss spike,
    say) and its NDS says little about the optimizer; aggregates leave such steps out."""
    return abs(report["predicted"] - report["realized"]) <= tolerance * abs(report["realized"])


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]) if rows else [])
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(path, buffer.getvalue())


def _summary(report: dict[str, Any]) -> dict[str, Any]:
    """The scalars of a report that tables and figures use."""
    b = report["blocks"]
    hidden = report["hidden"] or {}
    return {
        "step": report["step"],
        "val_loss": report["val_loss"],
        "nds": report["nds"],
        "first_order": report["first_order"],
        "curvature_penalty": report["curvature_penalty"],
        "predicted": report["predicted"],
        "realized": report["realized"],
        "update_norm": report["update_norm"],
        "grad_norm": report["grad_norm"],
        "cosine": report["cosine"],
        "hidden_nds": hidden.get("nds"),
        "within": b["within"],
        "cross": b["cross"],
        "rho_within": b["rho_within"],
        "taylor_ok": taylor_holds(report),
    }


@dataclass(frozen=True)
class Comparison:
    """Matched-loss comparison of two runs. ``ratio_label`` says which is over which (Adam/Muon when
    the runs are AdamW and Muon, else B/A). The ratios aggregate the levels where the second-order
    expansion holds for both runs (:func:`taylor_holds`); every level stays in ``rows``."""

    rows: list[dict[str, Any]]
    mean_ratios: dict[str, float]  # mean over levels of the per-level ratios
    median_ratios: dict[str, float]
    ratio_of_means: dict[str, float]  # sum over levels of one over the other's: robust to near-zero levels
    ratio_label: str
    refused: list[str]

    optimizers: tuple[str, str] = ("", "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "ratio": self.ratio_label,
            "optimizers": list(self.optimizers),
            "mean_ratios": self.mean_ratios,
            "median_ratios": self.median_ratios,
            "ratio_of_means": self.ratio_of_means,
            "pairs": self.rows,
            "refused": self.refused,
        }


def compare_runs(
    run_a: str | Path,
    run_b: str | Path,
    out: str | Path,
    levels: int | Sequence[float] = 8,
    tolerance: float = 0.01,
    settings: AnalysisSettings | None = None,
    device: str = "cpu",
    progress: bool = True,
) -> Comparison:
    """Analyse every matched pair of two runs; write ``compare.json`` and ``compare.csv`` to ``out``."""
    settings = settings or AnalysisSettings()
    settings.validate()
    out = Path(out)
    matching = match_runs(run_a, run_b, levels if isinstance(levels, int) else list(levels), tolerance)
    if not matching.pairs:
        raise CurvlabError("no matched pair within tolerance: " + "; ".join(matching.refused))
    rows = []
    names = None
    for pair in tqdm(matching.pairs, desc="compare", disable=not progress):
        ra = cached_report(out / "reports", pair.path_a, settings, device=device)
        rb = cached_report(out / "reports", pair.path_b, settings, device=device)
        if names is None:
            names = (ra["optimizer"], rb["optimizer"])
        num, den = (ra, rb) if names == ("adamw", "muon") else (rb, ra)  # Adam over Muon, else B over A
        row = {"target": pair.target, "mismatch": pair.mismatch}
        for tag, path in (("a", pair.path_a), ("b", pair.path_b)):
            row[f"report_{tag}"] = str(report_cache_path(out / "reports", path, settings))
        for tag, r in (("a", ra), ("b", rb)):
            row.update({f"{k}_{tag}": v for k, v in _summary(r).items()})
        row.update({f"ratio_{k}": num[k] / den[k] if den[k] else float("nan") for k in RATIO_KEYS})
        rows.append(row)
    label = "adamw/muon" if names in (("muon", "adamw"), ("adamw", "muon")) else f"B/A ({names[1]}/{names[0]})"
    kept = [r for r in rows if r["taylor_ok_a"] and r["taylor_ok_b"]]
    if not kept:
        raise CurvlabError("at no matched level does the second-order expansion hold for both runs")
    mean = {k: float(np.nanmean([r[f"ratio_{k}"] for r in kept])) for k in RATIO_KEYS}
    median = {k: float(np.nanmedian([r[f"ratio_{k}"] for r in kept])) for k in RATIO_KEYS}
    num, den = ("a", "b") if names == ("adamw", "muon") else ("b", "a")
    of_means = {k: sum(r[f"{k}_{num}"] for r in kept) / sum(r[f"{k}_{den}"] for r in kept) for k in RATIO_KEYS}
    result = Comparison(rows, mean, median, of_means, label, matching.refused, names)
    if is_main():
        atomic_write_text(out / "compare.json", json.dumps(result.to_dict(), indent=1))
        _write_csv(out / "compare.csv", rows)
    return result


def track_run(
    run: str | Path,
    out: str | Path,
    every: int = 1,
    settings: AnalysisSettings | None = None,
    device: str = "cpu",
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Analyse every ``every``-th checkpoint of a run (step 0 excluded: there is no trajectory yet);
    write ``track.json`` and ``track.csv`` to ``out``. Returns the per-checkpoint summaries."""
    settings = settings or AnalysisSettings()
    settings.validate()
    if every < 1:
        raise CurvlabError(f"--every must be >= 1, got {every}")
    run, out = Path(run), Path(out)
    entries = [e for e in read_index(run) if e["step"] > 0][::every]
    if not entries:
        raise CurvlabError(f"{run}: no checkpoint after step 0 to track")
    rows = []
    for e in tqdm(entries, desc=f"track {run.name}", disable=not progress):
        report = cached_report(out / "reports", run / e["path"], settings, device=device)
        row = {**_summary(report), "optimizer": report["optimizer"]}
        if report.get("spectrum"):
            row["lambda_max"] = report["spectrum"]["lambda_max"]
            row["overlap_top_k"] = report["spectrum"]["overlap_top_k"]
        rows.append(row)
    if is_main():
        track = {"run": str(run), "settings": vars(settings), "rows": rows}
        atomic_write_text(out / "track.json", json.dumps(track, indent=1))
        _write_csv(out / "track.csv", rows)
    return rows


def pair_reports(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The two reports of one matched pair of a ``compare.json``, keyed by optimizer."""
    reports = [load_report(row[f"report_{tag}"]) for tag in ("a", "b")]
    return {r["optimizer"]: r for r in reports}


def within_layer_gap(compare: dict[str, Any]) -> tuple[list[str], list[float]]:
    """Per block, the within-layer entry M[l,l] of AdamW minus Muon's, averaged over the matched pairs."""
    gaps, names = [], []
    for row in compare["pairs"]:
        reports = pair_reports(row)
        if set(reports) != {"muon", "adamw"}:
            raise CurvlabError("within_layer_gap needs a comparison of a Muon run with an AdamW run")
        names = reports["muon"]["blocks"]["names"]
        gaps.append(np.diag(reports["adamw"]["blocks"]["matrix"]) - np.diag(reports["muon"]["blocks"]["matrix"]))
    return names, np.mean(gaps, axis=0).tolist()


def monitor_rows(run: str | Path) -> list[MonitorRow]:
    """The curvature rows that ``curvlab train --curvature-every K`` wrote to ``RUN/metrics.jsonl``,
    by step (a line cut by a crash ends the file, as on resume)."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise CurvlabError(f"{run}: no metrics.jsonl")
    rows = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        if record.get("kind") == ROW_KIND:
            rows.append(MonitorRow.from_dict(record))
    return sorted(rows, key=lambda r: r.step)


def _validation_losses(run: Path) -> dict[int, float]:
    """Step -> validation loss, from the checkpoint index and the training rows of metrics.jsonl."""
    losses = {e["step"]: e["val_loss"] for e in read_index(run) if e.get("val_loss") is not None}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        if record.get("kind") is None and "val_loss" in record:
            losses[record["step"]] = record["val_loss"]
    return losses


def track_monitor(run: str | Path, out: str | Path, every: int = 1) -> list[dict[str, Any]]:
    """:func:`track_run` without checkpoints: every ``every``-th curvature row a monitored run
    recorded while it trained (nothing is recomputed), each with the validation loss of its step
    where one was evaluated (else NaN); write ``track.json`` and ``track.csv`` to ``out``. Rows whose
    status is not ``ok`` stay, with their message, and count as Taylor failures."""
    if every < 1:
        raise CurvlabError(f"--every must be >= 1, got {every}")
    run, out = Path(run), Path(out)
    rows = monitor_rows(run)[::every]
    if not rows:
        raise CurvlabError(f"{run}: metrics.jsonl holds no curvature rows (train with --curvature-every K)")
    config = json.loads((run / "config.json").read_text()) if (run / "config.json").is_file() else {}
    val = _validation_losses(run)
    summaries = []
    for r in rows:
        row = {**r.summary(), "val_loss": val.get(r.step, float("nan")), "optimizer": config.get("optimizer", "")}
        row["taylor_ok"] = r.ok and taylor_holds(row)
        row["message"] = r.message
        summaries.append(row)
    if is_main():
        track = {"run": str(run), "source": "monitor", "heldout_tokens": rows[0].heldout_tokens, "rows": summaries}
        atomic_write_text(out / "track.json", json.dumps(track, indent=1))
        _write_csv(out / "track.csv", summaries)
    return summaries


TRACK_SOURCES = ("auto", "monitor", "checkpoints")


def track_source(run: str | Path, source: str = "auto") -> str:
    """``"monitor"`` or ``"checkpoints"``: what ``curvlab track`` draws for ``source``; ``"auto"``
    takes the monitor's rows when the run's metrics.jsonl holds any, else analyses the checkpoints."""
    if source not in TRACK_SOURCES:
        raise CurvlabError(f"unknown track source {source!r}; choose one of {', '.join(TRACK_SOURCES)}")
    if source != "auto":
        return source
    return "monitor" if (Path(run) / "metrics.jsonl").is_file() and monitor_rows(run) else "checkpoints"
