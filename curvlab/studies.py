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

from curvlab.analysis import AnalysisSettings, cached_report
from curvlab.atomic import atomic_write_text
from curvlab.checkpoint import read_index
from curvlab.match import match_runs

RATIO_KEYS = ("nds", "first_order", "curvature_penalty", "update_norm")


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
    }


@dataclass(frozen=True)
class Comparison:
    """Matched-loss comparison of two runs. ``ratio_label`` says which is over which (Adam/Muon when
    the runs are AdamW and Muon, else B/A)."""

    rows: list[dict[str, Any]]
    mean_ratios: dict[str, float]
    ratio_label: str
    refused: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"ratio": self.ratio_label, "mean_ratios": self.mean_ratios, "pairs": self.rows, "refused": self.refused}


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
        raise ValueError("no matched pair within tolerance: " + "; ".join(matching.refused))
    rows = []
    names = None
    for pair in tqdm(matching.pairs, desc="compare", disable=not progress):
        ra = cached_report(out / "reports", pair.path_a, settings, device=device)
        rb = cached_report(out / "reports", pair.path_b, settings, device=device)
        if names is None:
            names = (ra["optimizer"], rb["optimizer"])
        # Adam over Muon when that is the pair, else B over A
        num, den = (ra, rb) if names == ("adamw", "muon") else (rb, ra)
        row = {"target": pair.target, "mismatch": pair.mismatch}
        for tag, r in (("a", ra), ("b", rb)):
            row.update({f"{k}_{tag}": v for k, v in _summary(r).items()})
        row.update({f"ratio_{k}": num[k] / den[k] if den[k] else float("nan") for k in RATIO_KEYS})
        rows.append(row)
    label = "adamw/muon" if names in (("muon", "adamw"), ("adamw", "muon")) else f"B/A ({names[1]}/{names[0]})"
    mean = {k: float(np.nanmean([r[f"ratio_{k}"] for r in rows])) for k in RATIO_KEYS}
    result = Comparison(rows, mean, label, matching.refused)
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
        raise ValueError(f"--every must be >= 1, got {every}")
    run, out = Path(run), Path(out)
    entries = [e for e in read_index(run) if e["step"] > 0][::every]
    if not entries:
        raise ValueError(f"{run}: no checkpoint after step 0 to track")
    rows = []
    for e in tqdm(entries, desc=f"track {run.name}", disable=not progress):
        report = cached_report(out / "reports", run / e["path"], settings, device=device)
        rows.append({**_summary(report), "optimizer": report["optimizer"]})
    atomic_write_text(
        out / "track.json", json.dumps({"run": str(run), "settings": vars(settings), "rows": rows}, indent=1)
    )
    _write_csv(out / "track.csv", rows)
    return rows
