"""What makes Muon's step flatter, as a report section and two figures (docs/science.md section 16): the
paired ratio's alignment and efficiency parts (every design), and, where the design measured the factorial,
its cells as a grid of ratios with intervals and its decomposition as bars."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from curvlab.output.cells import fmt, interval_text
from curvlab.output.plots import plt, save_figure
from curvlab.steps.factorial import FILTERS, MAPS
from curvlab.studies.mechanism import TERMS, CellEntry, Term
from curvlab.studies.summary import Summary

FILTER_TEXT = {"ema": "Adam's EMA (β₁ 0.9)", "nesterov": "Muon's Nesterov (0.95)"}
MAP_TEXT = {
    "identity": "identity",
    "adam": "Adam's diagonal",
    "sign": "sign",
    "msign": "msign",
    "random_sv": "random singular values",
}
TERM_TEXT = {
    "filter": "filter: EMA over Nesterov, under msign",
    "map": "map: Adam's over msign, after Nesterov",
    "interaction": "interaction",
    "alignment": "alignment: (cos AdamW / cos Muon)²",
    "efficiency": "efficiency: q Muon / q AdamW",
    "total": "the paired NDS ratio",
}


def _term(t: Term) -> str:
    return f"×{fmt(t.value)}{interval_text(t.ci95)}" if t.value is not None else "not measured"


def paired_parts_line(summary: Summary) -> str | None:
    """One sentence: what the paired NDS ratio is made of (``None`` where not measured)."""
    parts = summary.paired_parts
    if not parts or parts["total"].value is None:
        return None
    total, align, eff = parts["total"], parts["alignment"], parts["efficiency"]
    share = align.log / total.log if total.log else math.nan
    excluded = f", {total.excluded_points} with an NDS <= 0 left out" if total.excluded_points else ""
    return (
        f"What the paired NDS ratio is made of (AdamW's direction over Muon's at the same W and batch; here its "
        f"geometric mean over {total.n_points} points{excluded}, a seed's mean log, where the claim takes a "
        f"seed's median): {_term(total)} = AdamW's closer gradient-following (cos², the alignment part) "
        f"{_term(align)} × Muon's direction's efficiency q = cos²/NDS (the lr-free part) {_term(eff)}; alignment "
        f"is {share:.0%} of its log (docs/science.md section 16)."
    ) + (f" {split}" if (split := gauss_newton_line(summary)) else "")


def gauss_newton_line(summary: Summary) -> str | None:
    """One sentence: the paired NDS ratio's Gauss–Newton and residual parts (``None`` where not measured)."""
    parts = summary.paired_parts or {}
    if parts.get("gn_total") is None or parts["gn_total"].value is None:
        return None
    total, gn, residual = parts["gn_total"], parts["gauss_newton"], parts["gn_residual"]
    share = gn.log / total.log if total.log else math.nan
    excluded = f"; {total.excluded_points} with an NDS <= 0 left out" if total.excluded_points else ""
    return (
        f"Its Gauss–Newton split ({total.n_points} points{excluded}): {_term(total)} = the Gauss–Newton parts' "
        f"ratio {_term(gn)} × the residual's factor (1 + r_AdamW)/(1 + r_Muon) {_term(residual)}; the Gauss–Newton "
        f"part is {share:.0%} of its log (curvlab.curvature.gauss_newton)."
    )


def cells_table(cells: list[CellEntry], scope: str = "hidden") -> list[str]:
    """The factorial's cells over Muon's own (Nesterov × msign), one row a cell, with intervals."""
    lines = [
        "| filter | map | NDS ratio | cos ratio | q ratio | NDS ratio, held-out H | seeds, points |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for c in (c for c in cells if c.scope == scope):
        held = c.held_out or {}
        held_text = f"{fmt(held.get('nds_ratio'))}{interval_text((held.get('ci95') or {}).get('nds'))}"
        lines.append(
            f"| {FILTER_TEXT[c.filter]} | {MAP_TEXT[c.map]} | {fmt(c.nds_ratio)}{interval_text(c.ci95['nds'])} | "
            f"{fmt(c.cos_ratio)}{interval_text(c.ci95['cos'])} | {fmt(c.q_ratio)}{interval_text(c.ci95['q'])} | "
            f"{held_text} | {c.n_seeds}, {c.n_points} |"
        )
    return lines


def decomposition_lines(parts: dict[str, Term]) -> list[str]:
    """The decomposition of AdamW's cell over Muon's, term by term."""
    lines = ["| term | factor [95% CI] | seeds, points |", "|---|---:|---:|"]
    lines += [f"| {TERM_TEXT[t]} | {_term(parts[t])} | {parts[t].n_seeds}, {parts[t].n_points} |" for t in TERMS]
    excluded = max(parts[t].excluded_points for t in TERMS)
    note = f"{excluded} points with a cell's NDS ≤ 0 left out (counted, not logged)." if excluded else ""
    return [*lines, "", "filter × map × interaction = alignment × efficiency = AdamW's cell over Muon's. " + note]


def mechanism_section(summary: Summary) -> list[str]:
    """The report's section (empty where nothing of it was measured)."""
    line = paired_parts_line(summary)
    lines = ["## What makes Muon's step flatter", "", line, ""] if line else []
    return lines + factorial_lines(summary)


def factorial_lines(summary: Summary) -> list[str]:
    """The factorial's cells table and its decomposition (empty without them: every design but mechanism)."""
    lines = []
    if summary.cells:
        lines += [
            "The factorial of filters and maps on the hidden matrices, each cell over Muon's own (Nesterov × "
            "msign) at the same point: a seed's median of per-point ratios, with a log-t interval over seeds.",
            "",
            *cells_table(summary.cells),
            "",
        ]
    if summary.decomposition:
        lines += [
            "AdamW's cell (EMA × Adam) over Muon's, taken apart:",
            "",
            *decomposition_lines(summary.decomposition),
        ]
        lines.append("")
    return lines


def factorial_grid(cells: list[CellEntry], stem: str | Path) -> list[Path]:
    """The cells' NDS and q ratios to Muon's, by map, one marker a filter, with their intervals (log scale)."""
    hidden = [c for c in cells if c.scope == "hidden"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, quantity in zip(axes, ("nds", "q")):
        for k, f in enumerate(FILTERS):
            xs = np.arange(len(MAPS)) + (k - 0.5) * 0.2
            rows = [next(c for c in hidden if c.filter == f and c.map == m) for m in MAPS]
            ys = np.array([getattr(c, f"{quantity}_ratio") or np.nan for c in rows], dtype=float)
            ci = [c.ci95[quantity] or [np.nan, np.nan] for c in rows]
            err = np.abs(np.array(ci, dtype=float).T - ys)
            ax.errorbar(xs, ys, yerr=err, fmt="os"[k], capsize=3, label=FILTER_TEXT[f])
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(MAPS)), [MAP_TEXT[m] for m in MAPS], rotation=20, fontsize=8)
        ax.set_title(f"{quantity.upper() if quantity == 'nds' else 'q'} over Muon's cell (hidden matrices)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, stem)


def decomposition_bars(parts: dict[str, Term], stem: str | Path) -> list[Path]:
    """The decomposition's terms as log-scale bars with their intervals."""
    fig, ax = plt.subplots(figsize=(6, 3.2))
    values = np.array([parts[t].value or np.nan for t in TERMS], dtype=float)
    ci = np.array([parts[t].ci95 or [np.nan, np.nan] for t in TERMS], dtype=float).T
    ax.barh(range(len(TERMS)), np.log(values), xerr=np.abs(np.log(ci) - np.log(values)), capsize=3)
    ax.set_yticks(range(len(TERMS)), [TERM_TEXT[t] for t in TERMS], fontsize=8)
    ax.axvline(0.0, color="grey", lw=0.8)
    ax.set_xlabel("log factor (AdamW's cell over Muon's)")
    fig.tight_layout()
    return save_figure(fig, stem)


def mechanism_figures(summary: Summary, out: str | Path) -> dict[str, list[Path]]:
    """The factorial's figures, where the design measured it."""
    out = Path(out)
    written = {}
    if summary.cells:
        written["factorial"] = factorial_grid(summary.cells, out / "fig8_factorial")
    if summary.decomposition:
        written["decomposition"] = decomposition_bars(summary.decomposition, out / "fig8_decomposition")
    return written
